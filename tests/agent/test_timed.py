"""Timed windows (``duration_s``) for targets without steps: inference, stalled loops."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from profd.backends.torch_backend import read_trace
from profd.core.request import SessionRequest

from helpers import busy_python_work, start_agents, user_ranges, wait_armed, wait_terminal


def test_window_kinds_are_exclusive_and_validated() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        SessionRequest.model_validate({"steps": [1], "duration_s": 5})
    with pytest.raises(ValueError, match="duration_s"):
        SessionRequest.model_validate({"duration_s": 0})
    assert SessionRequest.model_validate({"duration_s": 2.5}).duration_s == 2.5


def test_py_spy_profiles_a_stalled_loop(local_coordinator) -> None:
    """No marks at all while the window runs: the py-spy window starts on its own thread."""
    (agent,) = start_agents(local_coordinator, role="rollout")
    view = local_coordinator.call("create_session", {"tool": "py_spy", "duration_s": 1.5})
    assert view.steps == [] and view.state.value == "armed"
    busy_python_work(3.0)  # the "training thread" is stuck in here
    view = wait_terminal(local_coordinator, view.session_id, timeout=60)
    assert view.state.value == "done", view.reason
    (trace,) = view.traces
    assert trace.scope == "window" and trace.steps == [] and "_window_" in trace.file_name
    frames = {f["name"] for f in json.loads(Path(trace.path).read_text())["shared"]["frames"]}
    assert "busy_python_work" in frames
    agent.close()


def test_torch_timed_window_opens_and_closes_at_marks(local_coordinator) -> None:
    """An inference worker with stages but no steps."""
    (agent,) = start_agents(local_coordinator, role="inference")
    roles = {"inference": {"discrete": True}}  # said not to apply, not silently dropped
    view = local_coordinator.call("create_session", {"duration_s": 1.0, "roles": roles})
    assert view.discrete_roles == []
    assert view.warnings == [
        "roles.inference.discrete: not used by a timed window (duration_s): one collection "
        "per target"
    ]
    wait_armed(agent, view.session_id)
    started = time.monotonic()
    calls = 0
    while time.monotonic() - started < 3.0:
        with agent.stage("generate"):
            torch.ones(16).sum()
        calls += 1
        time.sleep(0.02)
    view = wait_terminal(local_coordinator, view.session_id)
    assert view.state.value == "done", view.reason
    (trace,) = view.traces
    names = user_ranges(read_trace(trace.path))
    recorded = names.count("generate")
    assert 10 < recorded < calls  # about one second of a three-second loop
    assert trace.file_name.startswith("inference_window_rank0")
    agent.close()


def test_a_timed_window_ended_inside_a_step_does_not_claim_it(local_coordinator) -> None:
    """The deadline passes in a step's long first stage, so the window ends at the second
    stage's mark, inside the step: the file keeps the step's start, but neither its header
    (``profd.steps``) nor the session counts it whole, and a summary leaves it out."""
    from profd.analysis.summary import summarize_dir

    (agent,) = start_agents(local_coordinator)
    view = local_coordinator.call("create_session", {"duration_s": 0.3})
    wait_armed(agent, view.session_id)
    for step in range(1, 4):
        with agent.step(step):
            with agent.stage("rollout"):
                time.sleep(0.4)  # past the deadline, counted from the window's start
            with agent.stage("update"):
                torch.ones(16).sum()
    view = wait_terminal(local_coordinator, view.session_id)
    assert view.state.value == "done", view.reason
    (trace,) = view.traces
    data = read_trace(trace.path)
    assert "step1" in user_ranges(data) and "update" not in user_ranges(data)
    assert data["profd"]["steps"] == [] and trace.steps == []
    summary = summarize_dir(Path(trace.path).parent)
    assert summary.files[0].partial_steps == [1] and summary.step_times == []
    agent.close()


def test_a_timed_window_begun_inside_a_step_does_not_count_its_rest(local_coordinator) -> None:
    """The window opens at a stage mark inside step 1 and ends at one inside step 3: only
    step 2 is whole. Step 1's rest (its update stage) was kept with no step before."""
    from profd.analysis.summary import summarize_dir

    (agent,) = start_agents(local_coordinator)
    with agent.step(1):
        with agent.stage("rollout"):
            view = local_coordinator.call("create_session", {"duration_s": 1.5})
            wait_armed(agent, view.session_id)
        with agent.stage("update"):  # the window opens at this mark
            torch.ones(16).sum()
    for step in (2, 3):
        with agent.step(step):
            with agent.stage("rollout"):
                time.sleep(0.1 if step == 2 else 1.6)  # step 3's passes the deadline
            with agent.stage("update"):
                torch.ones(16).sum()
    view = wait_terminal(local_coordinator, view.session_id)
    (trace,) = view.traces
    header = read_trace(trace.path)["profd"]
    assert (header["began_in_step"], header["steps"], trace.steps) == (1, [2], [2])
    summary = summarize_dir(Path(trace.path).parent)
    assert summary.files[0].partial_steps == [1, 3]
    assert [r.step for r in summary.step_times] == [2]
    assert {r.step for r in summary.stage_times} == {2}  # no stage without a step
    agent.close()


