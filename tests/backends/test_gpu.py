"""Checks that need a CUDA device (marked ``gpu``; skipped where there is none).

Run on a GPU machine with ``python -m pytest -m gpu tests/backends/test_gpu.py``.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from profd.backends import capabilities
from profd.backends.base import CollectionSpec
from profd.backends.torch_backend import read_trace
from profd.backends.torch_memory import TorchMemoryBackend
from profd.backends.torch_output import NO_DEVICE_EVENTS

from helpers import start_agents, wait_armed, wait_terminal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def gpu_step(agent, step: int, model: torch.nn.Module) -> None:
    with agent.step(step):
        with agent.stage("compute_log_prob"), torch.no_grad():
            model(torch.randn(256, 1024, device="cuda"))
        with agent.stage("update_actor", update_loop=True):
            for i in range(2):
                with agent.mini_batch(i):
                    model(torch.randn(256, 1024, device="cuda")).sum().backward()
        torch.cuda.synchronize()


def keep(path: str) -> None:
    """Copy an artefact to $OUT when the device runner collects one."""
    out = os.environ.get("OUT")
    if out:
        shutil.copy(path, Path(out) / Path(path).name)


def test_capabilities_on_a_gpu_machine() -> None:
    caps = capabilities()
    assert caps["torch"] is None and caps["torch_memory"] is None


def test_cuda_window_records_device_events(local_coordinator) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU()).cuda()
    (agent,) = start_agents(local_coordinator)
    gpu_step(agent, 0, model)
    view = local_coordinator.call("create_session", {"steps": [1]})
    wait_armed(agent, view.session_id)
    for s in (1, 2):
        gpu_step(agent, s, model)
    view = wait_terminal(local_coordinator, view.session_id, timeout=60)
    agent.close()
    assert view.state.value == "done", view.reason
    assert not any(NO_DEVICE_EVENTS in w for w in view.warnings), view.warnings
    (trace,) = view.traces
    keep(trace.path)
    data = read_trace(trace.path)
    cats = {e.get("cat") for e in data["traceEvents"]}
    assert "kernel" in cats and "cuda_runtime" in cats
    names = {e["name"] for e in data["traceEvents"] if e.get("cat") == "user_annotation"}
    assert {"step1", "compute_log_prob", "update_actor", "mini_batch1"} <= names
    assert data["distributedInfo"]["rank"] == 0


def test_torch_memory_snapshot_per_step(local_coordinator) -> None:
    (agent,) = start_agents(local_coordinator)
    with agent.step(0):
        pass
    view = local_coordinator.call(
        "create_session",
        {
            "tool": "torch_memory",
            "steps": [1, 2],
            "roles": {"*": {"tool_config": {"torch_memory": {"trace_alloc_max_entries": 1000}}}},
        },
    )
    wait_armed(agent, view.session_id)
    held = []
    for s in (1, 2, 3):
        with agent.step(s), agent.stage("alloc"):
            held.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    view = wait_terminal(local_coordinator, view.session_id, timeout=60)
    agent.close()
    assert view.state.value == "done", view.reason
    assert sorted(t.steps[0] for t in view.traces) == [1, 2]
    for t in view.traces:
        keep(t.path)
        snap = pickle.loads(Path(t.path).read_bytes())
        assert snap["segments"], "the snapshot holds the allocator's segments"
        events = [e for trace in snap["device_traces"] for e in trace]
        assert any(e.get("action") == "alloc" for e in events)


def test_out_of_memory_dumps_a_snapshot(tmp_path) -> None:
    spec = CollectionSpec(tmp_path, "actor_train_step1_rank0_pid1_20260101000000000", {})
    coll = TorchMemoryBackend({"trace_alloc_max_entries": 1000}).open(spec)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    coll.close()
    ooms = list(tmp_path.glob("*_oom1.pickle"))
    assert len(ooms) == 1 and pickle.loads(ooms[0].read_bytes())["segments"] is not None


def rich_gpu_step(agent, step: int, model: torch.nn.Module, side: torch.cuda.Stream) -> None:
    """One step with what real device traces hold: kernels on two streams, host-to-device,
    device-to-host and device-to-device copies, a backward pass and an optimizer step."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with agent.step(step):
        with agent.stage("generate"), torch.no_grad():
            batch = torch.randn(128, 512, pin_memory=True).cuda(non_blocking=True)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                extra = model(batch * 2)
            out = model(batch)
            torch.cuda.current_stream().wait_stream(side)
            (out + extra).sum().item()  # a device-to-host copy
        with agent.stage("update"):
            buf = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
            buf.zero_()
            torch.empty_like(buf).copy_(buf)  # a device-to-device copy
            model(batch).square().mean().backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()


