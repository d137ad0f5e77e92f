"""Triggers: conditions on live step / stage times that start bounded sessions by themselves.

Pure logic (no Ray), owned by the coordinator. Each ``times`` event an agent sends
(:class:`~profd.core.protocol.MarkDurations`) is offered to :meth:`TriggerBook.observe`
after :class:`~profd.actors.mark_stats.MarkStats` took it. A trigger holds when the rank's
newest ``for_steps`` durations of the watched mark each exceed ``factor`` x the median of
the role's newest ``baseline_steps`` durations per rank (pooled; the median shrugs off the
one slow rank) and ``min_ms``. A firing is then *due*; the coordinator turns it into a
session on that rank and one healthy peer of its role, and tells the book how that went:

* :meth:`fired`: the session exists; cooldown and the hourly cap count from now;
* nothing, when a live session holds the ranks: the firing stays due (:meth:`due`) and the
  next tick tries again; it is never dropped, and the trigger holds no second one meanwhile;
* :meth:`failed`: the request was refused for another reason: recorded, not retried.

A holding condition during cooldown, past ``max_per_hour`` or past the disk budget is
*suppressed*: counted per reason, no session.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum

from profd.core.protocol import MarkDurations
from profd.core.trigger_request import TriggerRequest

__all__ = ["Evidence", "Firing", "FiringState", "Trigger", "TriggerBook"]

log = logging.getLogger(__name__)

HOUR_S = 3600.0
#: Firings kept per trigger for GET /api/v1/triggers (the counts cover every one).
KEPT_FIRINGS = 50

#: (role, mark, n) -> the newest n durations of each rank of the role that reports it, per rank.
History = Callable[[str, str | None, int], dict[int, list[float]]]


class FiringState(StrEnum):
    DUE = "due"  # the condition held; the session is being started or waits for busy ranks
    FIRED = "fired"  # its session was created
    FAILED = "failed"  # the session was refused (not because the ranks were busy)


class Suppressed(StrEnum):
    COOLDOWN = "cooldown"
    HOURLY_CAP = "max_per_hour"
    DISK_BUDGET = "disk_budget"


@dataclass(frozen=True, slots=True)
class Evidence:
    """Why a trigger fired: the rank, what it measured, and the baseline it was held to."""

    role: str
    rank: int
    agent_id: str
    mark: str  # "step" or the stage label
    observed_s: float
    baseline_s: float
    factor: float
    baseline_samples: int
    step: int | None = None  # the rank's step as the coordinator knew it then

    def as_dict(self) -> dict[str, object]:
        return {
            "role": self.role, "rank": self.rank, "agent_id": self.agent_id, "mark": self.mark,
            "observed_s": round(self.observed_s, 6), "baseline_s": round(self.baseline_s, 6),
            "factor": self.factor, "baseline_samples": self.baseline_samples, "step": self.step,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Firing:
    firing_id: str
    trigger_id: str
    at: float  # wall clock, seconds
    evidence: Evidence
    state: FiringState = FiringState.DUE
    session_id: str | None = None
    error: str | None = None


@dataclass
class Trigger:
    trigger_id: str
    request: TriggerRequest
    created_at: float
    firings: deque[Firing] = field(default_factory=lambda: deque(maxlen=KEPT_FIRINGS))
    fired_at: deque[float] = field(default_factory=deque)  # sessions started, last hour
    suppressed: dict[Suppressed, int] = field(default_factory=dict)
    disk_bytes: int = 0  # traces of its sessions so far
    due: Firing | None = None

    @property
    def fired(self) -> int:
        return sum(1 for f in self.firings if f.state is FiringState.FIRED)


class TriggerBook:
    """Every trigger of the coordinator, its firings and what it suppressed."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._triggers: dict[str, Trigger] = {}
        self._seq = itertools.count(1)

    def add(self, request: TriggerRequest, trigger_id: str | None = None) -> Trigger:
        tid = trigger_id or f"trg-{secrets.token_hex(4)}"
        if tid in self._triggers:
            raise ValueError(f"trigger_id: {tid} exists")
        t = self._triggers[tid] = Trigger(tid, request, self._clock())
        return t

    def remove(self, trigger_id: str) -> Trigger:
        try:
            return self._triggers.pop(trigger_id)
        except KeyError:
            raise KeyError(f"unknown trigger {trigger_id}") from None

    def get(self, trigger_id: str) -> Trigger:
        try:
            return self._triggers[trigger_id]
        except KeyError:
            raise KeyError(f"unknown trigger {trigger_id}") from None

    def all(self) -> list[Trigger]:
        return sorted(self._triggers.values(), key=lambda t: (-t.created_at, t.trigger_id))

    def due(self) -> list[Firing]:
        """Firings waiting for their session (new, or their ranks were busy)."""
        return [t.due for t in self._triggers.values() if t.due is not None]

    # -- evaluation ----------------------------------------------------------------------
    def observe(
        self,
        agent_id: str,
        role: str,
        rank: int,
        times: MarkDurations,
        history: History,
        step: int | None = None,
    ) -> list[Firing]:
        """The firings that ``times`` (just added to the rolling windows) makes due
        (``step``: the agent's current step, for the evidence)."""
        out = []
        for t in self._triggers.values():
            cond = t.request.when
            if cond.role != role:
                continue
            if not _new_durations(times, cond.mark):
                continue
            per_rank = history(role, cond.mark, cond.baseline_steps)
            pooled = [x for values in per_rank.values() for x in values[-cond.baseline_steps :]]
            if len(pooled) < cond.baseline_steps:
                continue  # not armed: too little history to call anything slow
            baseline = statistics.median(pooled)
            newest = per_rank.get(rank, [])[-cond.for_steps :]
            if len(newest) < cond.for_steps:
                continue
            weakest = min(newest)
            if weakest <= cond.factor * baseline or weakest * 1000.0 < cond.min_ms:
                continue
            evidence = Evidence(
                role, rank, agent_id, cond.mark or "step", newest[-1], baseline, cond.factor,
                len(pooled), step,
            )  # fmt: skip
            firing = self._hold(t, evidence)
            if firing is not None:
                out.append(firing)
        return out

    def _hold(self, t: Trigger, evidence: Evidence) -> Firing | None:
        now = self._clock()
        while t.fired_at and now - t.fired_at[0] > HOUR_S:
            t.fired_at.popleft()
        if t.due is not None:
            return None  # one firing at a time: the due one still waits for its ranks
        reason = None
        if t.fired_at and now - t.fired_at[-1] < t.request.cooldown_s:
            reason = Suppressed.COOLDOWN
        elif len(t.fired_at) >= t.request.max_per_hour:
            reason = Suppressed.HOURLY_CAP
        elif t.disk_bytes >= t.request.max_disk_mb * 1e6:
            reason = Suppressed.DISK_BUDGET
        if reason is not None:
            t.suppressed[reason] = t.suppressed.get(reason, 0) + 1
            return None
        firing = Firing(f"{t.trigger_id}.{next(self._seq)}", t.trigger_id, now, evidence)
        t.due = firing
        t.firings.append(firing)
        return firing

    # -- outcomes ------------------------------------------------------------------------
    def fired(self, firing: Firing, session_id: str) -> Firing:
        t = self.get(firing.trigger_id)
        t.fired_at.append(self._clock())
        return self._settle(t, replace(firing, state=FiringState.FIRED, session_id=session_id))

    def failed(self, firing: Firing, error: str) -> Firing:
        t = self.get(firing.trigger_id)
        log.warning("trigger %s: its session was refused: %s", t.request.name, error)
        return self._settle(t, replace(firing, state=FiringState.FAILED, error=error))

    def add_disk(self, trigger_id: str, nbytes: int) -> None:
        """A trace of one of its sessions was written (for the disk budget)."""
        t = self._triggers.get(trigger_id)
        if t is not None:
            t.disk_bytes += max(0, nbytes)

    def _settle(self, t: Trigger, firing: Firing) -> Firing:
        t.due = None
        for i, f in enumerate(t.firings):
            if f.firing_id == firing.firing_id:
                t.firings[i] = firing
        return firing


def _new_durations(times: MarkDurations, mark: str | None) -> tuple[float, ...]:
    if mark is None:
        return times.step.seconds if times.step is not None else ()
    for d in times.stages:
        if d.label == mark:
            return d.seconds
    return ()
