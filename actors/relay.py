"""The per-node relay: one actor per Ray node that hosts agents (``profd_relay_<node id>``).

Agents on the node long-poll the relay instead of the coordinator, and send it their
events, over the relay's Unix socket (:mod:`profd.actors.relay_socket`, started by the first
``ping``; Ray calls to the relay where an agent cannot reach it); the relay sends the node's
events in batches (``report_many``), and gets its agents' plans one of two ways, so the
coordinator's load grows with nodes, not processes:

* **pushed** (a relay actor, the default): it syncs with the coordinator (``relay_sync``,
  answered at once, with its own handle) when an agent joins and every poll period, and the
  coordinator calls its :meth:`NodeRelay.push` when their plans change
  (:mod:`profd.actors.relay_desk`): nothing is parked at the coordinator;
* **polled** (no handle: tests driving the class, ``pushed=False``): it parks **one**
  ``poll_many`` at the coordinator for all of them (each call in flight costs the
  coordinator tens of kilobytes).

Registration and clock readings are forwarded as they are (rare). The relay keeps no state
that matters: when it
dies its agents fall back to the coordinator (:mod:`profd.agent.relay_link`) and move back
once it is there again; when the coordinator restarts, the relay's agents are told to
register again, as a direct poll would tell them.

Plain class: made an actor by :func:`profd.actors.get_or_create_relay`; tests drive it
directly with any :class:`CoordinatorCaller`.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from profd.actors.planbook import release
from profd.actors.relay_caller import CoordinatorCaller, RayCoordinatorCaller
from profd.actors.relay_forward import Forward, push_on
from profd.actors.relay_reports import ReportBatches
from profd.core.protocol import AgentEvent, AgentInfo, AgentPlan, PollReply
from profd.core.relay_wire import RelayHello

__all__ = [
    "RELAY_PREFIX",
    "CoordinatorCaller",
    "NodeRelay",
    "RayCoordinatorCaller",
    "RelayStats",
    "relay_name",
]

log = logging.getLogger(__name__)

#: Wait this long after an agent joins before re-issuing the shared poll with it, so a
#: node's agents starting together cost one re-issue, not eight.
JOIN_DEBOUNCE_S = 0.05
#: The longest the relay parks its shared poll at the coordinator (the registration's
#: ``poll_timeout_s`` when shorter): each return refreshes its agents' steps there.
SHARED_POLL_S = 30.0
#: After a shared poll came back empty (a wake-up, or its time was up), how long the relay
#: waits for its released agents to poll again with their current steps.
REPOLL_WAIT_S = 0.5
#: How long a push waits for its agents to poll again with their new plans before it
#: answers: the coordinator counts a plan delivered only once the agent holds it (a driver's
#: step announcement returns then, and the agent must know the step before the step's first
#: worker call). Agents that take longer are left out of the answer.
PUSH_CONFIRM_S = 2.0


#: Relay actor names: this, then the Ray node id.
RELAY_PREFIX = "profd_relay_"


def _discard(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: no "exception never retrieved" warning


def relay_name(node_id: str) -> str:
    """The relay's actor name for a Ray node (hex node ids are 56 characters)."""
    return RELAY_PREFIX + node_id


@dataclass
class _Slot:
    """One agent of the node: the version it knows, its last step, what changed."""

    version: int
    step: int | None = None
    plan: AgentPlan | None = None
    unknown: bool = False
    #: Its poll is to return empty (so the agent polls again with its current step).
    release: bool = False
    parked: bool = False
    #: The parked polls' futures (bare futures: a wake-up answers in the loop's next turn).
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def wake(self) -> None:
        for fut in self.waiters:
            release(fut)


@dataclass
class _PushWait:
    """A push waiting for its agents to poll with (at least) the versions it brought."""

    wanted: dict[str, int]
    fut: asyncio.Future[None]
    left: set[str] = field(init=False)

    def __post_init__(self) -> None:
        self.left = set(self.wanted)

    def polled(self, agent_id: str, version: int) -> None:
        if agent_id in self.left and version >= self.wanted[agent_id]:
            self.left.discard(agent_id)
            if not self.left:
                release(self.fut)


@dataclass(frozen=True, slots=True)
class RelayStats:
    """What the relay does now (for tests, benches and ``profd status``)."""

    node_id: str
    agents: int
    parked_polls: int
    shared_polls: int  # (or syncs, when the coordinator pushes plans)
    pushes: int
    reports_sent: int
    events_sent: int
    coordinator_errors: int
    #: Agents' connections to its Unix socket (each agent's poller and reporter hold one).
    socket_connections: int = 0


