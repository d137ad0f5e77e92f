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
    view = local_coordinator.call("create_session", {"duration_s": 1.0})
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