def test_a_timed_window_begun_between_steps_claims_no_step_it_began_in(local_coordinator) -> None:
    """Opened at a stage outside any step (an eval after step 1 ended), the window did not
    begin inside step 1: its header says so (no ``began_in_step``) and the eval counts. The
    loop's steps are numpy integers: the header holds them as JSON numbers."""
    import numpy as np

    from profd.analysis.summary import summarize_dir

    (agent,) = start_agents(local_coordinator)
    with agent.step(np.int64(1)), agent.stage("rollout"):
        torch.ones(16).sum()
    view = local_coordinator.call("create_session", {"duration_s": 0.5})
    wait_armed(agent, view.session_id)
    with agent.stage("eval"):  # the window opens here, between steps
        torch.ones(16).sum()
    for step in range(2, 40):
        with agent.step(np.int64(step)), agent.stage("update"):
            time.sleep(0.1)
        if not agent.recording:
            break
    view = wait_terminal(local_coordinator, view.session_id)
    (trace,) = view.traces
    header = read_trace(trace.path)["profd"]
    assert "began_in_step" not in header and header["steps"][0] == 2, header
    summary = summarize_dir(Path(trace.path).parent)
    assert "eval" in {r.stage for r in summary.stage_times}
    assert 1 not in summary.files[0].partial_steps  # (the last may be: the deadline's)
    agent.close()


def test_timed_window_without_any_mark_is_missed_with_a_hint(local_coordinator) -> None:
    (agent,) = start_agents(local_coordinator)
    view = local_coordinator.call("create_session", {"duration_s": 0.5})
    wait_armed(agent, view.session_id)
    time.sleep(1.0)
    agent.close()  # the job ends without ever reaching a mark
    view = wait_terminal(local_coordinator, view.session_id)
    assert view.state.value == "failed" and view.traces == []
    assert "no mark reached the agent" in view.targets[0].reason
    assert "py_spy" in view.targets[0].reason


def test_a_profiler_that_fails_to_stop_ends_a_timed_window_never_the_loop(
    monkeypatch, local_coordinator
) -> None:
    """torch failing to stop at a timed window's deadline (met inside the job's next stage)
    or at the job's end: reported on the session, never raised out of ``agent.stage`` or
    ``agent.close``; the loop runs on and the next window records."""
    from profd.backends import torch_backend

    real_close = torch_backend._TorchCollection.close

    def close_then_fail(self):  # stopped for real (Kineto free again), then an error
        real_close(self)
        raise RuntimeError("kineto stop failed")

    monkeypatch.setattr(torch_backend._TorchCollection, "close", close_then_fail)
    (agent,) = start_agents(local_coordinator, role="inference")
    view = local_coordinator.call("create_session", {"duration_s": 0.3})
    wait_armed(agent, view.session_id)
    ended = time.monotonic() + 20  # the first start may take a second or two
    while time.monotonic() < ended:
        with agent.stage("generate"):  # raised at the first stage past the deadline
            time.sleep(0.05)
        if not agent.recording:
            break
    view = wait_terminal(local_coordinator, view.session_id)
    assert view.state.value == "failed" and "kineto stop failed" in view.targets[0].reason
    # the job ends while a timed window records: close() says so and returns
    view = local_coordinator.call("create_session", {"duration_s": 60})
    wait_armed(agent, view.session_id)
    with agent.stage("generate"):
        pass
    assert agent.recording
    agent.close(timeout=10)
    view = wait_terminal(local_coordinator, view.session_id)
    assert "kineto stop failed" in view.targets[0].reason


def test_an_agent_keeps_no_state_per_finished_window(tmp_path: Path) -> None:
    """A job profiled every few minutes for weeks: what an agent keeps of finished windows
    is bounded, and a window still listed in its plan is never run twice."""
    import threading

    from profd.agent.timed import TimedWindows
    from profd.agent.window_state import FinishedIds
    from profd.backends.base import Backend, Collection
    from profd.core.protocol import AgentInfo, EventKind, WindowPlan

    class Quick(Collection):
        def close(self) -> list:
            return []

    class Sampler(Backend):
        @classmethod
        def unavailable_reason(cls) -> None:
            return None

        def open(self, spec) -> Collection:
            return Quick()

    events, done = [], threading.Semaphore(0)

    def emit(e) -> None:
        events.append((e.kind, e.session_id))
        if e.kind is EventKind.PART_DONE:
            done.release()

    info = AgentInfo("a0", "rollout", 0, 1, {}, "host", 1, node_id="n0")
    timed = TimedWindows(lambda: info, emit, lambda tool, cfg: Sampler())
    plans = [
        WindowPlan(f"s{i}", "py_spy", (), (), False, {}, str(tmp_path), "*", duration_s=0.01)
        for i in range(40)
    ]
    for w in plans:  # each session's window stays planned a while after it ended
        timed.sync((w,))
        assert done.acquire(timeout=10)
        timed.sync((w,))
    timed.close(5)
    assert timed._running == {}
    assert [sid for k, sid in events if k is EventKind.RECORDING] == [w.session_id for w in plans]
    ids = FinishedIds(keep=3)
    for sid in "abcde":
        ids.add(sid)
    assert len(ids) == 3 and "a" not in ids and "e" in ids
