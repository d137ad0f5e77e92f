"""The coordinator called directly on one event loop: a fake clock, an in-memory store and a
local runner (no threads, no Ray, no polling for a condition). Time moves only when a test
moves it, and housekeeping runs only when a test calls ``tick()``."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from profd.actors.coordinator import ProfileCoordinator, Registration
from profd.actors.runner import LocalRunner
from profd.actors.store import MemoryStore
from profd.core.errors import ConflictError, NotFoundError, RequestInvalid
from profd.core.protocol import AgentEvent, AgentInfo, DriverAck, EventKind, PartDone, TraceWritten
from profd.core.settings import CoordinatorSettings
from profd.core.states import AgentState, ControllerPhase, PartState, SessionState

from helpers import wait_until

T0 = 1_700_000_000.0
#: Both agents of :func:`two_agents` (without ``roles`` a request takes rank 0 of each role).
EVERY_ACTOR = {"actor": {"all_ranks": True}}


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class KeepingStore(MemoryStore):
    """Keeps what was saved in memory, so a second coordinator restores it."""

    def __init__(self) -> None:
        self.sessions: dict[str, dict[str, Any]] = {}
        self.parts: dict[str, dict[str, dict[str, Any]]] = {}
        self.traces: dict[str, dict[str, Any]] = {}

    def load(self) -> dict[str, list[dict[str, Any]]]:
        sessions = [
            {**header, "targets": dict(self.parts.get(sid, {}))}
            for sid, header in self.sessions.items()
        ]
        return {"sessions": sessions, "traces": list(self.traces.values())}

    def save_session(
        self, session_id: str, data: dict[str, Any], parts: dict[str, dict[str, Any]]
    ) -> bool:
        self.sessions[session_id] = dict(data)
        self.parts.setdefault(session_id, {}).update(parts)
        return True

    def save_trace(self, trace_id: str, session_id: str, data: dict[str, Any]) -> None:
        self.traces[trace_id] = data

    def save_traces(self, rows: list[tuple[str, str, bytes]]) -> None:
        for trace_id, _, data in rows:
            self.traces[trace_id] = orjson.loads(data)


def settings(tmp_path: Path, **overrides: Any) -> CoordinatorSettings:
    values: dict[str, Any] = dict(
        save_root=str(tmp_path / "profile"),
        base_dir=str(tmp_path),
        heartbeat_timeout_s=30.0,
        align_timeout_s=0.0,  # next_steps aligns on what the registry knows, at once
        session_timeout_s=600.0,
        tick_s=3600.0,  # the loop's own ticks never come during a test
        liveness_check_s=0.0,
    )
    values.update(overrides)
    return CoordinatorSettings(**values)


def make(
    tmp_path: Path, clock: FakeClock | None = None, store: Any = None, **overrides: Any
) -> tuple[ProfileCoordinator, FakeClock]:
    clock = clock or FakeClock()
    coord = ProfileCoordinator(
        settings(tmp_path, **overrides),
        clock,
        store=store if store is not None else MemoryStore(),
        runner=LocalRunner(),
    )
    return coord, clock


def info(aid: str, role: str = "actor", rank: int = 0, job: str | None = None) -> AgentInfo:
    return AgentInfo(
        aid, role, rank, 2, {}, "host", 1000 + rank, capabilities={"torch": None}, job_id=job
    )


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


def ev(kind: EventKind, sid: str, **kw: Any) -> AgentEvent:
    return AgentEvent(kind, sid, **kw)


def trace(sid: str, save_dir: str, trace_id: str, steps: tuple[int, ...]) -> AgentEvent:
    path = os.path.join(save_dir, f"{trace_id}.json")
    payload = TraceWritten(trace_id, path, 123, steps, "train", "torch", stall_s=0.25)
    return ev(EventKind.TRACE, sid, payload=payload)


async def two_agents(coord: ProfileCoordinator) -> None:
    for aid, rank in (("a", 0), ("b", 1)):
        reg = await coord.register(info(aid, rank=rank), 1)
        assert isinstance(reg, Registration)


# -- start ------------------------------------------------------------------------------------
def test_start_is_idempotent_and_a_first_rpc_starts_it(tmp_path: Path) -> None:
    async def go() -> None:
        coord, _ = make(tmp_path)
        assert not coord.started
        await coord.ping()  # a coordinator Ray restarted gets no start() call
        assert coord.started
        tasks = len(asyncio.all_tasks())
        await coord.start()
        assert len(asyncio.all_tasks()) == tasks  # no second tick loop

    run(go)


# -- sessions ---------------------------------------------------------------------------------
def test_a_session_walks_every_state_on_events(tmp_path: Path) -> None:
    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        await two_agents(coord)
        view = await coord.create_session({"steps": [3, 4], "roles": EVERY_ACTOR})
        sid = view.session_id
        assert view.state is SessionState.ARMED
        assert view.reason == "waiting for step 3"
        assert view.save_dir == str(tmp_path / "profile" / sid)
        assert {t.agent_id for t in view.targets} == {"a", "b"}
        reply = await coord.poll("a", 0, 1, 0)
        assert reply.known and [w.session_id for w in reply.plan.windows] == [sid]
        assert reply.plan.windows[0].steps == (3, 4)

        for aid in ("a", "b"):
            await coord.report(aid, [ev(EventKind.ARMED, sid), ev(EventKind.RECORDING, sid)])
        coord.tick()
        assert (await coord.get_session(sid)).state is SessionState.RECORDING
        for aid in ("a", "b"):
            await coord.report(aid, [ev(EventKind.COLLECTING, sid)])
        coord.tick()
        assert (await coord.get_session(sid)).state is SessionState.COLLECTING
        for aid in ("a", "b"):
            events = [trace(sid, view.save_dir, f"t-{aid}", (3, 4))]
            events.append(ev(EventKind.PART_DONE, sid, payload=PartDone(recorded=(3, 4))))
            await coord.report(aid, events)
        coord.tick()
        done = await coord.get_session(sid)
        assert done.state is SessionState.DONE, done.reason
        assert {p.state for p in done.targets} == {PartState.DONE}
        assert sorted(t.trace_id for t in done.traces) == ["t-a", "t-b"]
        assert (await coord.get_trace("t-a")).rank == 0
        assert [t.trace_id for t in await coord.list_traces(role="actor", rank=1)] == ["t-b"]
        # a finished session's window leaves the agents' plans
        assert (await coord.poll("a", reply.plan.version, 5, 0)).plan.windows == ()
        metrics = await coord.metrics()
        assert metrics["reports_total"] == 6 and metrics["events_total"] == 10
        assert metrics["stalls"]["torch"] == [2, 0.5, 0.25]
        status = await coord.status()
        assert status.traces == 2 and status.trace_bytes == 246
        assert status.sessions_by_state == {"done": 1} and status.live_sessions == []

    run(go)


async def two_agents_at_step_3(tmp_path: Path) -> tuple[ProfileCoordinator, Any]:
    """A started coordinator with agents ``a`` and ``b``, and a session of step 3 on both."""
    coord, _ = make(tmp_path)
    await coord.start()
    await two_agents(coord)
    return coord, await coord.create_session({"steps": [3], "roles": EVERY_ACTOR})


def test_a_part_whose_end_cannot_be_applied_still_ends_and_says_why(tmp_path: Path) -> None:
    """An agent's ``part_done`` the coordinator cannot apply (a mismatched agent's payload)
    was skipped and logged: its part then waited for an end that had already come, until
    the session's deadline. Now the part ends (failed, with the reason) at once and the
    session ends with its other part."""

    async def go() -> None:
        coord, view = await two_agents_at_step_3(tmp_path)
        sid = view.session_id
        broken = PartDone(recorded=None)  # type: ignore[arg-type]
        await coord.report("a", [ev(EventKind.PART_DONE, sid, payload=broken)])
        done_b = [trace(sid, view.save_dir, "t-b", (3,))]
        done_b.append(ev(EventKind.PART_DONE, sid, payload=PartDone(recorded=(3,))))
        await coord.report("b", done_b)
        coord.tick()
        ended = await coord.get_session(sid)
        parts = {p.agent_id: p for p in ended.targets}
        assert ended.state.is_terminal, ended.reason
        assert parts["a"].state is PartState.FAILED
        assert "could not apply the agent's part_done event (TypeError" in parts["a"].reason
        assert parts["b"].state is PartState.DONE
        assert (await coord.metrics())["rejected_events_total"] == 1

    run(go)


def test_an_agents_end_that_cannot_be_applied_still_ends_its_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for an agent's ``closed`` event (its job ended) that fails to apply."""
    from profd.actors.sessions import Session

    applied = Session.apply

    def failing(self: Session, agent_id: str, event: AgentEvent) -> None:
        if event.kind is EventKind.CLOSED:
            raise RuntimeError("a broken part")
        applied(self, agent_id, event)

    async def go() -> None:
        coord, view = await two_agents_at_step_3(tmp_path)
        sid = view.session_id
        monkeypatch.setattr(Session, "apply", failing)
        await coord.report("a", [ev(EventKind.CLOSED, sid)])
        coord.tick()
        parts = {p.agent_id: p for p in (await coord.get_session(sid)).targets}
        assert parts["a"].state is PartState.FAILED
        assert "could not apply the agent's closed event (RuntimeError" in parts["a"].reason
        assert parts["b"].state is PartState.PENDING

    run(go)


