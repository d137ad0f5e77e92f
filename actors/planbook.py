"""Per-agent plans with versions and long-poll wake-ups (asyncio, inside the coordinator).

An agent waits either alone (:meth:`PlanBook.wait`, one long-poll per agent) or with the
other agents of its process (:meth:`PlanBook.wait_any`, one long-poll for all of them, see
:mod:`profd.agent.multiplex`). A parked poll waits on a bare future (woken in the loop's next
turn), held only while it waits, so an idle agent costs a plan reference and two integers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable

from profd.core.protocol import AgentPlan, WindowPlan

__all__ = ["PlanBook", "release"]

_EMPTY = AgentPlan(version=0)


class _Entry:
    __slots__ = ("acked", "delivered", "plan", "waiters", "woken")

    def __init__(self) -> None:
        self.plan = _EMPTY
        #: The plan version the agent last said it holds (from its polls).
        self.delivered = 0
        #: Futures of long-polls parked on this agent (its own, or its process's).
        self.waiters: list[asyncio.Future[None]] | None = None
        #: Events of ``wait_delivered`` calls.
        self.acked: list[asyncio.Event] | None = None
        #: Woken while no poll was parked: the next poll returns at once.
        self.woken = False


def _signal(waiters: list[asyncio.Event] | list[asyncio.Future[None]] | None) -> None:
    for w in waiters or ():
        if isinstance(w, asyncio.Event):
            w.set()
        else:
            release(w)


def release(fut: asyncio.Future[None]) -> None:
    """Wake a parked poll's future (once; a cancelled one stays so)."""
    if not fut.done():
        fut.set_result(None)


