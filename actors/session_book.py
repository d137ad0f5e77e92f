"""Every session the coordinator knows: their role blocks, transitions, persistence and the
plans that follow from them.

The book is the only writer of sessions to the store and of windows to the
:class:`~profd.actors.planbook.PlanBook`; after each change it takes every transition a
session can take (:meth:`SessionBook.advance`), saves what changed and republishes plans.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any

from profd.actors.finisher import Finisher
from profd.actors.reporting import session_view
from profd.actors.selection import WILDCARD
from profd.actors.sessions import Part, Session, new_session_id, session_dir
from profd.actors.targeting import Target, Targeting, resolve_targets
from profd.core.errors import ConflictError, NotFoundError
from profd.core.json_body import JsonItems
from profd.core.paging import Listing, Page
from profd.core.protocol import WindowPlan
from profd.core.request import RoleProfilerConfig, SessionRequest, ToolKind

if TYPE_CHECKING:
    from profd.actors.planbook import PlanBook
    from profd.actors.registry import AgentRegistry
    from profd.actors.runner import NodeRunner
    from profd.actors.store import Store
    from profd.actors.trace_index import TraceIndex
    from profd.core.settings import CoordinatorSettings
    from profd.core.views import SessionView, TraceView

__all__ = ["ADVANCE_COALESCE_S", "VIEW_CACHE_BYTES", "SessionBook"]

log = logging.getLogger(__name__)

#: Reports arriving within this long of each other share one pass over their sessions.
ADVANCE_COALESCE_S = 0.01
#: The JSON of finished sessions' views kept, at most (least recently read dropped first):
#: a dashboard's page of 50 past sessions is 50 lookups, not 50 views built and encoded.
VIEW_CACHE_BYTES = 32 * 1024 * 1024
#: A view larger than this (a fleet's session) is built each time it is read, not kept.
VIEW_KEPT_MAX_BYTES = 4 * 1024 * 1024


def part_of(t: Target) -> Part:
    """A target's share of a new session."""
    keep = sorted(t.keep_global_ranks) if t.keep_global_ranks is not None else None
    return Part(t.agent.agent_id, t.agent.role, t.agent.rank, t.block_key, keep_global_ranks=keep)


def _blocks_of(req: SessionRequest) -> dict[str, RoleProfilerConfig]:
    blocks = dict(req.roles)
    blocks.setdefault(WILDCARD, RoleProfilerConfig())
    return blocks