def ray_self(node_id: str) -> tuple[Any, str] | None:
    """This relay's own actor handle, for the coordinator to push plans to (``None`` outside
    a Ray actor: the relay then parks a ``poll_many`` instead)."""
    if "ray" not in sys.modules:  # not in a Ray process at all (and not started by this)
        return None
    try:
        import ray

        return ray.get_runtime_context().current_actor, node_id
    except Exception:  # not an actor (tests drive the class directly)
        return None


class NodeRelay:
    def __init__(
        self,
        node_id: str,
        caller: CoordinatorCaller | None = None,
        push_target: Callable[[], tuple[Any, str] | None] | None = None,
        pushed: bool = True,
        confirm_s: float = PUSH_CONFIRM_S,
        serve_socket: bool = True,
    ) -> None:
        """``push_target``: where the coordinator reaches this relay (an actor handle with
        ``push(key, replies, refresh)`` and the key); by default its own handle when it runs
        as an actor. Without one, or with ``pushed=False``, the relay parks a ``poll_many``
        at the coordinator instead. ``serve_socket``: its agents reach it over a Unix socket
        (:mod:`profd.actors.relay_socket`, started by the first ``ping``), not only by Ray."""
        self.node_id = node_id
        self.name = relay_name(node_id)
        self._caller = caller or RayCoordinatorCaller()
        self._push_target = (push_target or (lambda: ray_self(node_id))) if pushed else None
        self._refresh = asyncio.Event()
        self._refresh_ids: set[str] = set()  # agents whose fresh steps a push asked for
        self._confirm_s = confirm_s
        self._confirming: list[_PushWait] = []  # pushes waiting for their agents' polls
        self._pushes = 0
        self._handle_held = False  # whether the coordinator holds this relay's push target
        self._resync_works = True
        self._slots: dict[str, _Slot] = {}
        self._poll_s = SHARED_POLL_S
        self._loop_task: asyncio.Task[None] | None = None
        self._joined = asyncio.Event()
        self._reports = ReportBatches(self._caller)
        self._parked = 0
        self._shared_polls = 0
        self._errors = 0
        self._serve_socket = serve_socket
        self._socket: Any = None  # its RelaySocketServer once started

    # -- agent-facing (the CoordinatorLink calls) -----------------------------------------
    async def register(self, info: AgentInfo, step: int | None) -> Any:
        reg = await self._caller.call("register", info, step, timeout=30.0)
        self._poll_s = min(SHARED_POLL_S, float(getattr(reg, "poll_timeout_s", SHARED_POLL_S)))
        slot = self._slots.get(info.agent_id)
        if slot is None:
            self._slots[info.agent_id] = _Slot(version=reg.plan.version, step=step)
        else:
            slot.version, slot.unknown, slot.plan = reg.plan.version, False, None
        self._ensure_loop()
        self._joined.set()
        return reg

    async def poll(
        self, agent_id: str, version: int, step: int | None, timeout: float
    ) -> PollReply:
        slot = self._slots.get(agent_id)
        if slot is None:
            return PollReply(plan=None, known=False)
        slot.version, slot.step = version, step
        slot.arrived.set()
        for wait in self._confirming:  # a push waiting for this agent to hold its plan
            wait.polled(agent_id, version)
        deadline = time.monotonic() + timeout
        self._parked += 1
        slot.parked = True
        try:
            while True:
                if slot.unknown:
                    self._slots.pop(agent_id, None)
                    return PollReply(plan=None, known=False)
                if slot.plan is not None and slot.plan.version != version:
                    return PollReply(plan=slot.plan)
                left = deadline - time.monotonic()
                if left <= 0 or slot.release:
                    slot.release = False
                    return PollReply(plan=None)
                loop = asyncio.get_running_loop()
                fut: asyncio.Future[None] = loop.create_future()
                slot.waiters.append(fut)
                timer = loop.call_later(left, release, fut)
                try:
                    await fut
                finally:
                    timer.cancel()
                    slot.waiters.remove(fut)
        finally:
            self._parked -= 1
            slot.parked = False

    async def report(self, agent_id: str, events: list[AgentEvent]) -> bool:
        """Queue the events for the node's next batch; answers once the coordinator took
        them (False: it does not know the agent, which registers again)."""
        return await self._reports.report(agent_id, events)

    async def clock_ns(self) -> int:
        return await self._caller.call("clock_ns", timeout=5.0)

    async def ping(self) -> RelayHello:
        """Alive; where its agents reach it without Ray (the socket starts on the first ping:
        an agent pings before it uses a relay)."""
        if self._serve_socket and self._socket is None:
            from profd.actors.relay_socket import serve

            self._socket = await serve(self, self.node_id)
            self._serve_socket = self._socket is not None  # tried once
        return RelayHello(str(self._socket.path) if self._socket is not None else None)

    async def exited(self, probes: list[Any]) -> list[str]:
        """Of ``probes`` (:class:`~profd.actors.liveness.ProcessProbe` of agents on this
        node), the agents whose process is gone: the coordinator's liveness check, asked
        of a process that already runs here (a Ray task for it started a worker process on
        the node every few seconds, which the job's own steps felt)."""
        from profd.actors.liveness import exited

        return await asyncio.to_thread(exited, probes)

    async def close(self) -> None:
        """Stop serving the socket (its file removed)."""
        if self._socket is not None:
            await self._socket.close()
            self._socket = None

    async def stats(self) -> RelayStats:
        return RelayStats(
            node_id=self.node_id,
            agents=len(self._slots),
            parked_polls=self._parked,
            shared_polls=self._shared_polls,
            pushes=self._pushes,
            reports_sent=self._reports.reports,
            events_sent=self._reports.events,
            coordinator_errors=self._errors + self._reports.errors,
            socket_connections=self._socket.connections if self._socket is not None else 0,
        )

    # -- the shared poll --------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            target = self._push_target() if self._push_target is not None else None
            loop = self._poll_loop() if target is None else self._sync_loop(*target)
            self._loop_task = asyncio.create_task(loop)

    async def push(
        self, key: str, replies: dict[str, PollReply], refresh: bool | list[str]
    ) -> dict[str, int]:
        """The coordinator's push (:mod:`profd.actors.relay_desk`): its agents' new plans,
        and the agents whose current steps it wants (a ``next_steps`` session being placed
        on them; ``True`` from an older coordinator: every agent here). Answers with the
        plan versions its agents hold, once each polled again with its new plan (or after
        ``confirm_s``, without those that did not)."""
        self._pushes += 1
        self._apply(self._slots, replies)
        if refresh:
            self._refresh_ids.update(self._slots if refresh is True else refresh)
            self._refresh.set()
        wanted = {a: r.plan.version for a, r in replies.items() if r.plan is not None}
        return await self._confirmed(wanted)

    async def push_on(
        self,
        key: str,
        replies: dict[str, PollReply],
        refresh: bool | list[str],
        forwards: list[Forward],
    ) -> tuple[dict[str, int], dict[str, Any]]:
        """:meth:`push`, and the coordinator's pushes to other relays, made from here at
        the same time (:mod:`profd.actors.relay_forward`)."""
        return await push_on(self.push(key, replies, refresh), forwards)

    async def _confirmed(self, wanted: dict[str, int]) -> dict[str, int]:
        """The agents of ``wanted`` that hold (at least) their version, waiting up to
        ``confirm_s`` for their polls (each poll is checked once, against each push)."""
        wait = _PushWait(wanted, asyncio.get_running_loop().create_future())
        for aid in wanted:
            slot = self._slots.get(aid)
            if slot is not None:
                wait.polled(aid, slot.version)
        if wait.left:
            self._confirming.append(wait)
            timer = asyncio.get_running_loop().call_later(self._confirm_s, release, wait.fut)
            try:
                await wait.fut
            finally:
                timer.cancel()
                self._confirming.remove(wait)
        held = (a for a in wanted if a not in wait.left and a in self._slots)
        return {a: self._slots[a].version for a in held}

    def _to_refresh(self) -> dict[str, _Slot]:
        """The slots a wake-up asked for (then forgotten): only they poll again, so a
        session on one rank does not send every agent of the node around again."""
        ids, self._refresh_ids = self._refresh_ids, set()
        return {a: s for a, s in self._slots.items() if a in ids and not s.unknown}

    def _snapshot(
        self, agents_hold: bool = False
    ) -> tuple[dict[str, _Slot], dict[str, int], dict[str, int | None]]:
        """The agents a shared poll or sync speaks for, the versions the relay holds for
        them (``agents_hold``: the agents themselves, which a sync's answer acknowledges),
        and their steps; agents joining from now on are news (``_joined`` cleared)."""
        self._joined.clear()
        slots = {a: s for a, s in self._slots.items() if not s.unknown}
        known = {
            a: (s.plan.version if s.plan is not None and not agents_hold else s.version)
            for a, s in slots.items()
        }
        return slots, known, {a: s.step for a, s in slots.items()}

    async def _sync_loop(self, target: Any, key: str) -> None:
        """Pushed plans: sync with the coordinator (answered at once) when an agent joins,
        when it wants fresh steps, and every poll period (its agents are alive)."""
        while True:
            # What the agents hold: the coordinator counts a plan delivered once they do (a
            # plan still on its way to an agent is sent again and kept once).
            slots, known, steps = self._snapshot(agents_hold=True)
            if not slots:
                await self._joined.wait()
                continue
            if self._handle_held:  # the coordinator has it: not sent (nor deserialised) again
                sync = self._resync(known, steps)
            else:
                sync = self._caller.call(
                    "relay_sync", self.name, known, steps, target, key, timeout=30.0
                )
            answered = await self._answered(slots, sync)
            self._handle_held = answered is not None and self._resync_works
            if answered is None:
                continue
            waits = {
                asyncio.ensure_future(self._joined.wait()),
                asyncio.ensure_future(self._refresh.wait()),
            }
            await asyncio.wait(waits, timeout=self._poll_s, return_when="FIRST_COMPLETED")
            for t in waits:
                t.cancel()
            if self._refresh.is_set():
                self._refresh.clear()
                await self._refresh_steps(self._to_refresh())
            elif self._joined.is_set():
                await asyncio.sleep(JOIN_DEBOUNCE_S)  # a node's agents joining together

    async def _resync(
        self, known: dict[str, int], steps: dict[str, int | None]
    ) -> dict[str, PollReply] | None:
        """``relay_resync``; ``None`` when the coordinator holds no handle of this relay (or
        is older and has no ``relay_resync``: the handle goes with every sync then)."""
        try:
            return await self._caller.call("relay_resync", self.name, known, steps, timeout=30.0)
        except ConnectionError as exc:
            if isinstance(exc.__cause__, AttributeError):
                self._resync_works = False
                return None
            raise

    async def _poll_loop(self) -> None:
        while True:
            slots, known, steps = self._snapshot()
            if not slots:
                await self._joined.wait()
                continue
            poll = asyncio.create_task(
                self._caller.call(
                    "poll_many", known, steps, self._poll_s, timeout=self._poll_s + 30,
                    via=self.name,
                )
            )  # fmt: skip
            joined = asyncio.create_task(self._joined.wait())
            done, _ = await asyncio.wait({poll, joined}, return_when="FIRST_COMPLETED")
            joined.cancel()
            if poll not in done:  # an agent joined: a new shared poll with it, soon
                await asyncio.sleep(JOIN_DEBOUNCE_S)
                if not poll.done():
                    # left to end at the coordinator (cancelling a Ray call in flight is not
                    # worth its edge cases); the new poll asks for everything it would answer
                    poll.add_done_callback(_discard)
                    continue
            replies = await self._answered(slots, poll)
            if replies is not None and not replies:
                await self._refresh_steps(slots)

    async def _answered(
        self, slots: dict[str, _Slot], answer: Awaitable[dict[str, PollReply]]
    ) -> dict[str, PollReply] | None:
        """A shared poll's or sync's answer, applied; ``None`` when the coordinator did not
        answer (its agents are told to register again, after a pause)."""
        try:
            replies = await answer
        except ConnectionError as exc:
            self._coordinator_lost(slots, exc)
            await asyncio.sleep(1.0)
            return None
        self._shared_polls += 1
        if replies:
            self._apply(slots, replies)
        return replies

    def _apply(self, slots: dict[str, _Slot], replies: dict[str, PollReply]) -> None:
        for aid, reply in replies.items():
            slot = slots.get(aid)
            if slot is None:
                continue
            if not reply.known:
                slot.unknown = True
                if not slot.parked and self._slots.get(aid) is slot:
                    # Closed or dead (no poll of its own to answer): dropped now. A live one
                    # between two polls is told at its next one, as if it had been parked.
                    del self._slots[aid]
                    continue
            elif reply.plan is not None and (
                slot.plan is None or slot.plan.version < reply.plan.version
            ):  # a sync's answer may cross a push: the newer plan stays
                slot.plan = reply.plan
            slot.wake()

    async def _refresh_steps(self, slots: dict[str, _Slot]) -> None:
        """The coordinator woke the poll (it wants fresh steps: a ``next_steps`` session
        being placed) or its time was up: release the parked agents and wait (a moment) for
        every agent to poll again with its current step, which the next shared poll carries."""
        for slot in slots.values():  # one not parked now (between two polls) comes soon
            slot.arrived.clear()
            if slot.parked:
                slot.release = True
                slot.wake()
        waits = [asyncio.create_task(s.arrived.wait()) for s in slots.values()]
        _, pending = await asyncio.wait(waits, timeout=REPOLL_WAIT_S)
        for t in pending:
            t.cancel()

    def _coordinator_lost(self, slots: dict[str, _Slot], exc: Exception) -> None:
        """Every agent re-registers (through here, or directly) once it answers again."""
        self._errors += 1
        if self._errors == 1:
            log.warning("relay %s: coordinator unreachable (%s)", self.name, exc)
        for slot in slots.values():
            slot.unknown = True
            slot.wake()