def test_a_finished_part_leaves_its_agents_plan_while_the_session_goes_on(
    tmp_path: Path,
) -> None:
    """Each pass publishes the parts finished since the last one (not all 10,000): a part done
    or lost while its peers record leaves its agent's plan at once, and only that one."""

    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        for aid, rank in (("a", 0), ("b", 1), ("c", 2)):
            await coord.register(info(aid, rank=rank), 1)
        view = await coord.create_session({"steps": [3], "roles": EVERY_ACTOR})
        sid = view.session_id
        held = {aid: (await coord.poll(aid, 0, 2, 0)).plan for aid in "abc"}
        assert all(p is not None and len(p.windows) == 1 for p in held.values())
        done = [trace(sid, view.save_dir, "t-a", (3,))]
        done.append(ev(EventKind.PART_DONE, sid, payload=PartDone(recorded=(3,))))
        await coord.report("a", done)
        coord.tick()
        assert (await coord.get_session(sid)).state is SessionState.RECORDING
        plan_a = (await coord.poll("a", held["a"].version, 3, 0)).plan
        assert plan_a is not None and plan_a.windows == ()
        for aid in "bc":  # their plans did not change
            assert (await coord.poll(aid, held[aid].version, 3, 0)).plan is None
        coord._book.lose("b", "its node went away")  # the liveness check's path
        coord.tick()
        plan_b = (await coord.poll("b", held["b"].version, 3, 0)).plan
        assert plan_b is not None and plan_b.windows == ()
        assert (await coord.poll("c", held["c"].version, 3, 0)).plan is None
        assert (await coord.get_session(sid)).state is SessionState.RECORDING

    run(go)