class PlanBook:
    """Holds the current plan of every agent. Versions come from one counter, so a plan never
    goes back in version."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        #: Told of every changed plan (``refresh`` False) and wake-up (True); returns whether
        #: it delivers them (a relay the coordinator pushes to: :mod:`profd.actors.relay_desk`).
        self.on_change: Callable[[str, bool], bool] | None = None
        # Start from the clock so a restarted coordinator never reuses a version an agent
        # already holds for a different plan.
        self._version = int(time.time() * 1000)

    def plan(self, agent_id: str) -> AgentPlan:
        entry = self._entries.get(agent_id)
        return entry.plan if entry else _EMPTY

    def ensure(self, agent_id: str) -> None:
        if agent_id not in self._entries:
            self._entries[agent_id] = _Entry()

    def set(self, agent_id: str, windows: tuple[WindowPlan, ...], quiet: bool = False) -> bool:
        """Install ``windows`` for an agent; return True when that changed its plan.
        ``quiet``: when the plan only loses windows, its parked poll (or relay) is not woken:
        the agent gets the plan at its next poll."""
        entry = self._entries.setdefault(agent_id, _Entry())
        plan = entry.plan
        if plan.windows == windows:
            return False
        fewer = quiet and all(w in plan.windows for w in windows)
        step, phase = plan.controller_step, plan.controller_phase
        self._install(agent_id, entry, windows, step, phase, notify=not fewer)
        return True

    def set_controller_step(self, agent_id: str, step: int, phase: str | None = None) -> int:
        """Announce a controller step (and phase) to an agent; return the plan version that
        carries it."""
        entry = self._entries.setdefault(agent_id, _Entry())
        plan = entry.plan
        if plan.controller_step != step or plan.controller_phase != phase:
            self._install(agent_id, entry, plan.windows, step, phase)
        return entry.plan.version

    def _changed_plan(self, agent_id: str, entry: _Entry) -> None:
        _signal(entry.waiters)
        if self.on_change is not None:
            self.on_change(agent_id, False)

    def _install(
        self,
        agent_id: str,
        entry: _Entry,
        windows: tuple[WindowPlan, ...],
        step: int | None,
        phase: str | None = None,
        notify: bool = True,
    ) -> None:
        self._version += 1
        entry.plan = AgentPlan(
            version=self._version,
            windows=windows,
            controller_step=step,
            controller_phase=phase,
            stacks=entry.plan.stacks,
            spans=entry.plan.spans,
        )
        if notify:
            self._changed_plan(agent_id, entry)

    def set_spans(self, agent_id: str, on: bool) -> None:
        """Tell an agent whether its marks keep their end times (a straggler trigger watches
        its role): a new plan version only when that changes."""
        entry = self._entries.get(agent_id)
        if entry is not None and entry.plan.spans != on:
            self._version += 1
            entry.plan = dataclasses.replace(entry.plan, version=self._version, spans=on)
            self._changed_plan(agent_id, entry)

    def request_stacks(self, agent_id: str, request: int) -> None:
        """Ask an agent for its stack (``AgentPlan.stacks``): a new plan version with the same
        windows, which wakes its long-poll."""
        entry = self._entries.get(agent_id)
        if entry is None:
            return
        self._version += 1
        entry.plan = dataclasses.replace(entry.plan, version=self._version, stacks=request)
        self._changed_plan(agent_id, entry)

    def wake(self, agent_id: str) -> None:
        """Release the agent's parked long-poll without a new plan (it re-polls at once).
        With none parked (a relay between two shared polls) the next poll returns at once."""
        entry = self._entries.get(agent_id)
        if entry is not None:
            if entry.waiters:
                _signal(entry.waiters)
            elif self.on_change is None or not self.on_change(agent_id, True):
                entry.woken = True  # (a pushing relay is asked for fresh steps instead)

    def take_woken(self, agent_ids: Iterable[str]) -> set[str]:
        """The agents woken while no poll of theirs was parked (the flags are cleared)."""
        woken = set()
        for aid in agent_ids:
            entry = self._entries.get(aid)
            if entry is not None and entry.woken:
                entry.woken = False
                woken.add(aid)
        return woken

    def ack(self, agent_id: str, known_version: int) -> None:
        """The agent has ``known_version`` (it polled with it, or its relay saw it do so)."""
        entry = self._entries.get(agent_id)
        if entry is not None:
            self._ack(entry, known_version)

    def _ack(self, entry: _Entry, known_version: int) -> None:
        # Only forward, and never past the plan it has: an answer that comes late (a relay's
        # sync or push made before the agent took a newer plan) must not count a delivered
        # plan as undelivered again, and a version of an earlier incarnation above this
        # one's (its counter may run ahead of the clock it starts from) must not count every
        # later plan as delivered. An agent that loses its plan registers again.
        if entry.delivered < known_version <= entry.plan.version:
            entry.delivered = known_version
            _signal(entry.acked)

    def parked(self) -> int:
        """How many agents have a long-poll parked here now (O(agents): for benches and
        tests, not a hot path)."""
        return sum(1 for e in self._entries.values() if e.waiters)

    async def wait(self, agent_id: str, known_version: int, timeout: float) -> AgentPlan | None:
        """One agent's long-poll: its plan when it differs from ``known_version``."""
        changed = await self.wait_any({agent_id: known_version}, timeout)
        return changed.get(agent_id)

    async def wait_any(self, known: dict[str, int], timeout: float) -> dict[str, AgentPlan]:
        """A long-poll for several agents: the plans that differ from what each holds, as
        soon as one does (or ``{}`` after ``timeout``, or when one is woken)."""
        entries = [(a, self._entries.get(a)) for a in known]
        for aid, entry in entries:
            if entry is not None:
                self._ack(entry, known[aid])
        changed = self._changed(known)
        if changed or timeout <= 0:
            return changed
        # A bare future (not Event + wait_for, which wraps a task): a plan set on the loop
        # answers the poll in the next turn, so a session's fan-out goes out before the
        # coordinator builds its (large) reply.
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        timer = loop.call_later(timeout, release, fut)
        parked = [e for _, e in entries if e is not None]
        for e in parked:
            if e.waiters is None:
                e.waiters = []
            e.waiters.append(fut)
        try:
            await fut
        finally:
            timer.cancel()
            for e in parked:
                if e.waiters is not None:
                    e.waiters.remove(fut)
                    if not e.waiters:
                        e.waiters = None
        return self._changed(known)

    def _changed(self, known: dict[str, int]) -> dict[str, AgentPlan]:
        out = {}
        for aid, version in known.items():
            entry = self._entries.get(aid)
            if entry is not None and entry.plan.version != version:
                out[aid] = entry.plan
        return out

    async def wait_delivered(self, versions: dict[str, int], timeout: float) -> list[str]:
        """Wait until every agent holds at least its version; return the ones that do not."""
        deadline = time.monotonic() + timeout
        pending = dict(versions)
        while True:
            pending = {
                a: v
                for a, v in pending.items()
                if a in self._entries and self._entries[a].delivered < v
            }
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                return sorted(pending)
            event = asyncio.Event()
            entries = [self._entries[a] for a in pending]
            for e in entries:
                e.acked = [*(e.acked or []), event]
            try:
                await asyncio.wait_for(event.wait(), left)
            except TimeoutError:
                pass
            finally:
                for e in entries:
                    if e.acked is not None and event in e.acked:
                        e.acked.remove(event)
                        if not e.acked:
                            e.acked = None
