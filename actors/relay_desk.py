"""Plans pushed to node relays: the coordinator calls each relay when its agents' plans change.

A relay that parks a ``poll_many`` at the coordinator holds a Ray call open there, and each
costs the coordinator about 80 KB (1,250 nodes: 100 MB) and its reply's work when it wakes.
A relay that gives the coordinator its handle instead (:meth:`RelayDesk.sync`, the
``relay_sync`` RPC, which answers at once) gets its agents' changed plans pushed to it: a
plan change marks the relay, and one pass per event-loop turn sends each marked relay one
``push`` of its agents' new plans (:meth:`RelayDesk.flush`). A wake-up (a ``next_steps``
session wants fresh steps) asks the relay to have the woken agents (the session's targets
there, not every agent of the node) poll again and to sync with their steps. The relay
syncs every poll period too: that keeps its agents alive here and their steps fresh. Its
handle travels once (``relay_sync``); later syncs leave it out (``relay_resync``: each
handle that arrives is deserialised, 250 a second at 1,250 relays syncing every 5 s) until
the coordinator no longer knows the relay.

A push that fails (the relay died) forgets the relay; its agents are then served by its
next incarnation's sync, or go to the coordinator directly (:mod:`profd.agent.relay_link`).
With many relays to push to in one pass, the pushes go through relays
(:mod:`profd.actors.relay_forward`): about ``sqrt(n)`` Ray calls here instead of ``n``.

A Ray actor handle held as an object costs about 22 KB (Ray keeps metadata for each of its
actor's methods): 28 MB for 1,250 relays, more than the agents themselves. Each is kept as
its serialized bytes (about 350) and made live again for a push, the most recent
:data:`LIVE_HANDLES` kept live (a cluster of fewer nodes never makes one twice).
"""

from __future__ import annotations

import asyncio
import logging
import math
import pickle
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from profd.actors.relay_forward import TREE_MIN, Forward
from profd.core.protocol import Packed, PollReply

if TYPE_CHECKING:
    from profd.actors.planbook import PlanBook

__all__ = ["PUSH_TIMEOUT_S", "RelayDesk"]

log = logging.getLogger(__name__)

#: A push not answered within this long counts as failed (the relay is forgotten).
PUSH_TIMEOUT_S = 30.0
#: Relay handles kept live between pushes (each ~22 KB: 1.4 MB; the others wait as bytes).
LIVE_HANDLES = 64


class _Stored:
    """A Ray actor handle as its serialized bytes (see the module docstring)."""

    __slots__ = ("blob",)

    def __init__(self, handle: Any) -> None:
        from ray import cloudpickle

        self.blob = cloudpickle.dumps(handle)

    def live(self) -> Any:
        return pickle.loads(self.blob)


def _stored(target: Any) -> Any:
    """``target`` as the desk keeps it: a Ray actor handle as bytes, anything else (a test's
    stand-in, a handle already stored) as it is."""
    if type(target).__name__ == "ActorHandle" and type(target).__module__.startswith("ray."):
        return _Stored(target)
    return target


@dataclass
class _Relay:
    """A relay the coordinator pushes to: how to call it and what its agents hold."""

    name: str
    target: Any  # an actor handle with ``push(key, replies, refresh)`` (or it _Stored)
    key: str  # which relay of the actor (a bench hosts many in one)
    #: agent id -> the plan version the relay holds for it (or was last sent)
    held: dict[str, int] = field(default_factory=dict)
    dirty: bool = False
    #: agents whose current steps the coordinator wants (a wake-up), sent with the push
    refresh: set[str] = field(default_factory=set)
    #: it forwards pushes to other relays (``push_on``; a relay of an older profd does not)
    forwards: bool = True


@dataclass(eq=False, slots=True)
class _Job:
    """One pass's push to one relay: its agents' new plans, and whose steps to refresh."""

    relay: _Relay
    replies: dict[str, PollReply]
    refresh: list[str]


