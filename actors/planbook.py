"""Per-agent plans with versions and long-poll wake-ups (asyncio, inside the coordinator)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from profd.protocol import AgentPlan, WindowPlan

__all__ = ["PlanBook"]


@dataclass
class _Entry:
    plan: AgentPlan
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    #: The plan version the agent last said it holds (from its polls).
    delivered: int = 0
    acked: asyncio.Event = field(default_factory=asyncio.Event)


class PlanBook:
    """Holds the current plan of every agent.

    ``wait`` parks a long-poll until the agent's plan changes, :meth:`wake` is called, or the
    timeout passes. Versions come from one counter, so a plan never goes back in version.
    """

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        # Start from the clock so a restarted coordinator never reuses a version an agent
        # already holds for a different plan.
        self._version = int(time.time() * 1000)

    def plan(self, agent_id: str) -> AgentPlan:
        entry = self._entries.get(agent_id)
        return entry.plan if entry else AgentPlan(version=0)

    def ensure(self, agent_id: str) -> None:
        if agent_id not in self._entries:
            self._entries[agent_id] = _Entry(AgentPlan(version=0))

    def set(self, agent_id: str, windows: tuple[WindowPlan, ...]) -> bool:
        """Install ``windows`` for an agent; return True when that changed its plan."""
        entry = self._entries.setdefault(agent_id, _Entry(AgentPlan(version=0)))
        if entry.plan.windows == windows:
            return False
        self._install(
            agent_id, entry, windows, entry.plan.controller_step, entry.plan.controller_phase
        )
        return True

    def set_controller_step(self, agent_id: str, step: int, phase: str | None = None) -> int:
        """Announce a controller step (and phase) to an agent; return the plan version that
        carries it."""
        entry = self._entries.setdefault(agent_id, _Entry(AgentPlan(version=0)))
        plan = entry.plan
        if plan.controller_step != step or plan.controller_phase != phase:
            self._install(agent_id, entry, plan.windows, step, phase)
        return entry.plan.version

    def _install(
        self,
        agent_id: str,
        entry: _Entry,
        windows: tuple[WindowPlan, ...],
        step: int | None,
        phase: str | None = None,
    ) -> None:
        self._version += 1
        entry.plan = AgentPlan(
            version=self._version, windows=windows, controller_step=step, controller_phase=phase
        )
        self.wake(agent_id)

    async def wait_delivered(self, versions: dict[str, int], timeout: float) -> list[str]:
        """Wait until every agent holds at least its version; return the ones that do not."""
        deadline = time.monotonic() + timeout
        pending = dict(versions)
        while pending:
            pending = {
                a: v
                for a, v in pending.items()
                if a in self._entries and self._entries[a].delivered < v
            }
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                break
            waits = [asyncio.ensure_future(self._entries[a].acked.wait()) for a in pending]
            _done, rest = await asyncio.wait(
                waits, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            for w in rest:
                w.cancel()
        return sorted(pending)

    def wake(self, agent_id: str) -> None:
        entry = self._entries.get(agent_id)
        if entry is None:
            return
        entry.wake.set()
        entry.wake = asyncio.Event()

    async def wait(self, agent_id: str, known_version: int, timeout: float) -> AgentPlan | None:
        entry = self._entries.get(agent_id)
        if entry is None:
            return None
        if known_version != entry.delivered:
            entry.delivered = known_version
            entry.acked.set()
            entry.acked = asyncio.Event()
        if entry.plan.version != known_version:
            return entry.plan
        if timeout > 0:
            try:
                await asyncio.wait_for(entry.wake.wait(), timeout)
            except TimeoutError:
                pass
        current = self._entries.get(agent_id)
        if current is not None and current.plan.version != known_version:
            return current.plan
        return None

    def forget(self, agent_id: str) -> None:
        entry = self._entries.pop(agent_id, None)
        if entry is not None:
            entry.wake.set()
