"""Watch triggers judge agents' live durations in passes: every report arriving within
``OBSERVE_COALESCE_S`` of the first is judged in one pass, in which each trigger reads its
role's history and spans once (not once per report: a fleet's ranks each report about once
a second, and reading the role per report is quadratic in ranks). On the real in-process
coordinator with SQLite, 200 ranks reporting step times and ``update`` spans in relay-sized
batches: one slow rank is found by both a step-time and a straggler trigger, each firing
once on it (the straggler's waiting for the rank the first one's session holds); the role
was read once a pass."""

from __future__ import annotations

import asyncio
import gc
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from profd.actors import triggers
from profd.actors.coordinator import ProfileCoordinator
from profd.core.protocol import AgentEvent, AgentInfo, EventKind, LabelDurations, MarkDurations
from profd.core.request import ToolKind

from helpers import coordinator_settings

RANKS, SLOW, SLOW_FROM, STEPS = 200, 137, 8, 12
STEP_S, UPDATE_S = 0.10, 0.04


def times(rank: int, step: int, t0: float) -> MarkDurations:
    slow = rank == SLOW and step >= SLOW_FROM
    wall = UPDATE_S * (4 if slow else 1) + rank * 1e-6  # distinct, with one outlier
    start = t0 + step * STEP_S * 5
    return MarkDurations(
        step=LabelDurations("step", (STEP_S * (4 if slow else 1),)),
        stages=(LabelDurations("update", (wall,), spans=((step, start, start + wall),)),),
    )