class RelayDesk:
    def __init__(
        self,
        plans: PlanBook,
        known: Callable[[str], bool],
        timeout_s: float = PUSH_TIMEOUT_S,
        forward_min: int = TREE_MIN,
    ) -> None:
        """``forward_min``: with at least this many relays to push to in one pass, pushes go
        through relays (0: never)."""
        self._plans = plans
        self._known = known  # whether the coordinator knows the agent (else: register again)
        self._timeout_s = timeout_s
        self._forward_min = forward_min
        self._relays: dict[str, _Relay] = {}
        self._live: OrderedDict[str, Any] = OrderedDict()  # name -> live handle, newest last
        self._by_agent: dict[str, _Relay] = {}
        self._pending: set[str] = set()
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.pushes = 0
        self.push_failures = 0
        self.calls = 0  # Ray calls made to push (fewer than pushes when relays forward)
        plans.on_change = self.changed

    def sync(self, name: str, target: Any, key: str, known: dict[str, int]) -> None:
        """A relay's sync: remember how to reach it and which versions its agents hold."""
        relay = self._relays.get(name)
        if relay is None:
            relay = self._relays[name] = _Relay(name, _stored(target), key)
        elif target is not relay.target:  # a relay Ray restarted syncs with its new handle
            relay.target, relay.key = _stored(target), key
            relay.forwards = True  # (perhaps of a newer profd now)
            self._live.pop(name, None)
        for aid in list(relay.held):
            if aid not in known:
                del relay.held[aid]
                if self._by_agent.get(aid) is relay:
                    del self._by_agent[aid]
        for aid, version in known.items():
            relay.held[aid] = version
            self._by_agent[aid] = relay

    def target_of(self, name: str) -> tuple[Any, str] | None:
        """How the relay ``name`` is reached (its handle and key), if it is known here."""
        relay = self._relays.get(name)
        return (relay.target, relay.key) if relay is not None else None

    def serves(self, agent_id: str) -> bool:
        return agent_id in self._by_agent

    def forget_agent(self, agent_id: str) -> None:
        """The agent polls elsewhere now (directly, or through another relay)."""
        relay = self._by_agent.pop(agent_id, None)
        if relay is not None:
            relay.held.pop(agent_id, None)

    def changed(self, agent_id: str, refresh: bool) -> bool:
        """:attr:`PlanBook.on_change`: mark the agent's relay; whether one serves it."""
        relay = self._by_agent.get(agent_id)
        if relay is None:
            return False
        relay.dirty = True
        if refresh:
            relay.refresh.add(agent_id)
        self._pending.add(relay.name)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)
        return True

    def flush(self) -> None:
        """One push to each marked relay: its agents' plans that differ from what it holds
        (through other relays when there are many: :mod:`profd.actors.relay_forward`)."""
        self._scheduled = False
        pending, self._pending = self._pending, set()
        jobs: list[_Job] = []
        for name in sorted(pending):  # groups by name: the same heads pass after pass
            relay = self._relays.get(name)
            if relay is None or not relay.dirty:
                continue
            relay.dirty = False
            replies = {}
            for aid, held in relay.held.items():
                if not self._known(aid):
                    replies[aid] = PollReply(plan=None, known=False)
                    continue
                plan = self._plans.plan(aid)
                if plan.version != held:
                    replies[aid] = PollReply(plan=plan)
                    relay.held[aid] = plan.version  # sent (a failed push forgets the relay)
            refresh, relay.refresh = sorted(relay.refresh), set()
            if replies or refresh:
                jobs.append(_Job(relay, replies, refresh))
        # submitted here, in this turn: every push leaves at once
        via = [j for j in jobs if isinstance(j.relay.target, _Stored) and j.relay.forwards]
        if not self._forward_min or len(via) < max(2, self._forward_min):
            via = []
        forwarded = {id(j) for j in via}
        for job in jobs:
            if id(job) not in forwarded:
                self._send(job)
        size = math.isqrt(len(via) - 1) + 1 if via else 1  # about sqrt(n) a group
        for i in range(0, len(via), size):
            self._send_group(via[i : i + size])

    def _send(self, job: _Job) -> None:
        """A push of its own to the relay of ``job``."""
        relay = job.relay
        try:
            call = self._handle(relay).push.remote(relay.key, Packed(job.replies), job.refresh)
        except Exception as exc:
            self._failed(relay, exc)
            return
        self.calls += 1
        self._track(self._push(job, call))

    def _send_group(self, group: list[_Job]) -> None:
        """One push to the group's first relay, which pushes to the others."""
        head, rest = group[0], group[1:]
        if not rest:
            self._send(head)
            return
        fwd = [
            Forward(j.relay.name, j.relay.target.blob, j.relay.key, j.replies, j.refresh)
            for j in rest
        ]
        try:
            push_on = getattr(self._handle(head.relay), "push_on", None)
            if push_on is not None:
                call = push_on.remote(
                    head.relay.key, Packed(head.replies), head.refresh, Packed(fwd)
                )
        except Exception as exc:  # its handle is no good: the head is gone
            self._failed(head.relay, exc)
            for job in rest:
                self._send(job)
            return
        if push_on is None:  # a relay of an older profd: no forwarding
            head.relay.forwards = False
            for job in group:
                self._send(job)
            return
        self.calls += 1
        self._track(self._push_group(head, rest, call))

    def _track(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _handle(self, relay: _Relay) -> Any:
        """The relay's handle, live (see the module docstring)."""
        if not isinstance(relay.target, _Stored):
            return relay.target
        handle = self._live.get(relay.name)
        if handle is None:
            handle = self._live[relay.name] = relay.target.live()
            if len(self._live) > LIVE_HANDLES:
                self._live.popitem(last=False)
        else:
            self._live.move_to_end(relay.name)
        return handle

    def _failed(self, relay: _Relay, exc: Exception) -> None:
        self.push_failures += 1
        if self._relays.get(relay.name) is relay:
            log.warning("relay %s: push failed (%s); forgotten", relay.name, exc)
            self._drop(relay)

    async def _push(self, job: _Job, call: Any) -> None:
        try:
            held = await asyncio.wait_for(call, self._timeout_s)
        except Exception as exc:  # the relay died or does not answer: forget it
            self._failed(job.relay, exc)
            return
        self._answered(job, held)

    async def _push_group(self, head: _Job, rest: list[_Job], call: Any) -> None:
        try:
            held, answers = await asyncio.wait_for(call, self._timeout_s)
        except Exception as exc:  # the head died or does not answer: the others directly
            self._failed(head.relay, exc)
            for job in rest:
                self._send(job)
            return
        if isinstance(held, str):  # its own push failed (its forwards went on)
            self._failed(head.relay, RuntimeError(f"push_on: {held}"))
        else:
            self._answered(head, held)
        for job in rest:
            got = answers.get(job.relay.name, "no answer") if isinstance(answers, dict) else None
            if isinstance(got, str) or got is None:  # it died or did not answer: forget it
                self._failed(job.relay, RuntimeError(f"forwarded: {got}"))
            else:  # its held versions (or True: a relay of an older profd took them)
                self._answered(job, got)

    def _answered(self, job: _Job, held: Any) -> None:
        self.pushes += 1
        if isinstance(held, dict):  # the versions its agents hold now (they polled again)
            for aid, version in held.items():
                self._plans.ack(aid, version)
            return
        for aid, reply in job.replies.items():  # an older relay: delivered to the relay
            if reply.plan is not None:
                self._plans.ack(aid, reply.plan.version)

    def _drop(self, relay: _Relay) -> None:
        del self._relays[relay.name]
        self._live.pop(relay.name, None)
        for aid in relay.held:
            if self._by_agent.get(aid) is relay:
                del self._by_agent[aid]

    def __len__(self) -> int:
        return len(self._relays)