def test_a_part_its_agent_ended_leaves_the_plan_without_waking_it(tmp_path: Path) -> None:
    """The agent said its part is done: its plan loses the window quietly (no poll woken: a
    fleet's windows end together), and its next poll gets it. A part the coordinator ended
    (cancelled, lost) wakes its agent at once: the agent does not know yet."""

    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        for aid, rank in (("a", 0), ("b", 1)):
            await coord.register(info(aid, rank=rank), 1)
        view = await coord.create_session({"steps": [3], "roles": EVERY_ACTOR})
        sid = view.session_id
        held = {aid: (await coord.poll(aid, 0, 2, 0)).plan for aid in "ab"}
        polls = {a: asyncio.create_task(coord.poll(a, held[a].version, 3, 30)) for a in "ab"}
        await asyncio.sleep(0.05)
        done = [trace(sid, view.save_dir, "t-a", (3,))]
        done.append(ev(EventKind.PART_DONE, sid, payload=PartDone(recorded=(3,))))
        await coord.report("a", done)
        coord.tick()
        await asyncio.sleep(0.2)
        assert not polls["a"].done()  # not woken for what it said itself
        assert (await coord.poll("a", held["a"].version, 3, 0)).plan.windows == ()
        await coord.cancel_session(sid)
        coord.tick()
        woken = await asyncio.wait_for(polls["b"], 5)  # cancelled: told at once
        assert woken.plan is not None and woken.plan.windows == ()
        polls["a"].cancel()

    run(go)


