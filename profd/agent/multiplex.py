"""One long-poll for every agent of a process.

An agent normally keeps one long-poll open at the coordinator. A process that hosts many
agents (a rollout server with several replicas, a test harness, a node-level relay) can share
one instead: :class:`Multiplexer` polls ``poll_many`` for all of them and hands each agent its
plan; registration and events still go straight to the coordinator. Each coordinator call in
flight costs the coordinator tens of kilobytes, so sharing is what lets it serve thousands of
agents (``bench/coordinator_scale.py``).

Use it by giving every agent of the process the multiplexer's link finder::

    mux = Multiplexer(caller)                 # caller: the coordinator's .call(...)
    agent = ProfilerAgent(role, rank, world, find_link=mux.find_link)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from profd.agent.channel import LinkDown
from profd.core.protocol import AgentEvent, AgentInfo, AgentPlan, PollReply

__all__ = ["MultiplexedLink", "Multiplexer"]

log = logging.getLogger(__name__)


class Caller(Protocol):
    """Calls a coordinator method and returns its result; raises when it is unreachable."""

    def call(self, method: str, *args: Any, timeout: float) -> Any: ...


class _Slot:
    __slots__ = ("changed", "known", "plan", "step", "unknown")

    def __init__(self) -> None:
        self.known = 0
        self.step: int | None = None
        self.plan: AgentPlan | None = None
        self.unknown = False
        self.changed = threading.Condition()


class Multiplexer:
    def __init__(self, find_caller: Callable[[], Caller | None], poll_timeout_s: float = 30.0):
        self._find_caller = find_caller
        self._poll_timeout = poll_timeout_s
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()
        self._caller: Caller | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def find_link(self) -> MultiplexedLink | None:
        """A link for one more agent of this process, or ``None`` while no coordinator runs."""
        if self._caller is None:
            self._caller = self._find_caller()
            if self._caller is None:
                return None
        return MultiplexedLink(self)

    def close(self) -> None:
        self._stop.set()

    @property
    def polled(self) -> frozenset[str]:
        """The agents whose plans the shared long-poll carries now."""
        with self._lock:
            return frozenset(self._slots)

    # -- used by the links ----------------------------------------------------------------------
    def _call(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        caller = self._caller
        if caller is None:
            raise LinkDown("no coordinator")
        try:
            return caller.call(method, *args, timeout=timeout)
        except Exception as exc:  # a caller may raise anything when unreachable (its contract)
            self._caller = None
            raise LinkDown(f"{method}: {type(exc).__name__}") from exc

    def _add(self, agent_id: str, version: int) -> None:
        with self._lock:
            slot = self._slots.setdefault(agent_id, _Slot())
            slot.known, slot.unknown, slot.plan = version, False, None
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="profd-mux", daemon=True)
                self._thread.start()

    def _wait(self, agent_id: str, version: int, step: int | None, timeout: float) -> PollReply:
        slot = self._slots.get(agent_id)
        if slot is None:  # never registered here, or forgotten: register (again)
            return PollReply(plan=None, known=False)
        deadline = time.monotonic() + timeout
        with slot.changed:
            slot.known, slot.step = version, step
            while True:
                if slot.unknown:
                    return PollReply(plan=None, known=False)
                if slot.plan is not None and slot.plan.version != version:
                    return PollReply(plan=slot.plan)
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return PollReply(plan=None)
                slot.changed.wait(min(left, 1.0))

    # -- the shared long-poll --------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                slots = {a: s for a, s in self._slots.items() if not s.unknown}
            if not slots:
                self._stop.wait(0.2)
                continue
            known = {
                a: (s.plan.version if s.plan is not None else s.known) for a, s in slots.items()
            }
            steps = {a: s.step for a, s in slots.items()}
            try:
                replies = self._call(
                    "poll_many", known, steps, self._poll_timeout, timeout=self._poll_timeout + 30
                )
            except LinkDown:
                for aid, slot in slots.items():  # every agent re-discovers and re-registers
                    self._forget(aid, slot)
                self._stop.wait(1.0)
                continue
            for aid, reply in replies.items():
                slot = slots.get(aid)
                if slot is None:
                    continue
                if not reply.known:
                    self._forget(aid, slot)
                    continue
                with slot.changed:
                    if reply.plan is not None:
                        slot.plan = reply.plan
                    slot.changed.notify_all()

    def _forget(self, agent_id: str, slot: _Slot) -> None:
        """The coordinator does not know the agent (it closed, or must register again): its
        poll returns "unknown" and the slot goes; registering again makes a new one, so a
        process whose agents come and go keeps no slot of a closed one."""
        with self._lock:
            if self._slots.get(agent_id) is slot:
                del self._slots[agent_id]
        with slot.changed:
            slot.unknown = True
            slot.changed.notify_all()


class MultiplexedLink:
    """A :class:`~profd.agent.channel.CoordinatorLink` whose long-poll is shared."""

    def __init__(self, mux: Multiplexer) -> None:
        self._mux = mux

    def register(self, info: AgentInfo, step: int | None) -> Any:
        reg = self._mux._call("register", info, step)
        self._mux._add(info.agent_id, reg.plan.version)
        return reg

    def poll(self, agent_id: str, version: int, step: int | None, timeout: float) -> PollReply:
        return self._mux._wait(agent_id, version, step, timeout)

    def report(self, agent_id: str, events: list[AgentEvent]) -> bool:
        return self._mux._call("report", agent_id, events)

    def clock_ns(self) -> int:
        return self._mux._call("clock_ns", timeout=5.0)