class SessionBook:
    def __init__(
        self,
        settings: CoordinatorSettings,
        clock: Callable[[], float],
        registry: AgentRegistry,
        plans: PlanBook,
        store: Store,
        traces: TraceIndex,
        runner: NodeRunner,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._registry = registry
        self._plans = plans
        self._store = store
        self._traces = traces
        self._sessions: dict[str, Session] = {}
        #: The same sessions newest first by (created_at, session id), for pages.
        self._listing: Listing[Session] = Listing(lambda s: (s.created_at, s.session_id))
        self._blocks: dict[str, dict[str, RoleProfilerConfig]] = {}
        #: Each session's request and its JSON form, for its views.
        self._requests: dict[str, tuple[SessionRequest, dict[str, Any]]] = {}
        #: Finished sessions' views as JSON, each with what it was built from (_view_key).
        self._encoded: OrderedDict[str, tuple[tuple[Any, ...], bytes]] = OrderedDict()
        self._encoded_bytes = 0
        #: Live sessions a previous incarnation left: their agents get a while to come back.
        self._restored: list[Session] = []
        #: The header each live session was last saved with (idle ticks write nothing).
        self._saved: dict[str, dict[str, Any]] = {}
        self._to_advance: dict[str, Session] = {}
        self._advance_handle: asyncio.TimerHandle | None = None
        self._finisher = Finisher(runner, self.advance, settings.base_dir)

    # -- restart ---------------------------------------------------------------------------
    def restore(self, rows: Iterable[dict[str, Any]]) -> int:
        """Take the sessions a previous incarnation persisted; return how many are live."""
        for d in rows:
            s = Session.from_dict(d)
            if s.session_id in self._sessions:
                continue  # one row per session id: the first one read
            self._sessions[s.session_id] = s
            self._listing.add(s)
            self._blocks[s.session_id] = _blocks_of(s.request)
            if s.is_live:
                self._restored.append(s)
        return len(self._restored)

    def resume(self) -> None:
        """Run what restored sessions had pending (uploads; hooks cut short are failed)."""
        for s in self._restored:
            self._finisher.resume(s)

    def lose_unreturned(self) -> None:
        """Restored sessions' agents had their chance to return: the missing ones are lost."""
        for s in self._restored:
            for aid in list(s.targets):
                if self._registry.get(aid) is None:
                    s.mark_lost(aid, "the agent did not come back after a coordinator restart")
        self._restored = []

    # -- lookup ----------------------------------------------------------------------------
    def new(
        self, req: SessionRequest, targeting: Targeting, origin: dict[str, Any] | None = None
    ) -> Session:
        now = self._clock()
        session_id = new_session_id(now, self._sessions)
        session = Session(
            session_id=session_id,
            request=req,
            save_dir=session_dir(req, self._settings, session_id),
            created_at=now,
            targets={t.agent.agent_id: part_of(t) for t in targeting.targets},
            ignored=list(targeting.ignored),
            deadline=now + self._settings.session_timeout_s,
            origin=origin,
        )
        self._sessions[session_id] = session
        self._listing.add(session)
        self._blocks[session_id] = _blocks_of(req)
        return session

    def find(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def get(self, session_id: str) -> Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise NotFoundError(f"no session {session_id!r}", session_id=session_id)
        return s

    def all(self) -> Iterable[Session]:
        return self._sessions.values()

    def live(self) -> list[Session]:
        return [s for s in self._sessions.values() if s.is_live]

    def live_or_ended_since(self, since: float) -> list[Session]:
        """Live sessions, and those that ended at or after ``since``."""
        return [
            s
            for s in self._sessions.values()
            if s.is_live or (s.finished_at is not None and s.finished_at >= since)
        ]

    def counts_by_state(self) -> dict[str, int]:
        by_state: dict[str, int] = {}
        for s in self._sessions.values():
            by_state[s.state.value] = by_state.get(s.state.value, 0) + 1
        return by_state

    # -- views -----------------------------------------------------------------------------
    def view(self, s: Session) -> SessionView:
        request = self._requests.get(s.session_id)
        if request is None or request[0] is not s.request:  # dumped once: it never changes
            request = self._requests[s.session_id] = (s.request, s.request.model_dump(mode="json"))
        return session_view(
            s,
            self._blocks.get(s.session_id, {}),
            self._traces.of_session(s.session_id),
            request[1],
        )

    def view_json(self, s: Session) -> bytes:
        """:meth:`view` as JSON (as ``model_dump_json``). A finished session's is kept while
        nothing it shows changes (:meth:`_view_key`), up to :data:`VIEW_CACHE_BYTES` in all."""
        key = self._view_key(s)
        kept = self._encoded.get(s.session_id)
        if kept is not None:
            if key is not None and kept[0] == key:
                self._encoded.move_to_end(s.session_id)
                return kept[1]
            self._drop_encoded(s.session_id)
        view = self.view(s)
        data = view.__pydantic_serializer__.to_json(view)
        if key is not None and len(data) <= VIEW_KEPT_MAX_BYTES:
            self._encoded[s.session_id] = (key, data)
            self._encoded_bytes += len(data)
            while self._encoded_bytes > VIEW_CACHE_BYTES:
                self._drop_encoded(next(iter(self._encoded)))
        return data

    def views_json(self, limit: int | None = None, cursor: str | None = None) -> JsonItems:
        """:meth:`views` as :class:`~profd.core.json_body.JsonItems`."""
        chosen, next_cursor, total = self._chosen(limit, cursor)
        items = b"[" + b",".join(self.view_json(s) for s in chosen) + b"]"
        return JsonItems(items, len(chosen), total, next_cursor)

    def _view_key(self, s: Session) -> tuple[Any, ...] | None:
        """What a finished session's view is built from and may still change (None while it
        is live: then everything may). Its parts take no more events; its traces only grow
        (the index adds, never replaces); upload and hook records are replaced on a change."""
        if s.is_live:
            return None
        return (
            s.state,
            s.steps,  # a next_steps session cancelled while its steps were being chosen
            s.finished_at,
            s.reason,
            len(s.targets),
            len(s.warnings),
            self._traces.count_of(s.session_id),
            tuple(s.uploads.items()),
            tuple(s.hooks.values()),
        )

    def _drop_encoded(self, session_id: str) -> None:
        kept = self._encoded.pop(session_id, None)
        if kept is not None:
            self._encoded_bytes -= len(kept[1])

    def views(self, limit: int | None, cursor: str | None) -> list[SessionView] | Page:
        """See :meth:`ProfileCoordinator.list_sessions`."""
        chosen, next_cursor, total = self._chosen(limit, cursor)
        if limit is None and cursor is None:
            return [self.view(s) for s in chosen]
        return Page([self.view(s) for s in chosen], next_cursor, total)

    def _chosen(
        self, limit: int | None, cursor: str | None
    ) -> tuple[list[Session], str | None, int]:
        """Without ``limit`` and ``cursor`` every session, oldest first; else one page."""
        if limit is None and cursor is None:
            every = sorted(self._sessions.values(), key=lambda s: s.created_at)
            return every, None, len(every)
        return self._listing.page("sessions", limit, cursor)

    # -- changes ---------------------------------------------------------------------------
    def cancel(self, session_id: str, reason: str) -> Session:
        s = self.get(session_id)
        if s.state.is_terminal:
            raise ConflictError(
                f"session {session_id} is already {s.state.value}", state=s.state.value
            )
        s.cancel(reason)
        self.advance(s)
        return s

    def adopt(self, s: Session, target: Target) -> None:
        """A late agent joins open session ``s``."""
        s.add_part(part_of(target))
        self.publish([target.agent.agent_id])

    def lose(self, agent_id: str, reason: str) -> None:
        """The agent is gone: its parts in live sessions are lost."""
        log.warning("agent %s lost: %s", agent_id, reason)
        for s in self.live():
            s.mark_lost(agent_id, reason)

    def upload(self, session: Session, trace: TraceView) -> None:
        """A trace of ``session`` was indexed: copy it to the session's upload URI, if any."""
        self._finisher.upload(session, trace)

    def advance_live(self) -> None:
        for s in self.live():
            self.advance(s)

    def advance_soon(self, sessions: Iterable[Session]) -> None:
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
                self.advance(s)
            except Exception:  # one broken session must not stall the others
                log.exception("advancing session %s failed", s.session_id)

    def advance(self, s: Session, persist: bool = True) -> None:
        """Take every transition ``s`` can take now and persist what changed (unless
        ``persist`` is false: the caller persists it later)."""
        was_live, was_open = s.is_live, s.open_targeting
        while s.advance(self._clock()) is not None:
            pass
        if s.is_live and s.request.finish_hook_cmd is not None and not s.hooks_planned:
            traces = self._traces.of_session(s.session_id)
            self._finisher.start_hooks(s, self._registry.all(), traces)
            while s.advance(self._clock()) is not None:
                pass
        if was_open and not s.open_targeting:
            # A launch-time session's window began: report what never showed up.
            found = resolve_targets(s.request, [r.info for r in self._registry.alive()])
            s.ignored = list(found.ignored)
        if was_live and not s.is_live:
            log.info("session %s %s: %s", s.session_id, s.state.value, s.reason)
        if s.is_live:  # a finished part's window leaves its agent's plan
            closed = list(s.closed_parts)
            self.publish(closed, quiet=_ended_by_agent(s, closed))
            s.closed_parts.difference_update(closed)  # after: a failed publish is retried
        elif not s.end_published:  # the session ended: its window leaves every plan
            self.publish(list(s.targets), quiet=_ended_by_agent(s, s.targets))
            s.end_published = True
            s.closed_parts.clear()
        if persist:
            self.persist(s)

    def persist(self, s: Session) -> None:
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

    # -- plans -----------------------------------------------------------------------------
    def publish(self, agent_ids: Iterable[str], quiet: Collection[str] = ()) -> None:
        """Install the windows of live sessions in each agent's plan. The agents in
        ``quiet`` ended their part themselves: a plan that only loses windows is not sent to
        them now (they get it with their next poll; a fleet's windows end together, and
        waking every agent at once to say what it already knows is a second fan-out)."""
        live = [s for s in self.live() if s.steps is not None]
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
            self._plans.set(aid, tuple(windows), quiet=aid in quiet)

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


def _ended_by_agent(s: Session, agent_ids: Iterable[str]) -> set[str]:
    """Of ``agent_ids``, those whose part of ``s`` ended by the agent's own word."""
    return {a for a in agent_ids if (p := s.targets.get(a)) is not None and p.ended_by_agent}
