"""Agent-facing coordinator RPCs: register, long-poll, report (coordinator mixin).

Agents call these from their background threads only; a poll parks on the agent's plan in the
:class:`~profd.actors.planbook.PlanBook` until it changes, so an idle job costs one open call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from profd.core.protocol import AgentEvent, AgentInfo, EventKind, PollReply
from profd.core.views import TraceView

if TYPE_CHECKING:
    from profd.actors.finisher import Finisher
    from profd.actors.planbook import PlanBook
    from profd.actors.registry import AgentRecord, AgentRegistry
    from profd.actors.sessions import Session
    from profd.actors.store import Store
    from profd.core.settings import CoordinatorSettings

__all__ = ["AgentRpcMixin", "Registration"]

log = logging.getLogger(__name__)


class Registration:
    """Reply to :meth:`ProfileCoordinator.register`."""

    __slots__ = ("plan", "poll_timeout_s")

    def __init__(self, plan: Any, poll_timeout_s: float) -> None:
        self.plan = plan
        self.poll_timeout_s = poll_timeout_s

    def __reduce__(self):
        return (Registration, (self.plan, self.poll_timeout_s))


class AgentRpcMixin:
    """Needs the registry, plan book, sessions, trace index and store of the coordinator."""

    settings: CoordinatorSettings
    _clock: Callable[[], float]
    _registry: AgentRegistry
    _plans: PlanBook
    _sessions: dict[str, Session]
    _traces: dict[str, TraceView]
    _align_waiters: list[tuple[set[str], asyncio.Event]]
    _shared: dict[tuple[Any, ...], dict[str, Any]]
    _counters: dict[str, float]
    _stalls: dict[str, list[float]]
    _store: Store
    _finisher: Finisher
    _progress: asyncio.Condition

    def _ensure_ticker(self) -> None:
        raise NotImplementedError

    def _adopt(self, info: AgentInfo) -> None:
        raise NotImplementedError

    def _publish(self, agent_ids: list[str]) -> None:
        raise NotImplementedError

    def _advance(self, s: Session) -> None:
        raise NotImplementedError

    def _advance_soon(self, sessions: Iterable[Session]) -> None:
        raise NotImplementedError

    def _persist(self, s: Session) -> None:
        raise NotImplementedError

    def _live_sessions(self) -> list[Session]:
        raise NotImplementedError

    async def register(self, info: AgentInfo, step: int | None) -> Registration:
        self._ensure_ticker()
        info = self._interned(info)
        now = self._clock()
        self._registry.upsert(info, now, step)
        self._plans.ensure(info.agent_id)
        log.info("agent %s registered (role %s rank %s)", info.agent_id, info.role, info.rank)
        self._adopt(info)
        self._publish([info.agent_id])  # a re-registering agent gets its windows back
        return Registration(self._plans.plan(info.agent_id), self.settings.poll_timeout_s)

    def _interned(self, info: AgentInfo) -> AgentInfo:
        """Thousands of agents report the same capabilities and topology keys: keep one copy."""
        caps = tuple(sorted(info.capabilities.items()))
        shared = self._shared.setdefault(caps, dict(caps))
        topo = tuple(sorted(info.topology.items()))
        shared_topo = self._shared.setdefault(("topology", *topo), dict(topo))
        return dataclasses.replace(
            info,
            capabilities=shared,
            topology=shared_topo,
            hostname=sys.intern(info.hostname),
            role=sys.intern(info.role),
        )

    async def poll(
        self, agent_id: str, known_version: int, step: int | None, timeout: float
    ) -> PollReply:
        self._ensure_ticker()
        rec = self._registry.get(agent_id)
        if rec is None:
            return PollReply(plan=None, known=False)
        rec.touch(self._clock(), step)
        self._note_fresh_step(agent_id)
        plan = await self._plans.wait(agent_id, known_version, min(timeout, 60.0))
        if self._registry.get(agent_id) is not None:
            self._registry.get(agent_id).touch(self._clock(), None, revive=False)  # type: ignore[union-attr]
        return PollReply(plan=plan)

    async def poll_many(
        self, known: dict[str, int], steps: dict[str, int | None], timeout: float
    ) -> dict[str, PollReply]:
        """One long-poll for every agent of a process (see :mod:`profd.agent.multiplex`):
        the replies of the agents whose plan changed (or who must register again)."""
        self._ensure_ticker()
        now = self._clock()
        replies: dict[str, PollReply] = {}
        waiting: dict[str, int] = {}
        for aid, version in known.items():
            rec = self._registry.get(aid)
            if rec is None:
                replies[aid] = PollReply(plan=None, known=False)
                continue
            rec.touch(now, steps.get(aid))
            self._note_fresh_step(aid)
            waiting[aid] = version
        plans = await self._plans.wait_any(waiting, 0 if replies else min(timeout, 60.0))
        now = self._clock()
        for aid in waiting:
            rec = self._registry.get(aid)
            if rec is not None:
                rec.touch(now, None, revive=False)
        replies.update({aid: PollReply(plan=plan) for aid, plan in plans.items()})
        return replies

    async def report(self, agent_id: str, events: list[AgentEvent]) -> bool:
        rec = self._registry.get(agent_id)
        if rec is None:
            return False
        now = self._clock()
        rec.touch(now, None)
        self._counters["reports"] += 1
        self._counters["events"] += len(events)
        touched: dict[str, Session] = {}
        for ev in events:
            if ev.kind is EventKind.TRACE and ev.data:
                refused = self._index_trace(rec, ev)
                if refused is not None:  # not a trace of this session: the part says why
                    ev = AgentEvent(EventKind.ERROR, ev.session_id, ev.step, refused)
            if ev.kind is EventKind.CLOSED:
                self._registry.close(agent_id)
                for s in self._live_sessions():
                    if agent_id in s.targets:
                        s.apply(agent_id, ev)
                        touched[s.session_id] = s
                continue
            s = self._sessions.get(ev.session_id or "")
            if s is not None:
                s.apply(agent_id, ev)
                touched[s.session_id] = s
        for s in touched.values():
            self._persist(s)  # saved before the agent is told its events arrived
        self._advance_soon(touched.values())
        if touched:
            async with self._progress:
                self._progress.notify_all()
        return True

    def _index_trace(self, rec: AgentRecord, ev: AgentEvent) -> str | None:
        """Index a trace the agent wrote; return why it was refused, else ``None``."""
        d = ev.data or {}
        info = rec.info
        path = os.path.normpath(str(d["path"]))  # served as checked
        session = self._sessions.get(ev.session_id or "")
        if not _inside_session_dir(path, session, ev.session_id or ""):
            # Downloads serve indexed paths only: an agent cannot make the sidecar serve
            # a file outside its session's directory.
            msg = (
                f"{info.role} rank {info.rank}: trace outside the session directory refused: {path}"
            )
            log.warning("session %s: %s", ev.session_id, msg)
            if session is not None:
                session.warnings.append(msg)
            return msg
        view = TraceView(
            trace_id=str(d["trace_id"]),
            session_id=ev.session_id or "",
            agent_id=info.agent_id,
            role=info.role,
            rank=info.rank,
            tool=str(d.get("tool", "")),
            scope=str(d.get("scope", "")),
            steps=[int(s) for s in d.get("steps", [])],
            path=path,
            file_name=Path(path).name,
            bytes=int(d.get("bytes", 0)),
            node_id=info.node_id,
            node_ip=info.node_ip,
            hostname=info.hostname,
            created_at=ev.time,
        )
        if view.trace_id in self._traces:
            return None  # a re-sent event (agent retried after an outage): indexed once
        self._traces[view.trace_id] = view
        stall = self._stalls.setdefault(view.tool, [0, 0.0, 0.0])
        s_val = float(d.get("stall_s") or 0.0)
        stall[0] += 1
        stall[1] += s_val
        stall[2] = max(stall[2], s_val)
        self._store.save_trace(view.trace_id, view.session_id, view.model_dump(mode="json"))
        if session is not None:
            self._finisher.upload(session, view)
        return None

    def _note_fresh_step(self, agent_id: str) -> None:
        for pending, done in self._align_waiters:
            pending.discard(agent_id)
            if not pending:
                done.set()


def _inside_session_dir(path: str, session: Session | None, session_id: str) -> bool:
    """Whether ``path`` (on the agent's node, so compared as text, not resolved here) lies
    inside the session's directory — or, for a session this coordinator does not know, inside
    a directory named by the session id."""
    p = PurePosixPath(os.path.normpath(path))
    if not p.is_absolute():
        return False
    if session is not None:
        root = PurePosixPath(os.path.normpath(session.save_dir))
        return p != root and p.is_relative_to(root)
    return bool(session_id) and session_id in p.parts[:-1]
