"""Where a new session's window falls: the steps it names, a timed window, or the first steps
every target can still reach (``next_steps``), learnt from fresh step reports."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from profd.core.states import SessionState

if TYPE_CHECKING:
    from profd.actors.drivers import DriverTable
    from profd.actors.planbook import PlanBook
    from profd.actors.registry import AgentRecord, AgentRegistry
    from profd.actors.sessions import Session
    from profd.actors.targeting import Target
    from profd.core.request import SessionRequest
    from profd.core.settings import CoordinatorSettings

__all__ = ["TIMED_GRACE_S", "Alignment", "waiting_note"]

#: A timed session's targets have at least this long after the window to hand in files.
TIMED_GRACE_S = 300
#: Lead steps never exceed this, however fast the steps (a window stays near "next").
MAX_LEAD_STEPS = 50
#: A target whose step has not moved for this long is stalled (reports show new steps
#: every second or so while a loop runs): its pace is the time it has stood there.
STALLED_S = 10.0


class _Waiter:
    """One alignment waiting for a fresh step report from each of ``pending``."""

    __slots__ = ("done", "pending")

    def __init__(self, pending: Iterable[str]) -> None:
        self.pending = set(pending)
        self.done = asyncio.Event()


class Alignment:
    def __init__(
        self,
        settings: CoordinatorSettings,
        registry: AgentRegistry,
        plans: PlanBook,
        drivers: DriverTable,
        step_seconds: Callable[[str], float | None] = lambda agent_id: None,
        clock: Callable[[], float] = time.time,
        step_age: Callable[[str, float], float | None] = lambda agent_id, now: None,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._step_seconds = step_seconds  # an agent's step period (MarkStats.step_period)
        self._step_age = step_age  # how long it has stood at its step (MarkStats.step_age)
        self._registry = registry
        self._plans = plans
        self._drivers = drivers
        self._waiters: list[_Waiter] = []

    async def place(self, session: Session, req: SessionRequest, targets: Iterable[Target]) -> None:
        """Fix the session's steps (given, aligned, or none for a timed window)."""
        targets = list(targets)
        session.open_targeting = req.wait_for_agents
        if req.steps is not None:
            session.resolve_steps(req.steps)
        elif req.duration_s is not None:
            session.resolve_steps(())
            # bounded: the window, then time to write the files (rollout engines say how long
            # theirs may take: stop, then flush)
            budgets = [t.agent.replica.collect_budget_s for t in targets if t.agent.replica]
            grace = max([TIMED_GRACE_S, *budgets])
            session.deadline = min(session.deadline, session.created_at + req.duration_s + grace)
        else:
            await self._align(session, req.next_steps or 1)
        replicas = [t for t in targets if t.agent.replica is not None]
        if replicas and req.duration_s is None and not self._drivers.any_heard:
            session.warnings.append(
                "rollout replicas record the steps a driver announces with "
                "profd.controller().step(n); none has been announced yet (without a "
                "single-controller driver, profile replicas with duration_s)"
            )

    async def _align(self, session: Session, count: int) -> None:
        """Pick the first step every target can still reach, from fresh step reports."""
        waiter = _Waiter(session.targets)
        self._waiters.append(waiter)
        for aid in waiter.pending:
            self._plans.wake(aid)  # the agent re-polls at once with its current step
        try:
            if self._settings.align_timeout_s > 0:
                await asyncio.wait_for(waiter.done.wait(), self._settings.align_timeout_s)
        except TimeoutError:
            pass
        finally:
            self._waiters.remove(waiter)
        recs = [r for a in session.targets if (r := self._registry.get(a)) is not None]
        now = self._clock()
        known = [s for r in recs if (s := self._step_now(r, now)) is not None]
        # the drivers of the targets' jobs announce their steps: they are authoritative
        drivers = {self._drivers.driver_step(r.info.job_id) for r in recs}
        known += [d for d in drivers if d is not None]
        first = (max(known) + 1 if known else 0) + self._lead_steps(recs)
        session.resolve_steps(tuple(range(first, first + count)))

    def _step_now(self, rec: AgentRecord, now: float) -> int | None:
        """Where the agent's loop is now: its last reported step, and the steps its pace
        (:meth:`_lead_steps`'s step period) took since it was reported. An agent whose
        report is late (its link moving to the node's relay as the job starts, a loaded
        node) was placed from a step seconds old, and its window had begun before its plan
        came; at most :data:`MAX_LEAD_STEPS` are added (a loop that paused is not sent far
        ahead)."""
        step = rec.current_step
        if not isinstance(step, int):
            return step
        period = self._step_seconds(rec.info.agent_id)
        if not period or now <= rec.step_seen:
            return step
        return step + min(int((now - rec.step_seen) / period), MAX_LEAD_STEPS)

    def _lead_steps(self, recs: list[Any]) -> int:
        """``align_lead_steps``, or more when the targets' steps are fast: the window starts
        at least ``align_lead_s`` ahead by the quickest target's step period (the pace of its
        loop, not only the time inside its step mark: a 10 ms step every 0.5 s is 0.5 s a
        step, else a next step was 50 steps, 25 s, away)."""
        lead = self._settings.align_lead_steps
        times = [t for r in recs if (t := self._pace(r))]
        if times and self._settings.align_lead_s > 0:
            lead = max(lead, math.ceil(self._settings.align_lead_s / max(min(times), 1e-3)))
        return min(lead, MAX_LEAD_STEPS)

    def _pace(self, rec: AgentRecord) -> float | None:
        """The agent's step period, or how long it has stood at its step when that is far
        longer (:data:`STALLED_S`) and a fresh report says so: a loop that hangs is not
        fast, and a window placed by its pace before the hang was 50 steps ahead when it
        recovered. (One that has not reported for long may be running on: see
        :meth:`_step_now`.)"""
        period = self._step_seconds(rec.info.agent_id)
        if not period:
            return period
        now = self._clock()
        age = self._step_age(rec.info.agent_id, now)
        if age is not None and age > STALLED_S and now - rec.step_seen <= STALLED_S:
            return max(period, age)
        return period

    def note_fresh_step(self, agent_id: str) -> None:
        """The agent just reported its current step (it polled)."""
        for w in self._waiters:
            w.pending.discard(agent_id)
            if not w.pending:
                w.done.set()

    def say_what_is_past(self, s: Session) -> None:
        """An armed step session waits for its first step still ahead, and says so."""
        if s.state is not SessionState.ARMED or not s.steps or s.request.duration_s is not None:
            return
        recs = [self._registry.get(a) for a in s.targets]
        note = waiting_note(s.steps, [self._drivers.job_step(r) if r else None for r in recs])
        if note is not None:
            s.reason = note


def waiting_note(steps: tuple[int, ...], current: list[int | None]) -> str | None:
    """The reason an armed session gives when its first steps have already begun on every
    target (at ``current``): it waits for the first step still ahead, never a past one."""
    if not current or None in current:
        return None
    now_at = min(c for c in current if c is not None)
    past = [x for x in steps if x <= now_at]
    ahead = [x for x in steps if x > now_at]
    if not (past and ahead):
        return None
    span = f"{past[0]}-{past[-1]}" if len(past) > 2 else ", ".join(map(str, past))
    return (
        f"waiting for step {ahead[0]}; step(s) {span} had already begun on every target "
        f"(at step {now_at}) and will be missed"
    )
