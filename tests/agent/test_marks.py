"""Step marks of an agent that holds a window for a later step: O(1) until that step."""

from __future__ import annotations

from typing import Any

from profd.agent import ProfilerAgent
from profd.agent.window_state import NO_STEP
from profd.backends.base import NoopBackend
from profd.core.protocol import AgentPlan, WindowPlan


def armed_agent(tmp_path, steps: tuple[int, ...]) -> tuple[ProfilerAgent, list[Any]]:
    opened: list[Any] = []

    def factory(kind: str, options: dict[str, Any]) -> NoopBackend:
        opened.append(kind)
        return NoopBackend()

    agent = ProfilerAgent("actor", 0, 1, find_link=lambda: None, backend_factory=factory)
    window = WindowPlan(
        "s", "torch", steps, tuple((s,) for s in steps), False, {}, str(tmp_path), "*"
    )
    agent._install_plan(AgentPlan(version=1, windows=(window,)))  # as the poller does
    return agent, opened


def test_marks_before_the_window_do_not_call_into_the_recorder(tmp_path) -> None:
    agent, opened = armed_agent(tmp_path, (50,))
    recorder = agent._recorder
    with agent.step(1):  # adopts the plan
        pass
    assert recorder.seen is agent._armed and recorder.wake_at == 50
    calls = []
    real_enter, real_exit = recorder.enter_step, recorder.exit_step
    recorder.enter_step = lambda *a: (calls.append(("enter", a[0])), real_enter(*a))
    recorder.exit_step = lambda *a: (calls.append(("exit", a[0])), real_exit(*a))
    for s in range(2, 50):
        with agent.step(s):
            pass
    assert calls == [] and opened == []
    with agent.step(50):
        assert agent.recording
    with agent.step(51):
        pass
    assert calls == [("enter", 50), ("exit", 50)]  # the window's step; none after it
    assert opened == ["torch"] and recorder.wake_at == NO_STEP
    assert agent.close(5)


def test_a_step_the_loop_skipped_is_reported_at_the_next_mark(tmp_path) -> None:
    agent, opened = armed_agent(tmp_path, (3, 10))
    for s in (1, 2, 4):  # 3 never runs
        with agent.step(s):
            pass
    ws = agent._recorder._windows["s"]
    assert ws.missed == {3} and agent._recorder.wake_at == 10 and opened == []
    assert agent.close(5)


def test_a_step_that_is_not_a_number_never_raises(tmp_path) -> None:
    agent, _ = armed_agent(tmp_path, (5,))
    with agent.step(None):  # type: ignore[arg-type]
        pass
    with agent.step(1):
        pass
    with agent.step("x"):  # type: ignore[arg-type]
        pass
    assert agent.close(5)
