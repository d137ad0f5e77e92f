"""A CUDA out-of-memory error leaving the marks of a real agent (no coordinator: its events
are caught where it hands them to its channel): one ``oom`` event per error, at the
innermost mark, the error re-raised as itself; other errors pass untouched; a failure to
report never reaches the loop; with a ``torch_memory`` window recording, the snapshot its
OOM observer wrote (as CUDA's allocator calls it, before raising) is the one named."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from profd.agent import ProfilerAgent
from profd.backends.base import Collection, NoopBackend
from profd.core.protocol import AgentPlan, EventKind, OutOfMemory, WindowPlan


def agent(**kw: Any) -> tuple[ProfilerAgent, list]:
    a = ProfilerAgent("actor", 0, 2, find_link=lambda: None, **kw)
    sent: list = []
    a._emit = sent.append  # type: ignore[method-assign]
    return a, [sent]


def ooms(sent: list) -> list[OutOfMemory]:
    return [e.payload for e in sent[0] if e.kind is EventKind.OOM]


def oom(msg: str = "CUDA out of memory. Tried to allocate 20.00 MiB") -> BaseException:
    return torch.cuda.OutOfMemoryError(msg)


@pytest.mark.parametrize("mark_times", [True, False])
def test_one_event_per_error_at_the_innermost_mark_and_the_error_goes_on(mark_times) -> None:
    a, sent = agent(mark_times=mark_times)
    err = oom()
    with (
        pytest.raises(torch.cuda.OutOfMemoryError) as caught,
        a.step(4),
        a.stage("update", role="actor"),
    ):
        raise err
    assert caught.value is err
    (got,) = ooms(sent)
    # an untimed agent's idle stage is the shared no-op: its step mark tells
    assert got.stage == ("actor_update" if mark_times else None)
    assert got.error.startswith("OutOfMemoryError: CUDA out of memory")
    assert got.snapshot_path is None
    assert sent[0][0].step == 4 and sent[0][0].message == got.error
    with pytest.raises(RuntimeError), a.step(5):  # told by its message, a step mark only
        raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")
    assert [o.stage for o in ooms(sent)][1:] == [None]
    with pytest.raises(ValueError), a.step(6), a.stage("update"):
        raise ValueError("not memory")
    assert len(ooms(sent)) == 2
    assert a.close(5)


def test_a_failing_report_never_replaces_the_error(caplog) -> None:
    a, _ = agent()

    def broken(event: Any) -> None:
        raise RuntimeError("channel gone")

    a._emit = broken  # type: ignore[method-assign]
    err = oom()
    level = caplog.at_level(logging.ERROR, logger="profd.agent.agent")
    with level, pytest.raises(torch.cuda.OutOfMemoryError) as caught, a.step(1), a.stage("x"):
        raise err
    assert caught.value is err
    assert any("reporting an out-of-memory error failed" in r.getMessage() for r in caplog.records)
    with a.step(2), a.stage("x"):  # the marks go on
        pass
    assert a.current_step == 2 and a.close(5)


def test_the_snapshot_of_a_recording_torch_memory_window_is_named(tmp_path: Path) -> None:
    """The window's collection dumps at OOM (as the torch_memory backend's observer does);
    the agent names that file, and a second error dumps and names a new one."""

    class MemoryCollection(Collection):
        def __init__(self, stem: str) -> None:
            self.stem, self.n = stem, 0

        def close(self) -> list:
            return []

        def dump_oom(self) -> None:
            self.n += 1
            (tmp_path / f"{self.stem}_oom{self.n}.pickle").write_bytes(b"snapshot")

    made: list[MemoryCollection] = []

    class Backend(NoopBackend):
        def open(self, spec: Any) -> Any:
            made.append(MemoryCollection(f"actor_rank0_pid{os.getpid()}_20260101000000000"))
            return made[-1]

    a, sent = agent(backend_factory=lambda kind, options: Backend())
    w = WindowPlan("s1", "torch_memory", (1, 2), ((1, 2),), False, {}, str(tmp_path), "*")
    a._install_plan(AgentPlan(version=1, windows=(w,)))
    with pytest.raises(torch.cuda.OutOfMemoryError), a.step(1), a.stage("update"):
        made[0].dump_oom()  # the observer, called by CUDA's allocator before it raises
        raise oom()
    with pytest.raises(torch.cuda.OutOfMemoryError), a.step(2), a.stage("update"):
        raise oom()  # no observer (none attached): the agent has the collection dump
    first, second = ooms(sent)
    stem = made[0].stem
    assert first.snapshot_path == str(tmp_path / f"{stem}_oom1.pickle")
    assert second.snapshot_path == str(tmp_path / f"{stem}_oom2.pickle")
    assert len(list(tmp_path.glob("*_oom*.pickle"))) == 2  # never a second file for one error
    assert len(made) == 1  # both in the one collection of steps 1 and 2
    a.close(5)
