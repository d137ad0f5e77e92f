"""Where agents talk to the coordinator: register, long-poll, report.

Agents call these from their background threads only; a poll parks on the agent's plan in the
:class:`~profd.actors.planbook.PlanBook` until it changes, so an idle job costs one open call.
This module is imported where :class:`Registration` is unpickled (agent processes), so its
imports at run time stay light.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from profd.actors.trace_index import TraceRefused
from profd.core.protocol import (
    AgentEvent,
    AgentInfo,
    AgentPlan,
    EventKind,
    MarkDurations,
    OutOfMemory,
    PollReply,
    StackSample,
    TraceWritten,
    fast_pickle,
)
from profd.core.states import AgentLink

if TYPE_CHECKING:
    from profd.actors.mark_stats import MarkStats
    from profd.actors.planbook import PlanBook
    from profd.actors.registry import AgentRecord, AgentRegistry
    from profd.actors.relay_desk import RelayDesk
    from profd.actors.session_book import SessionBook
    from profd.actors.sessions import Session
    from profd.actors.trace_index import TraceIndex

__all__ = ["AgentDesk", "Registration"]

log = logging.getLogger(__name__)

#: The longest a long-poll parks, whatever the agent asks for.
MAX_POLL_S = 60.0


@fast_pickle
@dataclasses.dataclass(frozen=True, slots=True)
class Registration:
    """Reply to :meth:`ProfileCoordinator.register` (a message: it crosses relay sockets)."""

    plan: AgentPlan
    poll_timeout_s: float


def _fresher(current: Any, reported: Any) -> Any:
    """The step a times event carried, when it is ahead of the one a long-poll carried last
    (steps that are not numbers compare as unknown: the poll's is kept)."""
    if reported is None or current is None:
        return current if reported is None else reported
    try:
        return reported if reported > current else current
    except TypeError:
        return current


class AgentDesk:
    """Registers agents, answers their long-polls and applies their events; counts reports
    (for /metrics) and keeps one shared copy of agents' repeated capabilities and topology."""

    def __init__(
        self,
        *,
        poll_timeout_s: float,
        clock: Callable[[], float],
        registry: AgentRegistry,
        plans: PlanBook,
        book: SessionBook,
        traces: TraceIndex,
        times: MarkStats,
        on_register: Callable[[AgentInfo], None],
        on_fresh_step: Callable[[str], None],
        on_events: Callable[[], Awaitable[None]],
        on_times: Callable[[str, MarkDurations, int | None], None] | None = None,
        on_stack: Callable[[str, StackSample], None] | None = None,
        on_oom: Callable[[str, AgentEvent], None] | None = None,
        relays: RelayDesk | None = None,
        place_spans: Callable[[MarkDurations, str | None], MarkDurations] | None = None,
    ) -> None:
        self._poll_timeout_s = poll_timeout_s
        self._clock = clock
        self._registry = registry
        self._plans = plans
        self._book = book
        self._traces = traces
        self._times = times
        self._on_register = on_register  # launch-time sessions adopt the agent
        self._on_fresh_step = on_fresh_step  # alignments wait for fresh steps
        self._on_events = on_events  # phase waits re-check their agents
        self._on_times = on_times  # triggers look at the new durations
        #: (times, job) -> times with a driver-following worker's stage spans placed in its
        #: job's driver steps
        self._place_spans = place_spans
        self._on_stack = on_stack  # a stack request gathers its answers
        self._on_oom = on_oom  # out-of-memory triggers
        self._relays = relays  # relays the coordinator pushes plans to
        self._shared: dict[tuple[Any, ...], dict[str, Any]] = {}
        #: Since this incarnation started.
        self.reports = 0
        self.events = 0
        self.duplicate_events = 0  # numbered events received again and dropped
        self.rejected_events = 0  # events that could not be applied (logged, skipped)
        self._rejecting: set[str] = set()  # agents whose rejected event was logged

    async def register(self, info: AgentInfo, step: int | None) -> Registration:
        info = self._interned(info)
        self._rejecting.discard(info.agent_id)  # a rejected event of its next life is logged
        self._registry.upsert(info, self._clock(), step)
        self._plans.ensure(info.agent_id)
        log.info("agent %s registered (role %s rank %s)", info.agent_id, info.role, info.rank)
        self._on_register(info)
        self._book.publish([info.agent_id])  # a re-registering agent gets its windows back
        return Registration(self._plans.plan(info.agent_id), self._poll_timeout_s)

    def _interned(self, info: AgentInfo) -> AgentInfo:
        """Thousands of agents report the same capabilities, topology keys, labels, node and
        job: keep one copy of each (a node's 8 agents name it 8 times)."""
        caps = tuple(sorted(info.capabilities.items()))
        shared = self._shared.setdefault(caps, dict(caps))
        topo = tuple(sorted(info.topology.items()))
        shared_topo = self._shared.setdefault(("topology", *topo), dict(topo))
        labels = tuple(sorted(info.labels.items()))
        shared_labels = self._shared.setdefault(("labels", *labels), dict(labels))
        return dataclasses.replace(
            info,
            capabilities=shared,
            topology=shared_topo,
            labels=shared_labels,
            hostname=sys.intern(info.hostname),
            role=sys.intern(info.role),
            node_id=_intern(info.node_id),
            node_ip=_intern(info.node_ip),
            job_id=_intern(info.job_id),
        )

    async def poll(
        self, agent_id: str, known_version: int, step: int | None, timeout: float
    ) -> PollReply:
        rec = self._registry.get(agent_id)
        if rec is None or rec.retired:
            return PollReply(plan=None, known=False)
        rec.touch(self._clock(), step)
        rec.link = AgentLink.DIRECT
        if self._relays is not None:
            self._relays.forget_agent(agent_id)  # it polls here now
        self._plans.take_woken((agent_id,))  # its own poll: the step it carries is fresh
        self._on_fresh_step(agent_id)
        plan = await self._plans.wait(agent_id, known_version, min(timeout, MAX_POLL_S))
        if (rec := self._registry.get(agent_id)) is not None:
            rec.touch(self._clock(), None, revive=False)
        return PollReply(plan=plan)

    async def poll_many(
        self,
        known: dict[str, int],
        steps: dict[str, int | None],
        timeout: float,
        via: str | None = None,
    ) -> dict[str, PollReply]:
        """See :meth:`ProfileCoordinator.poll_many`."""
        link = AgentLink.RELAY if via else AgentLink.SHARED
        replies, waiting, woken = self._heard_from(known, steps, link)
        wait_s = 0 if (replies or woken) else min(timeout, MAX_POLL_S)
        plans = await self._plans.wait_any(waiting, wait_s)
        now = self._clock()
        for aid in waiting:
            rec = self._registry.get(aid)
            if rec is not None:
                rec.touch(now, None, revive=False)
        replies.update({aid: PollReply(plan=plan) for aid, plan in plans.items()})
        return replies

    def _heard_from(
        self, known: dict[str, int], steps: dict[str, int | None], link: AgentLink
    ) -> tuple[dict[str, PollReply], dict[str, int], set[str]]:
        """Many agents heard from at once (a shared poll, a relay's sync): the replies for
        those this coordinator does not know, the versions of those it does, and the ones
        woken while no poll of theirs was here (the steps carried may be older than the
        wake-up, so they are not fresh: the next poll or sync has them)."""
        now = self._clock()
        unknown: dict[str, PollReply] = {}
        alive: dict[str, int] = {}
        woken = self._plans.take_woken(known)
        for aid, version in known.items():
            rec = self._registry.get(aid)
            if rec is None or rec.retired:  # the relay stops carrying it
                unknown[aid] = PollReply(plan=None, known=False)
                continue
            rec.touch(now, steps.get(aid))
            rec.link = link
            if aid not in woken:
                self._on_fresh_step(aid)
            alive[aid] = version
        return unknown, alive, woken

    async def relay_sync(
        self,
        via: str,
        known: dict[str, int],
        steps: dict[str, int | None],
        target: Any,
        key: str,
    ) -> dict[str, PollReply]:
        """See :meth:`ProfileCoordinator.relay_sync`."""
        replies, alive, woken = self._heard_from(known, steps, AgentLink.RELAY)
        held: dict[str, int] = {}
        for aid, version in alive.items():
            self._plans.ack(aid, version)
            plan = self._plans.plan(aid)
            if plan.version != version:
                replies[aid] = PollReply(plan=plan)
            held[aid] = plan.version
        if self._relays is not None and target is not None:
            self._relays.sync(via, target, key, held)
            for aid in woken:  # woken before the relay was known here: ask it for steps
                self._relays.changed(aid, True)
        return replies

    async def relay_resync(
        self, via: str, known: dict[str, int], steps: dict[str, int | None]
    ) -> dict[str, PollReply] | None:
        """See :meth:`ProfileCoordinator.relay_resync`."""
        reach = self._relays.target_of(via) if self._relays is not None else None
        if reach is None:
            return None
        return await self.relay_sync(via, known, steps, *reach)

    async def report(self, agent_id: str, events: list[AgentEvent]) -> bool:
        return (await self.report_many({agent_id: events}))[agent_id]

    async def report_many(self, batches: dict[str, list[AgentEvent]]) -> dict[str, bool]:
        """Each agent's events applied in order; the sessions they touched are persisted and
        advanced once for the whole batch (a relay's batch holds a node's agents, all of one
        session as a window ends), before anyone is told the events arrived. Whether each
        agent is known (an unknown one registers again)."""
        touched: dict[str, Session] = {}
        with self._traces.batch():
            known = {aid: self._apply(aid, events, touched) for aid, events in batches.items()}
        for s in touched.values():
            self._book.persist(s)  # saved before the agents are told their events arrived
        self._book.advance_soon(touched.values())
        if touched:
            await self._on_events()
        return known

    def _apply(self, agent_id: str, events: list[AgentEvent], touched: dict[str, Session]) -> bool:
        """One agent's events; the sessions they touch go into ``touched``. An event that
        cannot be applied (a broken or mismatched agent's payload) is counted, logged once
        per agent, and skipped: the agent's other events and a relay's other agents in the
        same batch are still applied."""
        rec = self._registry.get(agent_id)
        if rec is None:
            return False
        rec.touch(self._clock(), None)
        self.reports += 1
        events = self._unseen(rec, events)
        self.events += len(events)
        for ev in events:
            try:
                self._apply_one(rec, agent_id, ev, touched)
            except Exception as exc:
                self.rejected_events += 1
                if agent_id not in self._rejecting:
                    self._rejecting.add(agent_id)
                    log.exception("agent %s: an event could not be applied (skipped; the "
                                  "next ones are counted only): %r", agent_id, ev)  # fmt: skip
                self._refuse(agent_id, ev, exc, touched)
        return True

    def _refuse(
        self, agent_id: str, ev: AgentEvent, exc: Exception, touched: dict[str, Session]
    ) -> None:
        """The sessions the refused event belongs to hear of it (see :meth:`Session.refuse`)."""
        if ev.kind is EventKind.CLOSED:
            sessions = [s for s in self._book.live() if agent_id in s.targets]
        else:
            found = self._book.find(ev.session_id or "") if ev.session_id else None
            sessions = [found] if found is not None else []
        for s in sessions:
            touched[s.session_id] = s
            try:
                s.refuse(agent_id, ev, exc)
            except Exception:  # the part stays as it is; the event was logged above
                log.debug("session %s: could not note a refused event", s.session_id)

    def _apply_one(
        self, rec: AgentRecord, agent_id: str, ev: AgentEvent, touched: dict[str, Session]
    ) -> None:
        if isinstance(ev.payload, MarkDurations):  # live step and stage times
            if ev.step is not None and _fresher(rec.current_step, ev.step) == ev.step:
                rec.saw_step(ev.step, self._clock())  # ahead, or the same step again
            times = ev.payload
            if self._place_spans is not None:  # a driver-following worker's stages
                times = self._place_spans(times, rec.info.job_id)
            self._times.add(agent_id, times, ev.step, self._clock())
            if self._on_times is not None:
                self._on_times(agent_id, times, ev.step)
            return
        if isinstance(ev.payload, StackSample):  # answers GET /stacks, no session
            if self._on_stack is not None:
                self._on_stack(agent_id, ev.payload)
            return
        if isinstance(ev.payload, OutOfMemory):
            if self._on_oom is not None:
                self._on_oom(agent_id, ev)
            return
        if isinstance(ev.payload, TraceWritten):
            ev = self._indexed(rec, ev)
        if ev.kind is EventKind.CLOSED:
            self._registry.close(agent_id)
            self._times.forget(agent_id)
            for s in self._book.live():
                if agent_id in s.targets:
                    touched[s.session_id] = s  # saved even if applying fails half-way
                    s.apply(agent_id, ev)
            return
        s = self._book.find(ev.session_id or "")
        if s is not None:
            touched[s.session_id] = s
            s.apply(agent_id, ev)

    def _unseen(self, rec: AgentRecord, events: list[AgentEvent]) -> list[AgentEvent]:
        """``events`` less those applied already. An agent sends a batch again when its
        report timed out, though the first copy may still arrive (a slow coordinator or
        relay; a relay may even carry both copies in one batch). An agent numbers its events
        in the order it sends them, one batch after another, so a numbered event at or below
        the newest one applied is a copy. Unnumbered events (an older agent) all apply."""
        last = rec.last_seq
        fresh: list[AgentEvent] = []
        for ev in events:
            if ev.seq > last:
                last = ev.seq
            elif ev.seq:
                continue
            fresh.append(ev)
        rec.last_seq = last
        self.duplicate_events += len(events) - len(fresh)
        return fresh

    def _indexed(self, rec: AgentRecord, ev: AgentEvent) -> AgentEvent:
        """Index the trace of ``ev``; an error event instead when the index refuses it (not a
        trace of this session: the part says why)."""
        session = self._book.find(ev.session_id or "")
        try:
            view = self._traces.index(rec.info, ev, session)
        except TraceRefused as exc:
            return AgentEvent(EventKind.ERROR, ev.session_id, ev.step, str(exc))
        if view is not None and session is not None:
            self._book.upload(session, view)
        return ev


def _intern(text: str | None) -> str | None:
    return sys.intern(text) if isinstance(text, str) else text
