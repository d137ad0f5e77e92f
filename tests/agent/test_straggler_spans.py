"""The stage spans straggler triggers compare (``LabelDurations.spans``), from a real agent's
marks (no coordinator): each stage sample placed in the step it ended in, on the
coordinator's wall clock (the agent's clock offset applied), once that step is over; in a
worker following its driver's steps, unplaced (the coordinator places it); waiting while the
offset is unknown; a stage outside every step is not placed."""

from __future__ import annotations

import time

from profd.agent import ProfilerAgent
from profd.agent.clock_sync import ClockEstimate
from profd.core.protocol import AgentPlan, MarkDurations

OFFSET_NS = 5 * 10**9  # the coordinator's clock is 5 s ahead of this process's


def agent(offset: int | None = OFFSET_NS, spans: bool = True) -> ProfilerAgent:
    """An agent whose plan says a straggler trigger watches its role (span mode)."""
    a = ProfilerAgent("actor", 0, 2, find_link=lambda: None)
    a._clock_estimate = lambda: (  # type: ignore[method-assign]
        None if offset is None else ClockEstimate(offset, 1000, time.time_ns(), 5)
    )
    a._install_plan(AgentPlan(version=1, spans=spans))
    return a


def spans(times: MarkDurations | None, label: str) -> list[tuple[int, float, float]]:
    if times is None:
        return []
    return [s for d in times.stages if d.label == label for s in d.spans]


def test_spmd_stages_are_placed_in_their_step_once_it_is_over() -> None:
    a = agent()
    before = time.time() + OFFSET_NS / 1e9
    with a.step(1):
        with a.stage("fwd"):
            time.sleep(0.01)
        early = a._take_times()  # the step is not over: its duration ships, its span waits
        with a.stage("fwd"):
            pass
    with a.stage("between"):  # outside every step: never placed
        pass
    with a.step(2), a.stage("fwd"):
        pass
    after = time.time() + OFFSET_NS / 1e9
    assert [d.label for d in early.stages] == ["fwd"] and early.stages[0].spans == ()
    late = a._take_times()
    (fwd,) = [d for d in late.stages if d.label == "fwd"]
    assert len(fwd.seconds) == 2  # the durations since the last take
    got = spans(late, "fwd")
    assert [s for s, _, _ in got] == [1, 1, 2]  # the first waited for step 1 to end
    for _, start, end in got:
        assert before - 0.05 <= start <= end <= after + 0.05  # the coordinator's clock
    assert got[0][2] - got[0][1] >= 0.01 and spans(late, "between") == []
    assert a.close(5)


def test_a_driver_following_worker_ships_its_stages_for_the_coordinator_to_place() -> None:
    """A worker that marks no step learns its driver's steps only while a session needs
    them: it ships every stage sample unplaced, the coordinator (which hears every step the
    driver announces) places it. Announced steps change nothing: before this, samples went
    to the step followed last, which after a session was a stale one forever."""
    a = agent()
    before = time.time() + OFFSET_NS / 1e9
    for step in (7, 8, None, None):
        if step is not None:
            a._install_plan(AgentPlan(version=step, controller_step=step, spans=True))
        with a.stage("generate"):
            time.sleep(0.002)
        with a.stage("reward"):
            pass
    after = time.time() + OFFSET_NS / 1e9
    times = a._take_times()
    assert times.step is None  # a worker marks no step of its own
    for label in ("generate", "reward"):
        got = spans(times, label)
        assert [s for s, _, _ in got] == [None] * 4
        assert all(before - 0.05 <= start <= end <= after + 0.05 for _, start, end in got)
        assert [start for _, start, _ in got] == sorted(start for _, start, _ in got)
    assert spans(a._take_times(), "generate") == []  # shipped once
    assert a.close(5)


def test_spans_wait_while_the_clock_offset_is_unknown() -> None:
    offset: list[int | None] = [None]
    a = agent()
    a._clock_estimate = lambda: (  # type: ignore[method-assign]
        None if offset[0] is None else ClockEstimate(offset[0], 1000, time.time_ns(), 5)
    )
    for step in range(3):
        with a.step(step), a.stage("update"):
            pass
    first = a._take_times()
    assert len(first.stages[0].seconds) == 3 and spans(first, "update") == []
    offset[0] = -OFFSET_NS
    got = spans(a._take_times(), "update")
    assert [s for s, _, _ in got] == [0, 1, 2]
    assert abs(got[-1][2] - (time.time() - OFFSET_NS / 1e9)) < 1.0
    assert a.close(5)


def test_without_a_straggler_trigger_marks_keep_no_ends_and_ship_no_spans() -> None:
    from profd.agent.step_marks import SpanStepMark, TimedStepMark
    from profd.agent.timings import SpanStageTimer, StageTimer

    a = agent(spans=False)
    for step in range(3):
        with a.step(step), a.stage("fwd"):
            pass
    timer = a._stage_timers["fwd"]
    assert type(timer) is StageTimer and type(a._step_mark) is TimedStepMark
    assert timer.ends == [0.0] * len(timer.ends)  # the idle mark wrote its duration only
    plain = a._take_times()
    assert len(plain.step.seconds) == 3 and spans(plain, "fwd") == []
    in_flight = timer.head  # a plain exit under way while the poller swaps the class ...
    a._install_plan(AgentPlan(version=2, spans=True))  # a straggler trigger now watches
    assert type(timer) is SpanStageTimer and type(a._step_mark) is SpanStepMark
    timer.ring[in_flight] = 0.001  # ... ends after it: a duration, no end
    timer.head = in_flight + 1
    for step in range(3, 6):
        with a.step(step), a.stage("fwd"):
            pass
    # the in-flight sample is left out (its end was never written), the others are placed
    times = a._take_times()
    assert [s for s, _, _ in spans(times, "fwd")] == [3, 4, 5]
    assert len(next(d for d in times.stages if d.label == "fwd").seconds) == 4
    a._install_plan(AgentPlan(version=3, spans=False))
    assert type(timer) is StageTimer and type(a._step_mark) is TimedStepMark
    assert a.close(5)
