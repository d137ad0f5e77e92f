"""The ProfileCoordinator: registry, sessions and plans, as a plain (async) class.

``ray.remote`` is applied where the actor is created
(:func:`profd.actors.get_or_create_coordinator`), so tests run the same class in-process.
Nothing here is on a training path: agents reach it only from their background threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import ValidationError

from profd.actors.admission import (
    check_conflicts,
    check_reachable,
    new_session_id,
    session_dir,
)
from profd.actors.agent_rpc import AgentRpcMixin, Registration
from profd.actors.driving import ControllerMixin
from profd.actors.finisher import Finisher
from profd.actors.liveness import Periodic, find_gone
from profd.actors.planbook import PlanBook
from profd.actors.registry import AgentRegistry
from profd.actors.reporting import metrics_snapshot, session_view
from profd.actors.runner import NodeRunner, default_runner
from profd.actors.selection import WILDCARD
from profd.actors.sessions import Part, Session
from profd.actors.store import Store, open_store
from profd.actors.targeting import resolve_targets
from profd.core.constants import __version__
from profd.core.errors import ConflictError, NotFoundError, RequestInvalid
from profd.core.paging import Page, page_of
from profd.core.protocol import AgentInfo, WindowPlan
from profd.core.request import RoleProfilerConfig, SessionRequest, ToolKind, field_errors
from profd.core.settings import CoordinatorSettings
from profd.core.views import (
    AgentView,
    SessionView,
    StatusView,
    TraceView,
)

__all__ = ["ProfileCoordinator", "Registration"]

log = logging.getLogger(__name__)

#: Reports arriving within this long of each other share one pass over their sessions.
ADVANCE_COALESCE_S = 0.01
#: A timed session's targets have at least this long after the window to hand in files.
TIMED_GRACE_S = 300


def _part(t: Any) -> Part:
    keep = sorted(t.keep_global_ranks) if t.keep_global_ranks is not None else None
    return Part(t.agent.agent_id, t.agent.role, t.agent.rank, t.block_key, keep_global_ranks=keep)


class ProfileCoordinator(AgentRpcMixin, ControllerMixin):
    """Owns agents, sessions and the trace index; computes each agent's plan."""

    def __init__(
        self,
        settings: CoordinatorSettings | dict,
        clock: Callable[[], float] = time.time,
        *,
        store: Store | None = None,
        runner: NodeRunner | None = None,
    ) -> None:
        if isinstance(settings, dict):
            settings = CoordinatorSettings.model_validate(settings)
        self.settings = settings
        self._clock = clock
        self._started = clock()
        self._registry = AgentRegistry()
        self._plans = PlanBook()
        self._sessions: dict[str, Session] = {}
        self._blocks: dict[str, dict[str, RoleProfilerConfig]] = {}
        self._traces: dict[str, TraceView] = {}
        self._align_waiters: list[tuple[set[str], asyncio.Event]] = []
        self._ticker: asyncio.Task | None = None
        #: Last step announced by a single-controller driver, and when.
        #: Ray job id (None: a driver that does not say) -> (its last step, when).
        self._drivers: dict[str | None, tuple[int, float]] = {}
        self._store = store if store is not None else open_store(settings.state_dir)
        self._runner = runner or default_runner()
        self._finisher = Finisher(self._runner, self._changed, settings.base_dir)
        self._liveness = Periodic(settings.liveness_check_s, self._reap, clock)
        self._restored: list[Session] = []
        self._progress_cond: asyncio.Condition | None = None
        self._to_advance: dict[str, Session] = {}
        #: The header each live session was last saved with (idle ticks write nothing).
        self._saved: dict[str, dict[str, Any]] = {}
        self._advance_handle: asyncio.TimerHandle | None = None
        self._shared: dict[tuple[Any, ...], dict[str, Any]] = {}
        #: Counters for /metrics (since this incarnation started).
        self._counters: dict[str, float] = {"events": 0, "reports": 0}
        self._stalls: dict[str, list[float]] = {}  # tool -> [count, sum, max]
        self._restore()

    def _restore(self) -> None:
        """Pick up sessions and the trace index a previous incarnation persisted."""
        saved = self._store.load()
        for d in saved["sessions"]:
            s = Session.from_dict(d)
            self._sessions[s.session_id] = s
            self._blocks[s.session_id] = self._blocks_of(s.request)
            if s.is_live:
                self._restored.append(s)
        for d in saved["traces"]:
            view = TraceView.model_validate(d)
            self._traces[view.trace_id] = view
        if saved["sessions"]:
            log.info(
                "coordinator restored %d session(s), %d trace(s); %d live",
                len(saved["sessions"]),
                len(saved["traces"]),
                len(self._restored),
            )

    @staticmethod
    def _blocks_of(req: SessionRequest) -> dict[str, RoleProfilerConfig]:
        blocks = dict(req.roles)
        blocks.setdefault(WILDCARD, RoleProfilerConfig())
        return blocks

    @property
    def _progress(self) -> asyncio.Condition:
        """Notified whenever agent events arrive (waits on rollout confirmations)."""
        if self._progress_cond is None:
            self._progress_cond = asyncio.Condition()
        return self._progress_cond

    def _changed(self, s: Session) -> None:
        """A session changed outside an agent event (upload or hook finished)."""
        self._advance(s)

    # -- sessions -----------------------------------------------------------------------
    async def create_session(self, request: dict | SessionRequest) -> SessionView:
        self._ensure_ticker()
        try:
            req = (
                request
                if isinstance(request, SessionRequest)
                else SessionRequest.model_validate(request)
            )
        except ValidationError as exc:
            raise RequestInvalid.from_fields(field_errors(exc)) from None
        targeting = resolve_targets(req, [r.info for r in self._registry.alive()])
        if not targeting.targets and not req.wait_for_agents:
            detail = "; ".join(
                f"{i.role}{'' if i.rank is None else f' rank {i.rank}'}: {i.reason}"
                for i in targeting.ignored
            )
            raise RequestInvalid.at(
                "roles", f"no registered agent matches the request ({detail or 'no agents'})"
            )
        check_conflicts(
            self._live_sessions(),
            self._registry,
            targeting.targets,
            timed=req.duration_s is not None,
        )
        if req.steps is not None:
            check_reachable(req.steps, self._registry, targeting.targets, self._job_step)
        session = self._new_session(req, targeting)
        await self._place_window(session, req, targeting.targets)
        self._advance(session)
        self._say_what_is_past(session)
        self._publish([*session.targets])
        await asyncio.sleep(0)  # let parked long-polls answer before the (large) reply is built
        log.info(
            "session %s created: tool %s steps %s, %d target(s), %d ignored",
            session.session_id,
            req.tool.value,
            session.steps,
            len(session.targets),
            len(session.ignored),
        )
        return self._view(session)

    async def _place_window(self, session: Session, req: SessionRequest, targets: Any) -> None:
        """Fix the session's steps (given, aligned, or none for a timed window)."""
        session.open_targeting = req.wait_for_agents
        if req.steps is not None:
            session.resolve_steps(req.steps)
        elif req.duration_s is not None:
            session.resolve_steps(())
            # bounded: the window, then time to write the files (rollout engines say how long
            # theirs may take: stop, then flush)
            grace = max(
                [TIMED_GRACE_S] + [t.agent.topology.get("collect_budget_s", 0) for t in targets]
            )
            session.deadline = min(session.deadline, session.created_at + req.duration_s + grace)
        else:
            await self._align(session, req.next_steps or 1)
        replicas = [t for t in targets if "replica_world_size" in t.agent.topology]
        if replicas and req.duration_s is None and not self._drivers:
            session.warnings.append(
                "rollout replicas record the steps a driver announces with "
                "profd.controller().step(n); none has been announced yet (without a "
                "single-controller driver, profile replicas with duration_s)"
            )

    def _new_session(self, req: SessionRequest, targeting: Any) -> Session:
        now = self._clock()
        sid = new_session_id(now, self._sessions)
        parts = {t.agent.agent_id: _part(t) for t in targeting.targets}
        session = Session(
            session_id=sid,
            request=req,
            save_dir=session_dir(req, self.settings, sid),
            created_at=now,
            targets=parts,
            ignored=list(targeting.ignored),
            deadline=now + self.settings.session_timeout_s,
        )
        self._sessions[sid] = session
        self._blocks[sid] = self._blocks_of(req)
        return session

    async def _align(self, session: Session, count: int) -> None:
        """Pick the first step every target can still reach, from fresh step reports."""
        pending = set(session.targets)
        done = asyncio.Event()
        waiter = (pending, done)
        self._align_waiters.append(waiter)
        for aid in pending:
            self._plans.wake(aid)  # the agent re-polls at once with its current step
        try:
            if self.settings.align_timeout_s > 0:
                await asyncio.wait_for(done.wait(), self.settings.align_timeout_s)
        except TimeoutError:
            pass
        finally:
            self._align_waiters.remove(waiter)
        recs = [r for a in session.targets if (r := self._registry.get(a)) is not None]
        known = [r.current_step for r in recs if r.current_step is not None]
        # the drivers of the targets' jobs announce their steps: they are authoritative
        drivers = {self._driver_step(r.info.job_id) for r in recs}
        known += [d for d in drivers if d is not None]
        first = (max(known) + 1 if known else 0) + self.settings.align_lead_steps
        session.resolve_steps(tuple(range(first, first + count)))

    def _adopt(self, info: AgentInfo) -> None:
        """Add a newly registered agent to launch-time sessions whose window has not begun."""
        for s in self._live_sessions():
            if not s.open_targeting or info.agent_id in s.targets:
                continue
            t = resolve_targets(s.request, [info])
            if not t.targets:
                continue
            others = [o for o in self._live_sessions() if o is not s]  # not against itself
            try:
                check_conflicts(others, self._registry, t.targets)
            except ConflictError as exc:
                s.warnings.append(f"{info.role} rank {info.rank} not adopted: {exc.message}")
                continue
            s.add_part(_part(t.targets[0]))
            self._publish([info.agent_id])
            log.info("session %s adopted %s rank %s", s.session_id, info.role, info.rank)

    async def get_session(self, session_id: str) -> SessionView:
        self._ensure_ticker()
        return self._view(self._get(session_id))

    async def list_sessions(
        self, limit: int | None = None, cursor: str | None = None
    ) -> list[SessionView] | Page:
        """Without ``limit`` and ``cursor``: every session, oldest first (a list). With
        either: one :class:`~profd.core.paging.Page` of ``limit`` sessions (default 50), newest
        first (created_at, then session id, descending), after ``cursor`` (the previous
        page's ``next_cursor``); only the page's sessions are turned into views."""
        self._ensure_ticker()
        if limit is None and cursor is None:
            ordered = sorted(self._sessions.values(), key=lambda s: s.created_at)
            return [self._view(s) for s in ordered]
        chosen, next_cursor, total = page_of(
            self._sessions.values(),
            lambda s: (s.created_at, s.session_id),
            "sessions",
            limit,
            cursor,
        )
        return Page([self._view(s) for s in chosen], next_cursor, total)

    async def cancel_session(
        self, session_id: str, reason: str = "cancelled by user"
    ) -> SessionView:
        self._ensure_ticker()
        s = self._get(session_id)
        if s.state.is_terminal:
            raise ConflictError(
                f"session {session_id} is already {s.state.value}", state=s.state.value
            )
        s.cancel(reason)
        self._advance(s)
        return self._view(s)

    def _get(self, session_id: str) -> Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise NotFoundError(f"no session {session_id!r}", session_id=session_id)
        return s

    def _live_sessions(self) -> list[Session]:
        return [s for s in self._sessions.values() if s.is_live]

    # -- plans and transitions -----------------------------------------------------------
    def _window(self, s: Session, part: Part) -> WindowPlan:
        block = self._blocks[s.session_id][part.role_block]
        tool = s.request.tool
        # One allocator snapshot per step: the memory tool never groups steps.
        groups = tuple((x,) for x in s.steps or ()) if tool is ToolKind.TORCH_MEMORY else s.groups
        return WindowPlan(
            session_id=s.session_id,
            tool=tool.value,
            steps=s.steps or (),
            groups=groups,
            discrete=block.discrete,
            tool_config=block.tool_config.for_tool(tool).model_dump(mode="json"),
            save_dir=s.save_dir,
            role_block=part.role_block,
            duration_s=s.request.duration_s,
            keep_global_ranks=(
                tuple(part.keep_global_ranks) if part.keep_global_ranks is not None else None
            ),
        )

    def _publish(self, agent_ids: list[str]) -> None:
        live = [s for s in self._live_sessions() if s.steps is not None]
        # Agents of one role block share one window object (thousands of agents, one plan).
        cache: dict[tuple[Any, ...], WindowPlan] = {}
        for aid in agent_ids:
            windows = []
            for s in live:
                part = s.targets.get(aid)
                if part is None or part.state.is_terminal:
                    continue
                keep = tuple(part.keep_global_ranks) if part.keep_global_ranks is not None else None
                key = (s.session_id, part.role_block, keep)
                if key not in cache:
                    cache[key] = self._window(s, part)
                windows.append(cache[key])
            self._plans.set(aid, tuple(windows))

    def _advance_soon(self, sessions: Iterable[Session]) -> None:
        """Advance ``sessions`` shortly: reports arriving together share one pass (deriving
        a 10,000-part session's state costs milliseconds, and thousands of agents report
        at once)."""
        self._to_advance.update((s.session_id, s) for s in sessions)
        if self._to_advance and self._advance_handle is None:
            loop = asyncio.get_running_loop()
            self._advance_handle = loop.call_later(ADVANCE_COALESCE_S, self._advance_pending)

    def _advance_pending(self) -> None:
        self._advance_handle = None
        pending, self._to_advance = self._to_advance, {}
        for s in pending.values():
            try:
                self._advance(s)
            except Exception:  # one broken session must not stall the others
                log.exception("advancing session %s failed", s.session_id)

    def _advance(self, s: Session) -> None:
        """Take every transition ``s`` can take now and persist what changed."""
        was_live, was_open = s.is_live, s.open_targeting
        while s.advance(self._clock()) is not None:
            pass
        if s.is_live and s.request.finish_hook_cmd is not None and not s.hooks_planned:
            traces = [t for t in self._traces.values() if t.session_id == s.session_id]
            self._finisher.start_hooks(s, self._registry.all(), traces)
            while s.advance(self._clock()) is not None:
                pass
        if was_open and not s.open_targeting:
            # A launch-time session's window began: report what never showed up.
            found = resolve_targets(s.request, [r.info for r in self._registry.alive()])
            s.ignored = [i for i in found.ignored]
        if was_live and not s.is_live:
            log.info("session %s %s: %s", s.session_id, s.state.value, s.reason)
        self._publish([aid for aid, p in s.targets.items() if p.state.is_terminal or not s.is_live])
        self._persist(s)

    def _persist(self, s: Session) -> None:
        """Write the session's header and its changed parts, if anything changed since the
        last save (an idle tick writes nothing); a failed write keeps them marked, so a later
        save (the next tick at the latest) writes them again."""
        header = s.header_dict()
        if not s.dirty_parts and self._saved.get(s.session_id) == header:
            return
        parts = s.take_dirty_parts()
        if self._store.save_session(s.session_id, header, parts):
            if s.is_live:
                self._saved[s.session_id] = header
            else:  # never ticked again: nothing to compare with
                self._saved.pop(s.session_id, None)
        else:
            s.dirty_parts.update(parts)
            self._saved.pop(s.session_id, None)

    def tick(self) -> None:
        """Housekeeping: lose silent agents, expire sessions past their deadline."""
        now = self._clock()
        silence = self.settings.heartbeat_timeout_s
        for rec in self._registry.expire(now, silence):
            self._lose(rec.info.agent_id, f"no heartbeat for {silence:.0f} s")
        if self._restored and now - self._started > self.settings.heartbeat_timeout_s:
            for s in self._restored:  # agents of restored sessions had their chance to return
                for aid in list(s.targets):
                    if self._registry.get(aid) is None:
                        s.mark_lost(aid, "the agent did not come back after a coordinator restart")
            self._restored = []
        for s in self._live_sessions():
            self._advance(s)

    def _lose(self, agent_id: str, reason: str) -> None:
        log.warning("agent %s lost: %s", agent_id, reason)
        for s in self._live_sessions():
            s.mark_lost(agent_id, reason)

    async def _reap(self) -> None:
        """Lose the agents whose process or node Ray says is gone (see actors/liveness)."""
        gone = await find_gone(self._registry.alive(), self._runner)
        for g in gone:
            if self._registry.lose(g.agent_id) is not None:
                self._lose(g.agent_id, g.reason)
        if gone:
            for s in self._live_sessions():
                self._advance(s)

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick_loop())
            for s in self._restored:
                self._finisher.resume(s)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.tick_s)
            try:
                self.tick()
                self._liveness.kick(self._clock())
            except Exception:
                log.exception("coordinator tick failed")

    # -- views ---------------------------------------------------------------------------
    async def list_agents(self) -> list[AgentView]:
        self._ensure_ticker()
        now = self._clock()
        recs = sorted(self._registry.all(), key=lambda r: (r.info.role, r.info.rank))
        return [r.view(now, self._driver_step(r.info.job_id)) for r in recs]

    async def get_trace(self, trace_id: str) -> TraceView:
        self._ensure_ticker()
        trace = self._traces.get(trace_id)
        if trace is None:
            raise NotFoundError(f"no trace {trace_id!r}", trace_id=trace_id)
        return trace

    async def list_traces(
        self,
        session_id: str | None = None,
        role: str | None = None,
        rank: int | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> list[TraceView] | Page:
        """Traces matching the filters. Without ``limit`` and ``cursor``: all of them by
        session, role, rank and step (a list). With either: one :class:`~profd.core.paging.Page`
        of ``limit`` traces (default 50), newest first (created_at, then trace id,
        descending), after ``cursor``; its ``total`` and ``bytes`` count every match."""
        self._ensure_ticker()
        out = [
            t
            for t in self._traces.values()
            if (session_id is None or t.session_id == session_id)
            and (role is None or t.role == role)
            and (rank is None or t.rank == rank)
        ]
        if limit is None and cursor is None:
            return sorted(out, key=lambda t: (t.session_id, t.role, t.rank, t.steps, t.file_name))
        chosen, next_cursor, total = page_of(
            out, lambda t: (t.created_at, t.trace_id), "traces", limit, cursor
        )
        return Page(chosen, next_cursor, total, sum(t.bytes for t in out))

    async def status(self) -> StatusView:
        self._ensure_ticker()
        by_state: dict[str, int] = {}
        for s in self._sessions.values():
            by_state[s.state.value] = by_state.get(s.state.value, 0) + 1
        driver = self.latest_driver()
        return StatusView(
            version=__version__,
            agents=len(self._registry.alive()),
            agents_by_role=self._registry.counts_by_role(),
            sessions_by_state=by_state,
            live_sessions=[s.session_id for s in self._live_sessions()],
            traces=len(self._traces),
            trace_bytes=sum(t.bytes for t in self._traces.values()),
            save_root=self.settings.save_root,
            uptime_s=round(self._clock() - self._started, 3),
            state_write_failures=self._store.failed_writes,
            state_last_error=self._store.last_error,
            driver_step=driver[0] if driver else None,
            driver_seen_s=driver[1] if driver else None,
        )

    def _view(self, s: Session) -> SessionView:
        return session_view(s, self._blocks.get(s.session_id, {}), self._traces.values())

    async def metrics(self) -> dict[str, Any]:
        self._ensure_ticker()
        return metrics_snapshot(
            self._registry,
            self._sessions.values(),
            self._traces.values(),
            self._stalls,
            self._counters,
            self._clock() - self._started,
        )

    async def ping(self) -> str:
        self._ensure_ticker()
        return __version__

    async def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        """Release the state directory (a coordinator in a process that lives on, once its
        loop is stopped)."""
        self._store.close()