def test_real_cuda_trace_reads_the_same_on_both_parsers(local_coordinator) -> None:
    """A real CUDA window, digested by the fast and the generic parser alike, with the GPU
    breakdown adding up; the file is kept as the recorded real trace the CPU tests check the
    hand-made GPU traces against (tests/fixtures/cuda)."""
    from profd.analysis import summarize_dir
    from profd.analysis.digest import digest_file

    model = torch.nn.Sequential(
        torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)
    ).cuda()
    side = torch.cuda.Stream()
    (agent,) = start_agents(local_coordinator)
    rich_gpu_step(agent, 0, model, side)
    view = local_coordinator.call("create_session", {"steps": [1]})
    wait_armed(agent, view.session_id)
    for s in (1, 2):
        rich_gpu_step(agent, s, model, side)
    view = wait_terminal(local_coordinator, view.session_id, timeout=60)
    agent.close()
    assert view.state.value == "done", view.reason
    (trace,) = view.traces
    keep(trace.path)
    fast, generic = digest_file(trace.path), digest_file(trace.path, force_generic=True)
    assert (fast.mode, fast.error) == ("fast", None)
    assert fast.gpu is not None and fast.gpu == generic.gpu
    assert fast.ops == generic.ops
    t = fast.gpu.total
    assert t.kernels > 5 and t.compute > 0 and t.memory > 0
    assert abs(t.idle + t.compute + t.non_compute - t.window) < 1e-3 * t.window
    assert {"generate", "update"} <= set(fast.gpu.stages)
    summary = summarize_dir(Path(trace.path).parent, workers=1)
    (g,) = summary.gpu
    assert g.kernels == t.kernels
    assert {r.stage for r in g.stages} >= {"generate", "update"}


def test_a_real_cuda_oom_fires_the_oom_trigger(local_coordinator) -> None:
    """A real out-of-memory error leaves the ``update`` stage while a torch_memory window
    records: the allocator's own snapshot at the error is kept and named in the evidence,
    and the oom trigger's session records the next step's CUDA trace."""
    owner = local_coordinator
    (agent,) = start_agents(owner)
    request = {"name": "oom", "when": {"kind": "oom", "role": "actor"},
               "session": {"tool": "torch", "next_steps": 1}, "cooldown_s": 600}  # fmt: skip
    tid = owner.call("add_trigger", request).trigger_id
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU()).cuda()
    gpu_step(agent, 0, model)
    window = owner.call("create_session", {"tool": "torch_memory", "steps": [2]})
    wait_armed(agent, window.session_id)
    gpu_step(agent, 1, model)
    with pytest.raises(torch.OutOfMemoryError), agent.step(2), agent.stage("update"):
        model(torch.randn(64, 1024, device="cuda"))
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    fired = None
    for step in range(3, 300):  # the loop goes on; the firing waits for the window to end
        gpu_step(agent, step, model)
        fired = owner.call("get_trigger", tid)
        if fired.fired:
            break
    assert fired is not None and fired.fired == 1, "the oom trigger never fired"
    (firing,) = fired.firings
    for later in range(step + 1, step + 300):
        gpu_step(agent, later, model)
        if owner.call("get_session", firing.session_id).state.is_terminal:
            break
    session = wait_terminal(owner, firing.session_id, timeout=60)
    window = wait_terminal(owner, window.session_id, timeout=60)
    agent.close()
    ev = firing.evidence
    assert ev["kind"] == "oom" and ev["mark"] == "update" and ev["step"] == 2
    assert ev["error"].startswith("OutOfMemoryError: CUDA out of memory"), ev["error"]
    (kept,) = Path(window.save_dir).glob("*_oom*.pickle")
    assert ev["snapshot_path"] == str(kept)
    keep(str(kept))
    snap = pickle.loads(kept.read_bytes())
    actions = {e.get("action") for trace in snap["device_traces"] for e in trace}
    assert snap["segments"] and "oom" in actions, actions
    assert session.state.value == "done", session.reason
    (trace,) = session.traces
    cats = {e.get("cat") for e in read_trace(trace.path)["traceEvents"]}
    assert "kernel" in cats
