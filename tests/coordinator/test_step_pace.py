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


def test_next_steps_count_the_steps_a_late_report_has_not_told(tmp_path: Path) -> None:
    """A target whose last step report is seconds old (its link moving to its node's relay
    as the job starts; a loaded node) has run on at its pace since: the window is placed
    ahead of where it is now, not where it was. Seen on a two-node cluster: a rank's step
    known 2 s late, its plan came during step 12 for a window at step 10."""
    rank1 = {"actor": {"ranks": [1]}}

    async def go() -> tuple[list[int] | None, ...]:
        coord, clock = make(tmp_path, align_lead_steps=1, align_lead_s=0.6, align_timeout_s=0)
        await coord.start()
        for aid, rank in (("a", 0), ("b", 1)):
            await coord.register(info(aid, rank=rank), 0)
        for step in range(2, 18, 2):  # a step every 0.5 s, reported each second
            clock.advance(1.0)
            assert await coord.report("b", [times(step, 0.01)])
        reported, chosen = clock(), []
        for late_s in (0.2, 2.1, 600.0):  # since b's report of step 16
            clock.advance(reported + late_s - clock())
            view = await coord.create_session({"next_steps": 1, "roles": rank1})
            chosen.append(view.steps)
            await coord.cancel_session(view.session_id)
        return tuple(chosen)

    fresh, late, paused = asyncio.run(go())
    assert fresh == [16 + 1 + 2]
    assert late == [16 + 4 + 1 + 2]  # 2.1 s at 0.5 s a step: 4 steps since it reported
    assert paused == [16 + 50 + 1 + 2]  # at most MAX_LEAD_STEPS: a paused loop stays near


def test_a_hung_loop_is_not_sent_far_ahead_by_its_pace_before_the_hang(tmp_path: Path) -> None:
    """A fast loop (a step every 10 ms) that hangs: `profd profile --next-steps 1` while it
    stands at its step placed the window 50 steps ahead (the lead from the fast pace), so
    the job, once it recovered, ran 50 steps before profd recorded. The time it has stood
    there is its pace now: the window is the next step but the lead."""

    async def go() -> tuple[list[int] | None, list[int] | None]:
        coord, clock = make(tmp_path, align_lead_steps=1, align_lead_s=0.6, align_timeout_s=0)
        await coord.start()
        await coord.register(info("a", rank=0), 0)
        step = 0
        for _ in range(6):  # 100 steps a second, reported each second
            clock.advance(1.0)
            step += 100
            assert await coord.report("a", [times(step, 0.01)])
        running = await coord.create_session({"next_steps": 1, "roles": EVERY_ACTOR})
        await coord.cancel_session(running.session_id)
        for _ in range(30):  # hung: its reports show the same step for 30 s
            clock.advance(1.0)
            assert await coord.report("a", [times(step, 0.01)])
        hung = await coord.create_session({"next_steps": 1, "roles": EVERY_ACTOR})
        return running.steps, hung.steps

    running, hung = asyncio.run(go())
    assert running == [600 + 1 + 50]  # 0.6 s at 10 ms a step: the most lead there is
    assert hung == [600 + 1 + 1]
