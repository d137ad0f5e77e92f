"""An oom trigger on real agents and an in-process coordinator. A real
``torch.cuda.OutOfMemoryError`` (a plain RuntimeError subclass, raised here since this
machine has no GPU) leaves rank 1's ``update`` stage while a ``torch_memory`` window records
it (CUDA's allocator calls replaced by a fake, as in tests/backends): the mark re-raises it,
the snapshot is kept and named in the ``oom`` event, and the trigger starts one session on
rank 1 and a healthy peer once that window is over, with its evidence. A second error,
crossing a stage and a step mark, is one more condition, suppressed by the cooldown."""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from profd.backends.torch_memory import CudaMemoryApi, TorchMemoryBackend

from helpers import start_agents, wait_armed, wait_terminal, wait_until

OOM_RANK = 1
SNAPSHOT = {"segments": [{"total_size": 1 << 20}], "device_traces": [[]]}


class FakeCudaMemory(CudaMemoryApi):
    """CUDA's allocator history, without a GPU (no OOM observer: the agent dumps)."""

    def is_available(self) -> bool:
        return True

    def start_history(self, max_entries: int) -> None:
        pass

    def stop_history(self) -> None:
        pass

    def snapshot(self) -> Any:
        return SNAPSHOT

    def attach_oom_observer(self, callback: Any) -> bool:
        return False


@pytest.fixture
def fake_cuda_memory(monkeypatch) -> None:
    from profd.backends import torch_memory

    monkeypatch.setattr(TorchMemoryBackend, "api", FakeCudaMemory())
    monkeypatch.setattr(torch_memory._OomHook, "attached", False)


def step_all(agents: list[Any], step: int, oom: BaseException | None = None) -> None:
    """One step of every rank; rank 1 raises ``oom`` in its ``update`` stage, which must
    come out of the marks as itself (the job catches it and goes on, as jobs that skip a
    batch on OOM do)."""
    for rank, a in enumerate(agents):
        raise_it = oom is not None and rank == OOM_RANK
        expect = pytest.raises(type(oom)) if raise_it else _nothing()
        with expect as caught, a.step(step), a.stage("update"):
            time.sleep(0.005)
            if raise_it:
                raise oom
        if raise_it:
            assert caught.value is oom


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return False


def test_an_oom_keeps_the_snapshot_and_starts_one_session_on_the_rank_and_a_peer(
    fake_cuda_memory, local_coordinator
) -> None:
    owner = local_coordinator
    agents = start_agents(owner, 3)
    request = {"name": "oom", "when": {"kind": "oom", "role": "actor"},
               "session": {"tool": "torch_memory", "next_steps": 1}, "cooldown_s": 600}  # fmt: skip
    tid = owner.call("add_trigger", request).trigger_id
    try:
        step_all(agents, 0)
        window = owner.call(
            "create_session",
            {"tool": "torch_memory", "steps": [3], "roles": {"actor": {"ranks": [OOM_RANK]}}},
        )
        wait_armed(agents[OOM_RANK], window.session_id)
        step = 1
        for step in range(1, 3):
            step_all(agents, step)
        error = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        step_all(agents, 3, error)

        def fired() -> Any:
            v = owner.call("get_trigger", tid)
            return v if v.fired == 1 else None

        view = None
        for step in range(4, 400):  # the loop goes on; the firing waits for the window
            step_all(agents, step)
            if (view := fired()) is not None:
                break
        assert view is not None, "the oom trigger never fired"
        (firing,) = view.firings
        sid = firing.session_id
        for later in range(step + 1, step + 400):  # its session records the next step
            step_all(agents, later)
            if owner.call("get_session", sid).state.is_terminal:
                break
        step = later
        session = wait_terminal(owner, sid)
        # a second error, through the stage and the step mark: one condition, in cooldown
        step_all(agents, step + 1, RuntimeError("CUDA out of memory. Tried to allocate 8 MiB"))
        assert agents[OOM_RANK]._channel.flush(10)
        after = wait_until(
            lambda: (v := owner.call("get_trigger", tid)).suppressed and v, 10, what="suppressed"
        )
    finally:
        for a in agents:
            a.close(timeout=5)
    window = wait_terminal(owner, window.session_id)
    assert window.state.value == "done", window.reason
    ev = firing.evidence
    assert ev["kind"] == "oom" and ev["rank"] == OOM_RANK and ev["mark"] == "update"
    assert ev["agent_id"] == agents[OOM_RANK].agent_id and ev["step"] == 3
    assert ev["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    # the snapshot of the window that was recording, kept: one file, named in the evidence
    (kept,) = Path(window.save_dir).glob("*_oom*.pickle")
    assert ev["snapshot_path"] == str(kept) and kept.name.endswith("_oom1.pickle")
    assert pickle.loads(kept.read_bytes()) == SNAPSHOT
    assert session.trigger_id == tid and session.evidence == ev
    assert session.state.value == "done", session.reason
    ranks = sorted(t.rank for t in session.targets)
    assert OOM_RANK in ranks and len(ranks) == 2, ranks
    assert after.fired == 1 and after.suppressed == {"cooldown": 1}
    assert len(owner.call("list_sessions")) == 2  # the window, and the trigger's


def test_the_fake_snapshot_has_the_shape_of_a_real_one() -> None:
    """The snapshot the fake allocator gives, against the one a real out-of-memory error left
    on an H200 (tests/fixtures/cuda, by tests/backends/test_gpu.py): the same keys, of the
    same types, and the real one's last allocator entry is the error itself."""
    (path,) = (Path(__file__).parent.parent / "fixtures" / "cuda").glob("*_oom1.pickle")
    real = pickle.loads(path.read_bytes())
    assert set(SNAPSHOT) <= set(real)
    for key, value in SNAPSHOT.items():
        assert type(real[key]) is type(value), key
    assert set(SNAPSHOT["segments"][0]) <= set(real["segments"][0])
    assert [e["action"] for e in real["device_traces"][0]][-1] == "oom"