async def scenario(tmp_path: Path) -> tuple[Any, dict[str, int], list[Any]]:
    c = ProfileCoordinator(coordinator_settings(tmp_path, tick_s=3600.0))
    await c.start()
    try:
        caps = {t.value: None for t in ToolKind}
        ids = []
        for r in range(RANKS):
            info = AgentInfo(
                f"actor-{r}", "actor", r, RANKS, {}, "host", os.getpid(), node_id=f"n{r // 8}",
                capabilities=caps,
            )  # fmt: skip
            await c.register(info, 0)
            ids.append(info.agent_id)
        session = {"next_steps": 1, "tool": "py_spy"}
        slow = await c.add_trigger({
            "name": "slow-step", "when": {"kind": "step_time", "role": "actor", "factor": 2.0,
            "baseline_steps": 3}, "session": session, "cooldown_s": 3600,
        })  # fmt: skip
        late = await c.add_trigger({
            "name": "late-update", "when": {"kind": "straggler", "role": "actor",
            "stage": "update"}, "session": session, "cooldown_s": 3600,
        })  # fmt: skip
        desk = c._triggers
        reads = {"history": 0, "spans": 0}
        for name in reads:
            real = getattr(desk, f"_{name}")

            def counted(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
                reads[_name] += 1
                return _real(*args, **kw)

            setattr(desk, f"_{name}", counted)
        t0 = time.time()
        for step in range(STEPS):
            before = desk.passes
            for first in range(0, RANKS, 8):  # a relay's batch: one node's 8 ranks
                batch = {
                    ids[r]: [AgentEvent(EventKind.TIMES, None, step, payload=times(r, step, t0))]
                    for r in range(first, first + 8)
                }
                assert all((await c.report_many(batch)).values())
            deadline = time.monotonic() + 30
            while desk.passes == before:  # poll the real state: the pass has run
                assert time.monotonic() < deadline, "no pass judged the step's reports"
                await asyncio.sleep(0.01)
        for _ in range(300):
            views = [await c.get_trigger(t.trigger_id) for t in (slow, late)]
            if views[0].fired and views[1].firings:
                break
            await asyncio.sleep(0.02)
        return desk, reads, views
    finally:
        c.close()


def test_a_fleets_reports_are_judged_in_passes_reading_the_role_once(tmp_path) -> None:
    desk, reads, views = asyncio.run(scenario(tmp_path))
    reports = RANKS * STEPS
    # one pass per step's 25 batches (two where a batch came after the pass began)
    assert STEPS <= desk.passes <= 2 * STEPS, desk.passes
    assert reads["history"] <= desk.passes and reads["spans"] <= desk.passes, (reads, reports)
    for v in views:
        (firing,) = v.firings  # once each: the cooldown holds the next
        assert firing.evidence["rank"] == SLOW, firing
    # the step-time trigger's session holds the slow rank: the straggler's waits for it
    assert views[0].fired == 1 and views[0].firings[0].session_id
    assert views[1].firings[0].state == "due" and views[1].firings[0].evidence["step"] == SLOW_FROM


async def one_node(tmp_path: Path, ranks: int) -> ProfileCoordinator:
    """A started in-process coordinator with ``ranks`` actor agents on one node."""
    c = ProfileCoordinator(coordinator_settings(tmp_path, tick_s=3600.0))
    await c.start()
    caps = {t.value: None for t in ToolKind}
    for r in range(ranks):
        info = AgentInfo(
            f"actor-{r}", "actor", r, ranks, {}, "host", os.getpid(), node_id="n0",
            capabilities=caps,
        )  # fmt: skip
        await c.register(info, 0)
    return c


def test_reports_waiting_for_their_pass_are_not_held_by_the_collector(
    tmp_path, monkeypatch
) -> None:
    """A pass holds a fleet's reports for up to ``OBSERVE_COALESCE_S``: what it keeps of
    each must be plain numbers and names, which the collector stops tracking (the reports
    themselves, held that long, reached its oldest generation and made it run about once a
    second at 10,000 ranks)."""
    monkeypatch.setattr(triggers, "OBSERVE_COALESCE_S", 3600.0)  # the pass waits for us

    async def run() -> tuple[list[Any], int, int]:
        c = await one_node(tmp_path, 8)
        try:
            await c.add_trigger(
                {"name": "late", "when": {"kind": "straggler", "role": "actor", "stage": "update"}}
            )
            batch = {
                f"actor-{r}": [AgentEvent(EventKind.TIMES, None, 3, payload=times(r, 3, 0.0))]
                for r in range(8)
            }
            assert all((await c.report_many(batch)).values())
            desk = c._triggers
            waiting = list(desk._unjudged)
            gc.collect()  # once: what a report leaves for its pass is untracked at once
            tracked = [w for w in waiting if gc.is_tracked(w)]
            desk.judge_pending()
            return tracked, len(waiting), desk.passes
        finally:
            c.close()

    tracked, waiting, passes = asyncio.run(run())
    assert waiting == 8 and passes == 1
    assert tracked == []


def test_a_trigger_says_why_it_judges_nothing(tmp_path) -> None:
    """A trigger on a stage no agent of its role times (a role prefix forgotten: verl's
    workers label ``actor_update``), on steps where its workers mark none, or on a role with
    no agent, is accepted (agents come later) but its view says why it judges nothing."""

    async def run() -> dict[str, str | None]:
        c = await one_node(tmp_path, 2)
        try:
            watch = {
                "wrong-stage": {"kind": "stage_time", "role": "actor", "stage": "update"},
                "right-stage": {"kind": "straggler", "role": "actor", "stage": "actor_update"},
                "steps": {"kind": "step_time", "role": "actor"},
                "no-agents": {"kind": "step_time", "role": "critic"},
                "oom": {"kind": "oom", "role": "actor"},
            }
            ids = {
                n: (await c.add_trigger({"name": n, "when": w})).trigger_id
                for n, w in watch.items()
            }
            before = {n: (await c.get_trigger(i)).idle_reason for n, i in ids.items()}
            stages = (LabelDurations("actor_update", (0.1,)), LabelDurations("gen", (0.2,)))
            times = MarkDurations(step=None, stages=stages)  # a driver's worker: no step
            batch = {
                f"actor-{r}": [AgentEvent(EventKind.TIMES, None, 3, payload=times)]
                for r in range(2)
            }
            assert all((await c.report_many(batch)).values())
            after = {n: (await c.get_trigger(i)).idle_reason for n, i in ids.items()}
            return {**{f"before:{n}": v for n, v in before.items()}, **after}
        finally:
            c.close()

    got = asyncio.run(run())
    assert got["before:wrong-stage"] is None and got["before:steps"] is None  # no times yet
    assert got["wrong-stage"] == (
        "no agent of role 'actor' times stage 'update' (its stages: actor_update, gen)"
    )
    assert got["right-stage"] is None and got["oom"] is None
    assert got["steps"] is not None and "marks steps" in got["steps"]
    assert got["no-agents"] == got["before:no-agents"] == "no alive agent of role 'critic'"


def test_a_profiled_agents_grace_is_kept_by_every_report_it_sends(tmp_path, monkeypatch) -> None:
    """While profiled, an agent's every report renews its grace (its durations right after
    the session carry the profiler's stop and export), whether or not a trigger reads the
    mark it reported: a step-time trigger and a report of stages only."""
    monkeypatch.setattr(triggers, "OBSERVE_COALESCE_S", 3600.0)

    async def run() -> tuple[float | None, float | None]:
        c = await one_node(tmp_path, 2)
        try:
            await c.add_trigger({"name": "slow", "when": {"kind": "step_time", "role": "actor"}})
            desk = c._triggers
            live = SimpleNamespace(targets={"actor-0": None}, is_live=True, finished_at=None)
            desk._recent = lambda since: [live]
            stages_only = MarkDurations(step=None, stages=(LabelDurations("gen", (0.2,)),))
            ev = AgentEvent(EventKind.TIMES, None, 3, payload=stages_only)
            assert all((await c.report_many({"actor-0": [ev], "actor-1": [ev]})).values())
            desk.judge_pending()
            return desk._profiled_at.get("actor-0"), desk._profiled_at.get("actor-1")
        finally:
            c.close()

    profiled, other = asyncio.run(run())
    assert profiled is not None and other is None


def test_the_grace_runs_from_the_sessions_end_not_the_agents_last_report(tmp_path) -> None:
    """A window's stop held a rank's loop, and so its reports, for 10 s; the session then
    ended. Its durations right after the end are spared for PROFILED_GRACE_S from the end
    (before, the grace ran from its last report, long past: a straggler trigger fired on
    the step after profd's own session). An agent the session did not hold gets none."""

    async def run() -> list[bool]:
        c = await one_node(tmp_path, 2)
        try:
            desk = c._triggers
            now = [100.0]
            desk._clock = lambda: now[0]
            session = SimpleNamespace(targets={"actor-1": None}, is_live=True, finished_at=None)
            desk._recent = lambda since: [
                s for s in [session] if s.is_live or s.finished_at >= since
            ]
            got = [desk._profiling_now()("actor-1")]  # a report while live (t=100)
            now[0] = 110.0  # ten seconds of no reports: the loop is held by the stop
            session.is_live, session.finished_at = False, 110.0
            now[0] = 110.5  # the first report after the end
            got += [desk._profiling_now()("actor-1"), desk._profiling_now()("actor-0")]
            now[0] = 110.0 + triggers.PROFILED_GRACE_S + 0.1
            got.append(desk._profiling_now()("actor-1"))
            return got
        finally:
            c.close()

    assert asyncio.run(run()) == [True, True, False, False]


def test_an_event_that_cannot_be_applied_spares_the_rest_of_the_batch(
    tmp_path, monkeypatch, caplog
) -> None:
    """A broken agent's malformed durations (spans that are not ``(step, start, end)``)
    failed the watch triggers' flattening, and with it the whole relay batch: every agent
    of the node lost its report. Now that one event is skipped, counted and logged once;
    its agent's next event and the other agents' are applied."""
    monkeypatch.setattr(triggers, "OBSERVE_COALESCE_S", 3600.0)

    async def run() -> tuple[list[Any], dict[str, Any], dict[str, bool]]:
        c = await one_node(tmp_path, 2)
        try:
            await c.add_trigger(
                {"name": "late", "when": {"kind": "straggler", "role": "actor", "stage": "update"}}
            )
            broken = MarkDurations(
                step=LabelDurations("step", (0.1,)),
                stages=(LabelDurations("update", (0.04,), spans=(None,)),),  # type: ignore[arg-type]
            )
            bad = AgentEvent(EventKind.TIMES, None, 3, payload=broken)
            good = [AgentEvent(EventKind.TIMES, None, 3, payload=times(r, 3, 0.0)) for r in (0, 1)]
            known = await c.report_many({"actor-0": [bad, good[0]], "actor-1": [good[1]]})
            await c.report_many({"actor-0": [bad]})
            waiting = [(w[0], w[3]) for w in c._triggers._unjudged]
            return waiting, await c.metrics(), known
        finally:
            c.close()

    waiting, metrics, known = asyncio.run(run())
    assert known == {"actor-0": True, "actor-1": True}
    assert waiting == [("actor-0", 3), ("actor-1", 3)]  # the good reports, for the next pass
    assert metrics["rejected_events_total"] == 2 and metrics["events_total"] == 4
    logged = [r for r in caplog.records if "could not be applied" in r.getMessage()]
    assert len(logged) == 1 and "actor-0" in logged[0].getMessage()


def test_closing_the_coordinator_cancels_a_waiting_pass(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(triggers, "OBSERVE_COALESCE_S", 3600.0)

    async def run() -> tuple[Any, Any, int]:
        c = await one_node(tmp_path, 2)
        await c.add_trigger({"name": "slow", "when": {"kind": "step_time", "role": "actor"}})
        ev = AgentEvent(EventKind.TIMES, None, 3, payload=times(0, 3, 0.0))
        await c.report_many({"actor-0": [ev]})
        desk = c._triggers
        waiting = desk._pass
        c.close()
        return waiting, desk._pass, len(desk._unjudged)

    waiting, after, unjudged = asyncio.run(run())
    assert waiting is not None and waiting.cancelled()
    assert after is None and unjudged == 0


def test_two_jobs_of_one_role_are_judged_apart_and_fire_in_their_own_job(
    tmp_path, monkeypatch
) -> None:
    """Two Ray jobs run role actor, ranks 0-2 each: job A's steps take 1 s, job B's 0.1 s
    but its rank 1's 0.3 s. Pooled (and keyed by rank, as before), B's rank 1 is under the
    median and A's and B's ranks overwrite each other; judged per job, B's rank 1 is 3x its
    job's baseline. The firing's session is in job B: B's rank 1 and a B peer. A straggler
    trigger keeps each job's verdicts apart (judging one never clears the other's)."""
    monkeypatch.setattr(triggers, "OBSERVE_COALESCE_S", 3600.0)  # passes run when called

    async def run() -> tuple[Any, Any]:
        c = ProfileCoordinator(coordinator_settings(tmp_path, tick_s=3600.0))
        await c.start()
        try:
            caps = {t.value: None for t in ToolKind}
            for job in ("0a000000", "0b000000"):
                for r in range(3):
                    info = AgentInfo(
                        f"{job}-{r}", "actor", r, 3, {}, "host", 100 + r, node_id="n0",
                        capabilities=caps, job_id=job,
                    )  # fmt: skip
                    await c.register(info, 0)
            trig = await c.add_trigger({
                "name": "slow", "when": {"kind": "step_time", "role": "actor", "factor": 2.0,
                "baseline_steps": 6}, "session": {"next_steps": 1}, "cooldown_s": 3600,
            })  # fmt: skip
            for step in range(1, 5):
                batch = {}
                for job, base in (("0a000000", 1.0), ("0b000000", 0.1)):
                    for r in range(3):
                        took = base * (3 if job == "0b000000" and r == 1 and step >= 3 else 1)
                        d = MarkDurations(step=LabelDurations("step", (took,)), stages=())
                        batch[f"{job}-{r}"] = [AgentEvent(EventKind.TIMES, None, step, payload=d)]
                assert all((await c.report_many(batch)).values())
                c._triggers.judge_pending()
            for _ in range(200):
                view = await c.get_trigger(trig.trigger_id)
                if view.firings and view.firings[0].session_id:
                    break
                await asyncio.sleep(0.02)
            session = await c.get_session(view.firings[0].session_id)
            return view, session
        finally:
            c.close()

    view, session = asyncio.run(run())
    (firing,) = view.firings
    assert firing.evidence["rank"] == 1 and firing.evidence["agent_id"] == "0b000000-1"
    assert firing.evidence["job_id"] == "0b000000"  # kept: the offender may be gone by then
    assert session.request["job_id"] == "0b000000"
    assert sorted(t.agent_id for t in session.targets)[0] == "0b000000-0"
    assert {t.agent_id for t in session.targets} <= {"0b000000-0", "0b000000-1", "0b000000-2"}
    assert "0b000000-1" in {t.agent_id for t in session.targets}


def test_a_straggler_trigger_keeps_each_jobs_verdicts() -> None:
    from profd.actors.trigger_book import KEPT_JOBS, Trigger
    from profd.core.trigger_request import TriggerRequest

    req = TriggerRequest.model_validate(
        {"name": "late", "when": {"kind": "straggler", "role": "actor", "stage": "update"}}
    )
    t = Trigger("t1", req, 0.0)
    t.judge_job("a")
    t.verdicts[5], t.verdict_agents = "A5", frozenset({"a0"})  # type: ignore[assignment]
    t.judge_job("b")
    assert t.verdicts == {} and t.verdict_agents == frozenset()
    t.verdicts[9] = "B9"  # type: ignore[assignment]
    t.judge_job("a")
    assert t.verdicts == {5: "A5"} and t.verdict_agents == {"a0"}
    t.judge_job("b")
    assert t.verdicts == {9: "B9"}
    for n in range(KEPT_JOBS + 5):  # many jobs come and go: a bounded number is kept
        t.judge_job(f"j{n}")
    assert len(t.other_jobs) <= KEPT_JOBS
