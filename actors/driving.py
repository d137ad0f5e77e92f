"""Single-controller drivers: step announcements and rollout phases (coordinator mixin).

The driver's ``profd.controller()`` calls these: every agent of a live session learns the step
before the step's first worker call, and rollout replicas start / stop their engines at the
phases the driver marks, confirming before the driver goes on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from profd.actors.admission import waiting_note
from profd.core.errors import RequestInvalid
from profd.core.views import SessionState

if TYPE_CHECKING:
    from profd.actors.planbook import PlanBook
    from profd.actors.registry import AgentRegistry
    from profd.actors.sessions import Session

__all__ = ["ControllerMixin"]

log = logging.getLogger(__name__)

PHASES = ("rollout_begin", "rollout_end", "step_end")


class ControllerMixin:
    """Needs ``_plans``, ``_registry``, ``_live_sessions``, ``_progress``, ``_clock`` and
    ``_ensure_ticker`` from the coordinator."""

    _plans: PlanBook
    _registry: AgentRegistry
    _drivers: dict[str | None, tuple[int, float]]

    @property
    def _silence_s(self) -> float:
        """A driver unheard of this long no longer announces the job's step."""
        return self.settings.heartbeat_timeout_s  # type: ignore[attr-defined]

    def _live_sessions(self) -> list[Session]:
        raise NotImplementedError

    async def controller_step(
        self, step: int, timeout: float = 10.0, job_id: str | None = None
    ) -> dict[str, Any]:
        """A driver starts step ``step``: every agent of a live session learns it before this
        returns (or ``timeout`` passes; the slow agents are named). Cheap when nothing is
        being profiled: no agent is contacted. Rollout agents also handle ``step_begin``
        (replicas on their own devices start their engine's profiler) before this returns."""
        self._ensure_ticker()
        self._drivers[job_id] = (step, self._clock())
        targets = self._controller_targets(job_id)
        if not targets:
            return {"step": step, "agents": 0, "slow": [], "rollout": False}
        rollout = {aid for aid in targets if self._is_rollout_agent(aid)}
        versions = {
            aid: self._plans.set_controller_step(
                aid, step, "step_begin" if aid in rollout else None
            )
            for aid in targets
        }
        # one deadline for both waits: the driver gives this call timeout + a small grace
        deadline = asyncio.get_running_loop().time() + timeout
        slow = await self._plans.wait_delivered(versions, timeout)
        left = max(0.0, deadline - asyncio.get_running_loop().time())
        slow += await self._wait_phase(rollout - set(slow), step, "step_begin", left)
        if slow:
            log.warning(
                "controller step %s: %d agent(s) did not confirm in %.0f s: %s",
                step,
                len(slow),
                timeout,
                ", ".join(slow),
            )
        return {
            "step": step,
            "agents": len(targets),
            "slow": sorted(slow),
            "rollout": bool(rollout),
        }

    async def controller_phase(
        self, step: int, phase: str, timeout: float = 600.0, job_id: str | None = None
    ) -> dict:
        """A driver reached ``phase`` of ``step`` (``rollout_begin`` / ``rollout_end`` /
        ``step_end``): rollout agents start or stop their engines and confirm before this
        returns — so a colocated engine is stopped before training stages run."""
        if phase not in PHASES:
            raise RequestInvalid.at("phase", f"unknown controller phase {phase!r}")
        rollout = {a for a in self._controller_targets(job_id) if self._is_rollout_agent(a)}
        for aid in rollout:
            self._plans.set_controller_step(aid, step, phase)
        slow = await self._wait_phase(rollout, step, phase, timeout)
        return {"step": step, "phase": phase, "agents": len(rollout), "slow": sorted(slow)}

    def _driver_step(self, job_id: str | None = None) -> int | None:
        """The step the single-controller driver of Ray job ``job_id`` announced, while it
        still announces; a driver that did not name its job stands for any job."""
        for key in (job_id, None) if job_id is not None else (None,):
            seen = self._drivers.get(key)
            if seen is not None and self._clock() - seen[1] <= self._silence_s:
                return seen[0]
        return None

    def latest_driver(self) -> tuple[int, float] | None:
        """(step, seconds since) of the driver heard from last, while it announces."""
        now = self._clock()
        fresh = [
            (seen, step) for step, seen in self._drivers.values() if now - seen <= self._silence_s
        ]
        if not fresh:
            return None
        seen, step = max(fresh)
        return step, round(now - seen, 3)

    def _job_step(self, rec: Any) -> int | None:
        """The job's step on a registered agent: its own, else its driver's."""
        return rec.step(self._driver_step(rec.info.job_id))

    def _say_what_is_past(self, s: Session) -> None:
        """An armed step session waits for its first step still ahead, and says so."""
        if s.state is not SessionState.ARMED or not s.steps or s.request.duration_s is not None:
            return
        recs = [self._registry.get(a) for a in s.targets]
        note = waiting_note(s.steps, [self._job_step(r) if r else None for r in recs])
        if note is not None:
            s.reason = note

    def _controller_targets(self, job_id: str | None = None) -> set[str]:
        """Targets of live step sessions that follow this driver: agents of its Ray job (an
        agent or a driver that does not know its job follows any driver)."""
        out = set()
        for s in self._live_sessions():
            if s.steps is None:
                continue
            for aid, part in s.targets.items():
                if part.state.is_terminal:
                    continue
                rec = self._registry.get(aid)
                job = rec.info.job_id if rec is not None else None
                if job_id is None or job is None or job == job_id:
                    out.add(aid)
        return out

    def _is_rollout_agent(self, agent_id: str) -> bool:
        rec = self._registry.get(agent_id)
        return rec is not None and "replica_world_size" in rec.info.topology

    async def _wait_phase(
        self, agents: set[str], step: int, phase: str, timeout: float
    ) -> list[str]:
        """Wait until each rollout agent confirmed ``(step, phase)`` (or its part ended)."""

        def pending() -> list[str]:
            out = []
            for aid in agents:
                parts = [s.targets[aid] for s in self._live_sessions() if aid in s.targets]
                if any(p.last_phase != [step, phase] and not p.state.is_terminal for p in parts):
                    out.append(aid)
            return out

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while pending() and (left := deadline - loop.time()) > 0:
            async with self._progress:
                try:
                    await asyncio.wait_for(self._progress.wait(), min(0.5, left))
                except TimeoutError:
                    pass
        return pending()