def test_woken_polls_are_handed_over_before_the_new_session_is_persisted(
    tmp_path: Path,
) -> None:
    """As Ray runs an async actor's calls (``run_coroutine_threadsafe`` from its own thread):
    the polls a new session wakes have their answers handed over before the coordinator
    encodes the session's parts for the store (10,000 of them on a fleet)."""
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(10)

    try:
        coord, _ = make(tmp_path)
        call(coord.start())
        versions = {}
        for aid, rank in (("a", 0), ("b", 1)):
            versions[aid] = call(coord.register(info(aid, rank=rank), 1)).plan.version
        polls = [
            asyncio.run_coroutine_threadsafe(coord.poll(aid, v, 1, 30), loop)
            for aid, v in versions.items()
        ]
        entries = coord._plans._entries
        wait_until(lambda: all(entries[a].waiters for a in versions), 10, what="polls parked")
        handed_over: list[list[bool]] = []
        persist = coord._book.persist

        def persisting(s: Any) -> None:
            handed_over.append([p.done() for p in polls])
            persist(s)

        coord._book.persist = persisting  # type: ignore[method-assign]
        call(coord.create_session({"steps": [3], "roles": EVERY_ACTOR}))
        assert handed_over and handed_over[0] == [True, True]
        assert all(len(p.result(1).plan.windows) == 1 for p in polls)
    finally:

        async def stop() -> None:  # the coordinator's housekeeping loop with it
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

        call(stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_a_session_expires_at_its_deadline(tmp_path: Path) -> None:
    async def go() -> None:
        coord, clock = make(tmp_path, session_timeout_s=50.0, heartbeat_timeout_s=1000.0)
        await coord.start()
        await two_agents(coord)
        sid = (await coord.create_session({"steps": [3], "roles": EVERY_ACTOR})).session_id
        clock.advance(49)
        coord.tick()
        assert (await coord.get_session(sid)).state is SessionState.ARMED
        clock.advance(2)
        coord.tick()
        view = await coord.get_session(sid)
        assert view.state is SessionState.EXPIRED
        assert {p.state for p in view.targets} == {PartState.EXPIRED}
        assert view.finished_at == T0 + 51

    run(go)


def test_a_silent_agent_is_lost_after_the_heartbeat_timeout(tmp_path: Path) -> None:
    async def go() -> None:
        coord, clock = make(tmp_path)
        await coord.start()
        await two_agents(coord)
        sid = (await coord.create_session({"steps": [3], "roles": EVERY_ACTOR})).session_id
        clock.advance(20)
        await coord.poll("a", 0, 2, 0)  # a is heard from; b is not
        clock.advance(11)
        coord.tick()
        agents = {a.agent_id: a.state for a in await coord.list_agents()}
        assert agents == {"a": AgentState.ALIVE, "b": AgentState.LOST}
        parts = {p.agent_id: p for p in (await coord.get_session(sid)).targets}
        assert parts["b"].state is PartState.LOST and "no heartbeat for 30 s" in parts["b"].reason
        assert parts["a"].state is PartState.PENDING

    run(go)


def test_cancel_ends_a_session_once(tmp_path: Path) -> None:
    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        await two_agents(coord)
        sid = (await coord.create_session({"steps": [3], "roles": EVERY_ACTOR})).session_id
        view = await coord.cancel_session(sid, "changed my mind")
        assert view.state is SessionState.CANCELLED and view.reason == "changed my mind"
        assert (await coord.poll("a", 0, 1, 0)).plan.windows == ()
        with pytest.raises(ConflictError) as err:
            await coord.cancel_session(sid)
        assert err.value.status_code == 409

    run(go)


def test_unknown_ids_are_not_found(tmp_path: Path) -> None:
    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        for call in (coord.get_session("nope"), coord.cancel_session("nope"), coord.get_trace("t")):
            with pytest.raises(NotFoundError) as err:
                await call
            assert err.value.status_code == 404
        assert (await coord.poll("ghost", 0, None, 0)).known is False
        assert await coord.report("ghost", [ev(EventKind.ARMED, "s")]) is False

    run(go)


def test_overlapping_sessions_conflict(tmp_path: Path) -> None:
    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        await two_agents(coord)
        first = (await coord.create_session({"steps": [3], "roles": EVERY_ACTOR})).session_id
        with pytest.raises(ConflictError) as err:
            await coord.create_session({"steps": [5], "roles": {"actor": {"ranks": [1]}}})
        assert err.value.status_code == 409 and first in str(err.value)
        await coord.cancel_session(first)
        again = await coord.create_session({"steps": [5], "roles": {"actor": {"ranks": [1]}}})
        assert [t.rank for t in again.targets] == [1]

    run(go)


def test_requests_that_match_nothing_or_do_not_validate_are_refused(tmp_path: Path) -> None:
    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        with pytest.raises(RequestInvalid, match="no registered agent matches"):
            await coord.create_session({"steps": [3], "roles": EVERY_ACTOR})
        await two_agents(coord)
        with pytest.raises(RequestInvalid):
            await coord.create_session({"steps": [3], "tool": "no-such-tool"})
        with pytest.raises(RequestInvalid, match="already begun"):
            # both agents are at step 1: nothing could be recorded
            await coord.create_session({"steps": [1], "roles": EVERY_ACTOR})
        assert await coord.list_sessions() == []

    run(go)


def test_a_request_matching_nothing_names_the_field_at_fault(tmp_path: Path) -> None:
    """``profd profile --ranks 99`` is refused naming ``roles.*.ranks``, not just ``roles``."""

    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        await two_agents(coord)  # actor ranks 0 and 1, world size 2
        for roles, tool, field in [
            ({"*": {"ranks": [99]}}, "torch", "roles.*.ranks"),
            ({"actor": {"ranks": [5, 7]}}, "torch", "roles.actor.ranks"),
            ({"critic": {}}, "torch", "roles.critic"),
            ({"actor": {"topology": {"tp": 3}}}, "torch", "roles.actor.topology"),
            ({"actor": {"ranks": [1], "topology": {"tp": 3}}}, "torch", "roles.actor.topology"),
            ({"actor": {"enable": False}}, "torch", "roles.actor.enable"),
            ({"actor": {"all_ranks": True}}, "py_spy", "tool"),  # no agent has py-spy
            ({"actor": {"ranks": [9]}, "critic": {}}, "torch", "roles"),  # two fields
        ]:
            with pytest.raises(RequestInvalid) as err:
                await coord.create_session({"steps": [3], "roles": roles, "tool": tool})
            (got,) = err.value.fields
            assert got.field == field, (roles, tool, err.value)
            assert str(err.value).startswith(f"{field}: no registered agent matches")
        assert await coord.list_sessions() == []

    run(go)


def test_next_steps_start_after_the_most_advanced_target(tmp_path: Path) -> None:
    async def go() -> None:
        coord, _ = make(tmp_path, align_lead_steps=1)
        await coord.start()
        await coord.register(info("a", rank=0), 7)
        await coord.register(info("b", rank=1), 9)
        view = await coord.create_session({"next_steps": 2, "roles": EVERY_ACTOR})
        assert view.steps == [11, 12]

    run(go)


def test_a_launch_time_session_adopts_agents_that_register_later(tmp_path: Path) -> None:
    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        view = await coord.create_session({"steps": [3], "wait_for_agents": True})
        assert view.targets == [] and view.state is SessionState.ARMED
        reg = await coord.register(info("late"), None)
        assert [w.session_id for w in reg.plan.windows] == [view.session_id]
        assert [t.agent_id for t in (await coord.get_session(view.session_id)).targets] == ["late"]

    run(go)


def test_two_jobs_with_one_role_are_never_merged(tmp_path: Path) -> None:
    """Two Ray jobs on one cluster both run role trainer (A: ranks 0-2, B: ranks 0-1).
    Without a job, a request for trainer is refused naming job_id and both jobs (it used to
    profile one job's rank 0, whichever registered last, and say nothing of the other);
    job_id picks one; an unknown job is refused too. A role only one job has needs none."""

    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        for job, n in (("0a000000", 3), ("0b000000", 2)):
            for r in range(n):
                agent = AgentInfo(
                    f"{job}-t{r}", "trainer", r, n, {}, "h", 2000 + 10 * n + r, job_id=job,
                    capabilities={"torch": None},
                )  # fmt: skip
                await coord.register(agent, 1)
        await coord.register(info("c0", "critic", 0, job="0b000000"), 1)
        for roles in ({"trainer": {"ranks": [0]}}, {"trainer": {"all_ranks": True}}, {}):
            with pytest.raises(RequestInvalid) as err:
                await coord.create_session({"steps": [5], "roles": roles})
            (field,) = err.value.fields
            assert field.field == "job_id", err.value
            assert "0a000000: ranks 0-2" in field.message
            assert "0b000000: ranks 0-1" in field.message
        assert await coord.list_sessions() == []
        a = await coord.create_session(
            {"steps": [5], "roles": {"trainer": {"all_ranks": True}}, "job_id": "0a000000"}
        )
        assert sorted(t.agent_id for t in a.targets) == [f"0a000000-t{r}" for r in range(3)]
        b = await coord.create_session(
            {"steps": [5], "roles": {"trainer": {"ranks": [0]}}, "job_id": "0b000000"}
        )
        assert [t.agent_id for t in b.targets] == ["0b000000-t0"]
        critic = await coord.create_session({"steps": [5], "roles": {"critic": {}}})
        assert [t.agent_id for t in critic.targets] == ["c0"]  # one job has it: no job needed
        with pytest.raises(RequestInvalid) as err:
            await coord.create_session({"steps": [6], "job_id": "0c000000"})
        (field,) = err.value.fields
        assert field.field == "job_id" and "no live agent of Ray job 0c000000" in field.message
        views = {v.agent_id: v.job_id for v in await coord.list_agents()}
        assert views["0a000000-t1"] == "0a000000" and views["c0"] == "0b000000"
        # a block that profiles nothing is in no job: the trainer's two jobs do not matter
        await coord.cancel_session(critic.session_id)
        req = {"steps": [7], "roles": {"trainer": {"enable": False}, "critic": {}}}
        assert [t.agent_id for t in (await coord.create_session(req)).targets] == ["c0"]
        # a trainer outside Ray (no job): named "none"
        await coord.register(info("loose", "trainer", 5), 1)
        with pytest.raises(RequestInvalid) as err:
            await coord.create_session({"steps": [8], "roles": {"trainer": {"ranks": [5]}}})
        assert "none (outside Ray): ranks 5" in err.value.fields[0].message
        req = {"steps": [8], "roles": {"trainer": {"ranks": [5]}}, "job_id": "none"}
        assert [t.agent_id for t in (await coord.create_session(req)).targets] == ["loose"]

    run(go)


def test_a_launch_time_session_of_one_job_adopts_only_that_jobs_agents(tmp_path: Path) -> None:
    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        req = {"steps": [3], "wait_for_agents": True, "job_id": "0a000000"}
        view = await coord.create_session(req)  # no agent of the job yet: it waits
        await coord.register(info("other", job="0b000000"), None)
        await coord.register(info("mine", job="0a000000"), None)
        targets = (await coord.get_session(view.session_id)).targets
        assert [t.agent_id for t in targets] == ["mine"]

    run(go)


def test_a_closed_agent_ends_its_part(tmp_path: Path) -> None:
    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        await two_agents(coord)
        sid = (await coord.create_session({"steps": [3], "roles": EVERY_ACTOR})).session_id
        assert await coord.report("a", [AgentEvent(EventKind.CLOSED)]) is True
        coord.tick()
        parts = {p.agent_id: p for p in (await coord.get_session(sid)).targets}
        assert parts["a"].state is PartState.MISSED and parts["a"].missed_steps == [3]
        assert parts["b"].state is PartState.PENDING
        agents = {a.agent_id: a.state for a in await coord.list_agents()}
        assert agents["a"] is AgentState.CLOSED

    run(go)


def test_a_trace_outside_its_session_directory_is_refused(tmp_path: Path) -> None:
    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        await two_agents(coord)
        sid = (await coord.create_session({"steps": [3], "roles": EVERY_ACTOR})).session_id
        await coord.report("a", [trace(sid, "/etc", "evil", (3,))])
        view = await coord.get_session(sid)
        assert view.traces == [] and await coord.list_traces() == []
        assert any("outside the session directory" in w for w in view.warnings)
        with pytest.raises(NotFoundError):
            await coord.get_trace("evil")

    run(go)


def test_a_re_sent_trace_is_indexed_once(tmp_path: Path) -> None:
    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        await two_agents(coord)
        view = await coord.create_session({"steps": [3], "roles": EVERY_ACTOR})
        again = trace(view.session_id, view.save_dir, "t-a", (3,))
        for _ in range(2):  # the agent retried after an outage
            await coord.report("a", [again])
        assert [t.trace_id for t in await coord.list_traces()] == ["t-a"]
        assert (await coord.metrics())["stalls"]["torch"] == [1, 0.25, 0.25]

    run(go)


def test_restored_agents_that_do_not_come_back_are_lost(tmp_path: Path) -> None:
    async def go() -> None:
        store = KeepingStore()
        first, clock = make(tmp_path, store=store)
        await first.start()
        await two_agents(first)
        sid = (await first.create_session({"steps": [3], "roles": EVERY_ACTOR})).session_id
        # a new incarnation, the same state: only agent a comes back
        second, _ = make(tmp_path, clock=clock, store=store)
        await second.start()
        assert (await second.get_session(sid)).state is SessionState.ARMED
        await second.register(info("a", rank=0), 2)
        clock.advance(29)
        second.tick()
        parts = {p.agent_id: p.state for p in (await second.get_session(sid)).targets}
        assert parts == {"a": PartState.PENDING, "b": PartState.PENDING}
        clock.advance(2)
        await second.poll("a", 0, 2, 0)  # a stays heard from
        second.tick()
        parts = {p.agent_id: p for p in (await second.get_session(sid)).targets}
        assert parts["a"].state is PartState.PENDING
        assert parts["b"].state is PartState.LOST and "did not come back" in parts["b"].reason

    run(go)


# -- drivers ----------------------------------------------------------------------------------
def test_a_driver_step_reaches_its_jobs_agents_only(tmp_path: Path) -> None:
    async def go() -> None:
        coord, clock = make(tmp_path)
        await coord.start()
        await coord.register(info("a", "actor", 0, job="job-a"), None)
        await coord.register(info("b", "critic", 0, job="job-b"), None)
        first = await coord.controller_step(4, 1.0, "job-a")
        assert first == DriverAck(4)  # nothing armed: no agent is contacted
        await coord.create_session({"steps": [10], "roles": {"actor": {}, "critic": {}}})
        a0 = (await coord.poll("a", 0, None, 0)).plan
        b0 = (await coord.poll("b", 0, None, 0)).plan
        step = asyncio.create_task(coord.controller_step(5, 5.0, "job-a"))
        await asyncio.sleep(0)
        a1 = (await coord.poll("a", a0.version, None, 0)).plan
        assert a1.controller_step == 5
        await coord.poll("a", a1.version, None, 0)  # a holds the step: the driver goes on
        assert await step == DriverAck(5, agents=1)
        assert (await coord.poll("b", b0.version, None, 0)).plan is None  # b's job is not a's
        steps = {a.agent_id: (a.current_step, a.step_source) for a in await coord.list_agents()}
        assert steps == {"a": (5, "driver"), "b": (None, None)}
        clock.advance(3)
        assert coord.latest_driver() == (5, 3.0)
        assert (await coord.status()).driver_step == 5
        clock.advance(30)  # a driver unheard for the heartbeat timeout announces nothing
        assert coord.latest_driver() is None
        assert (await coord.list_agents())[0].current_step is None

    run(go)


def test_a_driver_step_does_not_wait_for_targets_that_are_not_registered(tmp_path: Path) -> None:
    """After a coordinator restart the restored sessions' agents come back over seconds;
    each driver step waited out its timeout for those not back yet (1 s a step, three or
    four steps in a row on a live job). Only registered agents can confirm: only they are
    waited for."""

    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        await two_agents(coord)
        await coord.create_session({"steps": [10], "roles": EVERY_ACTOR})
        plan = (await coord.poll("a", 0, None, 0)).plan
        coord._registry.lose("b")  # not back (yet)
        step = asyncio.create_task(coord.controller_step(2, 30.0))
        await asyncio.sleep(0)
        held = (await coord.poll("a", plan.version, None, 0)).plan
        await coord.poll("a", held.version, None, 0)  # a holds the step
        ack = await asyncio.wait_for(step, 5.0)  # not the 30 s timeout
        assert ack.slow == ()

    run(go)


def test_a_slow_agent_is_named_and_unknown_phases_refused(tmp_path: Path) -> None:
    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        await two_agents(coord)
        await coord.create_session({"steps": [10], "roles": EVERY_ACTOR})
        result = await coord.controller_step(2, 0.05)  # nobody polls: nobody confirms
        assert result.agents == 2 and result.slow == ("a", "b")
        with pytest.raises(RequestInvalid, match="unknown controller phase"):
            await coord.controller_phase(2, "lunch")
        done = await coord.controller_phase(2, "rollout_begin", 1.0)
        assert done == DriverAck(2, phase=ControllerPhase.ROLLOUT_BEGIN)

    run(go)


def test_the_session_directory_check_is_by_whole_path_components() -> None:
    import os
    from types import SimpleNamespace

    from profd.actors.trace_index import _inside_session_dir

    s = SimpleNamespace(save_dir="/save/s1/")
    inside = lambda p: _inside_session_dir(os.path.normpath(p), s, "s1")  # noqa: E731
    assert inside("/save/s1/a.json.gz") and inside("/save/s1/sub/a.json")
    assert not inside("/save/s1") and not inside("/save/s1-evil/a.json")
    assert not inside("/save/s1/../s2/a.json") and not inside("save/s1/a.json")
    unknown = lambda p: _inside_session_dir(os.path.normpath(p), None, "s1")  # noqa: E731
    assert unknown("/any/s1/a.json") and not unknown("/any/s1x/a.json")
    assert not unknown("/any/a/s1") and not _inside_session_dir("/any/s1/a", None, "")


def test_gc_young_objects_paces_the_collector_of_the_coordinators_process(
    tmp_path: Path,
) -> None:
    import gc

    before = gc.get_threshold()
    try:
        make(tmp_path)  # 0: Python's pacing is left alone
        assert gc.get_threshold() == before
        make(tmp_path, gc_young_objects=12_345)
        assert gc.get_threshold() == (12_345, max(before[1], 20), before[2])
    finally:
        gc.set_threshold(*before)


def test_profd_up_passes_its_gc_setting_to_the_coordinator(monkeypatch, tmp_path) -> None:
    from profd.core.settings import ProfdSettings

    monkeypatch.delenv("PROFD_GC_YOUNG_OBJECTS", raising=False)
    assert ProfdSettings().coordinator(tmp_path).gc_young_objects == 0  # Python's pacing
    monkeypatch.setenv("PROFD_GC_YOUNG_OBJECTS", "50000")
    assert ProfdSettings().coordinator(tmp_path).gc_young_objects == 50_000
