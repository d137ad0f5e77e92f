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
        self._version += 1
        entry.plan = AgentPlan(version=self._version, windows=windows)
        self.wake(agent_id)
        return True

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
