"""A ``next_steps`` window starts ``align_lead_s`` ahead by the pace of the targets' loops: a
short step mark in a loop that waits between steps is not a fast step."""

from __future__ import annotations

import asyncio
from pathlib import Path

from profd.actors.mark_stats import MarkStats
from profd.core.protocol import AgentEvent, EventKind, LabelDurations, MarkDurations
from tests.coordinator.test_coordinator_unit import EVERY_ACTOR, info, make


def times(step: int, seconds: float) -> AgentEvent:
    payload = MarkDurations(step=LabelDurations("step", (seconds,)))
    return AgentEvent(EventKind.TIMES, None, step=step, payload=payload)


def test_the_step_period_is_the_loops_pace_when_slower_than_the_step_mark() -> None:
    stats = MarkStats()
    for i in range(8):  # a 10 ms step every 0.5 s, two new steps a report each second
        stats.add("a", MarkDurations(step=LabelDurations("step", (0.01, 0.01))), 2 * i, float(i))
    assert stats.step_median("a") == 0.01
    assert stats.step_period("a") == 0.5
    # steps back to the start (the job restarted): the old pace is dropped
    stats.add("a", MarkDurations(step=LabelDurations("step", (0.01,))), 0, 20.0)
    assert stats.step_period("a") == 0.01  # no pace yet: the mark's own median
    # a loop whose steps fill it: the pace is the step's own time, or the median if longer
    busy = MarkStats()
    for i in range(8):
        busy.add("b", MarkDurations(step=LabelDurations("step", (0.2,) * 5)), 5 * i, float(i))
    assert busy.step_period("b") == 0.2
    # reports that show no new step add nothing
    slow = MarkStats()
    for t in range(6):
        slow.add("c", MarkDurations(step=LabelDurations("step", ())), 7 + t // 3, float(t))
    assert slow.step_period("c") is None  # one gap: it could have been a pause
    for t in range(6, 9):
        slow.add("c", MarkDurations(step=LabelDurations("step", ())), 7 + t // 3, float(t))
    assert slow.step_period("c") == 3.0


def test_next_steps_are_lead_by_the_pace_not_the_step_marks_own_time(tmp_path: Path) -> None:
    async def go() -> None:
        coord, clock = make(tmp_path, align_lead_steps=1, align_lead_s=0.6, align_timeout_s=0)
        await coord.start()
        for aid, rank in (("a", 0), ("b", 1)):
            await coord.register(info(aid, rank=rank), 0)
        step = 0
        for _ in range(8):  # 10 ms steps, one every 0.5 s
            clock.advance(1.0)
            step += 2
            for aid in ("a", "b"):
                assert await coord.report(aid, [times(step, 0.01)])
        view = await coord.create_session({"next_steps": 1, "roles": EVERY_ACTOR})
        # 0.6 s ahead at 0.5 s a step: 2 steps after the current one, not 60 (0.6 / 0.01)
        assert view.steps == [step + 1 + 2]

    asyncio.run(go())
