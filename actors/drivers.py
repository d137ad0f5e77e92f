"""Single-controller drivers: step announcements and rollout phases, per Ray job.

The driver's ``profd.controller()`` calls these: every agent of a live session learns the step
before the step's first worker call, and rollout replicas start / stop their engines at the
phases the driver marks, confirming before the driver goes on. When each step began (as
heard here, before any of its worker calls) is kept, so the stage samples of workers that
mark no step of their own are placed in their step here (:meth:`DriverTable.step_at`).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from profd.core.errors import RequestInvalid
from profd.core.protocol import DriverAck
from profd.core.states import AgentState, ControllerPhase, PartState

if TYPE_CHECKING:
    from profd.actors.planbook import PlanBook
    from profd.actors.registry import AgentRecord, AgentRegistry
    from profd.actors.sessions import Part, Session

__all__ = ["DriverTable"]

log = logging.getLogger(__name__)

#: The phases a driver may mark with ``controller_phase`` (``step_begin`` comes with the step).
PHASES = frozenset(
    {ControllerPhase.ROLLOUT_BEGIN, ControllerPhase.ROLLOUT_END, ControllerPhase.STEP_END}
)


#: Step starts kept per job (a worker's stage samples arrive within a report or two).
KEPT_STARTS = 64


@dataclass(frozen=True, slots=True)
class _Heard:
    step: int
    at: float


class DriverTable:
    """The last step each job's driver announced, and waits on agents' confirmations."""

    def __init__(
        self,
        clock: Callable[[], float],
        silence_s: float,
        registry: AgentRegistry,
        plans: PlanBook,
        live_sessions: Callable[[], list[Session]],
    ) -> None:
        self._clock = clock
        #: A driver unheard of this long no longer announces the job's step.
        self._silence_s = silence_s
        self._registry = registry
        self._plans = plans
        self._live_sessions = live_sessions
        #: Ray job id (None: a driver that does not say) -> its last step, and when.
        self._heard: dict[str | None, _Heard] = {}
        #: Ray job id -> (when, step) of its driver's newest step starts, oldest first.
        self._starts: dict[str | None, deque[tuple[float, int]]] = {}
        #: Notified whenever agent events arrive (phase waits re-check their agents).
        self._progress = asyncio.Condition()

    async def progressed(self) -> None:
        """Agent events arrived: wake the waits on rollout confirmations."""
        async with self._progress:
            self._progress.notify_all()

    @property
    def any_heard(self) -> bool:
        """Whether any driver ever announced a step to this incarnation."""
        return bool(self._heard)

    async def step(self, step: int, timeout: float, job_id: str | None) -> DriverAck:
        """See :meth:`ProfileCoordinator.controller_step`."""
        heard = self._heard[job_id] = _Heard(step, self._clock())
        starts = self._starts.setdefault(job_id, deque(maxlen=KEPT_STARTS))
        if not starts or starts[-1][1] != step:  # a repeated announcement is no new start
            starts.append((heard.at, step))
        targets = self.targets(job_id)
        if not targets:
            return DriverAck(step)
        rollout = {aid for aid in targets if self._is_rollout_agent(aid)}
        versions = {
            aid: self._plans.set_controller_step(
                aid, step, ControllerPhase.STEP_BEGIN if aid in rollout else None
            )
            for aid in targets
        }
        # one deadline for both waits: the driver gives this call timeout + a small grace;
        # only registered agents are waited for (a restarted coordinator's targets come
        # back over seconds: each step used to wait out the timeout for them meanwhile)
        here = self._registered(targets)
        versions = {aid: v for aid, v in versions.items() if aid in here}
        rollout &= here
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        slow = await self._plans.wait_delivered(versions, timeout)
        left = max(0.0, deadline - loop.time())
        slow += await self._wait_phase(rollout - set(slow), step, ControllerPhase.STEP_BEGIN, left)
        if slow:
            log.warning(
                "controller step %s: %d agent(s) did not confirm in %.0f s: %s",
                step,
                len(slow),
                timeout,
                ", ".join(slow),
            )
        return DriverAck(step, len(targets), tuple(sorted(slow)), bool(rollout))

    async def phase(self, step: int, phase: str, timeout: float, job_id: str | None) -> DriverAck:
        """See :meth:`ProfileCoordinator.controller_phase`."""
        if phase not in PHASES:
            raise RequestInvalid.at("phase", f"unknown controller phase {phase!r}")
        rollout = {a for a in self.targets(job_id) if self._is_rollout_agent(a)}
        for aid in rollout:
            self._plans.set_controller_step(aid, step, ControllerPhase(phase))
        slow = await self._wait_phase(self._registered(rollout), step, phase, timeout)
        done = ControllerPhase(phase)
        return DriverAck(step, len(rollout), tuple(sorted(slow)), bool(rollout), done)

    def driver_step(self, job_id: str | None = None) -> int | None:
        """The step the single-controller driver of Ray job ``job_id`` announced, while it
        still announces; a driver that did not name its job stands for any job."""
        for key in (job_id, None) if job_id is not None else (None,):
            seen = self._heard.get(key)
            if seen is not None and self._clock() - seen.at <= self._silence_s:
                return seen.step
        return None

    def step_at(self, job_id: str | None, t: float) -> int | None:
        """The step of job ``job_id``'s driver that began last at or before ``t`` (this
        coordinator's clock), a driver that does not name its job standing for any job;
        ``None`` before the steps kept, or longer than the silence after the newest (the
        driver stopped announcing)."""
        best: tuple[float, int] | None = None
        for key in (job_id, None) if job_id is not None else (None,):
            starts = self._starts.get(key)
            if not starts:
                continue
            i = bisect.bisect_right(starts, (t, float("inf"))) - 1
            if i < 0 or (i == len(starts) - 1 and t - starts[i][0] > self._silence_s):
                continue
            if best is None or starts[i][0] > best[0]:
                best = starts[i]
        return None if best is None else best[1]

    def latest(self) -> tuple[int, float] | None:
        """(step, seconds since) of the driver heard from last, while it announces."""
        now = self._clock()
        fresh = [h for h in self._heard.values() if now - h.at <= self._silence_s]
        if not fresh:
            return None
        last = max(fresh, key=lambda h: (h.at, h.step))
        return last.step, round(now - last.at, 3)

    def fresh(self) -> dict[str | None, tuple[int, float]]:
        """Each announcing driver's Ray job -> (step, seconds since)."""
        now = self._clock()
        return {
            job: (h.step, round(now - h.at, 3))
            for job, h in self._heard.items()
            if now - h.at <= self._silence_s
        }

    def job_step(self, rec: AgentRecord) -> int | None:
        """The job's step on a registered agent: its own, else its driver's."""
        return rec.step(self.driver_step(rec.info.job_id))

    def targets(self, job_id: str | None = None) -> set[str]:
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

    def _registered(self, agents: set[str]) -> set[str]:
        """Those of ``agents`` alive in the registry now: the others cannot confirm."""
        out = set()
        for aid in agents:
            rec = self._registry.get(aid)
            if rec is not None and rec.state is AgentState.ALIVE:
                out.add(aid)
        return out

    def _is_rollout_agent(self, agent_id: str) -> bool:
        rec = self._registry.get(agent_id)
        return rec is not None and rec.info.replica is not None

    async def _wait_phase(
        self, agents: set[str], step: int, phase: str, timeout: float
    ) -> list[str]:
        """Wait until each rollout agent confirmed ``(step, phase)`` (or its part ended)."""

        def pending() -> list[str]:
            out = []
            for aid in agents:
                held = (
                    _holds(s, s.targets[aid], step, phase)
                    for s in self._live_sessions()
                    if aid in s.targets
                )
                if any(held):
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


def _holds(session: Session, part: Part, step: int, phase: str) -> bool:
    """Whether a rollout agent's part holds the driver at ``(step, phase)``: it has not
    confirmed it, and is not done with the session's steps. A replica collecting (its
    engine stopped: it says so only then) after confirming a phase of the session's last
    step is only handing in its files (seconds for a large window); it records nothing
    more, so the driver does not wait for it."""
    if part.state.is_terminal or part.last_phase == [step, phase]:
        return False
    last = part.last_phase
    done_with = bool(last and session.steps and last[0] >= max(session.steps))
    return not (part.state is PartState.COLLECTING and done_with)
