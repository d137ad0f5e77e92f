"""Triggers: conditions on live step / stage times, or an out-of-memory error, that start
bounded sessions by themselves.

Pure logic (no Ray), owned by the coordinator. The ``times`` events agents send
(:class:`~profd.core.protocol.MarkDurations`), once :class:`~profd.actors.mark_stats.MarkStats`
took them, are judged a pass at a time (:meth:`TriggerBook.observe_pass`, their reports as
``profd.actors.trigger_reports`` holds them); each ``oom`` event goes to
:meth:`TriggerBook.out_of_memory`. A trigger holds:

* ``step_time`` / ``stage_time``: when the rank's newest ``for_steps`` durations of the
  watched mark each exceed ``factor`` x the median of the role's newest ``baseline_steps``
  durations per rank (pooled; the median shrugs off the one slow rank) and ``min_ms``;
* ``straggler``: when the rank's stage ended late in each of the newest ``for_steps`` steps
  judged, by ``min_ms`` at least: a step is judged once every rank of the role that reports
  the stage has reported its end in that step, with the summary's straggler rule
  (``profd.actors.straggler_steps.judge_step``, the same as ``profd.analysis.stragglers``:
  later than the median end of the *other* ranks by more than ``max(k x MAD x 1.4826,
  5 ms, 5 % of the stage's median wall time)``);
* ``oom``: when a rank of the role reports a CUDA out-of-memory error.

A firing is then *due*; the coordinator turns it into a session on that rank and one
healthy peer of its role, and tells the book how that went:

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from profd.actors.straggler_steps import StepVerdict, judge_new_steps
from profd.actors.trigger_evidence import Evidence, evidence_from
from profd.actors.trigger_reports import (
    AGENT,
    RANK,
    ROLE,
    STEP,
    History,
    Report,
    RoleSpans,
    Spans,
    has_durations,
    report,
    span_steps,
)
from profd.core.protocol import MarkDurations, OutOfMemory
from profd.core.trigger_request import TriggerKind, TriggerRequest

__all__ = [
    "Evidence",
    "Firing",
    "FiringState",
    "Trigger",
    "TriggerBook",
]

log = logging.getLogger(__name__)

HOUR_S = 3600.0
#: Firings kept per trigger for GET /api/v1/triggers (the counts cover every one).
KEPT_FIRINGS = 50
#: Ray jobs whose straggler verdicts a trigger keeps besides the one it judges.
KEPT_JOBS = 16


class FiringState(StrEnum):
    DUE = "due"  # the condition held; the session is being started or waits for busy ranks
    FIRED = "fired"  # its session was created
    FAILED = "failed"  # the session was refused (not because the ranks were busy)


class Suppressed(StrEnum):
    COOLDOWN = "cooldown"
    HOURLY_CAP = "max_per_hour"
    DISK_BUDGET = "disk_budget"


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
    last_fired_at: float | None = None  # the newest session it started (its cooldown)
    suppressed: dict[Suppressed, int] = field(default_factory=dict)
    disk_bytes: int = 0  # traces of its sessions so far
    due: Firing | None = None
    #: straggler: step -> its verdict (the newest KEPT_VERDICTS steps judged)
    verdicts: dict[int, StepVerdict] = field(default_factory=dict)
    #: straggler: the agents those verdicts were judged on (another job's, or a restarted
    #: rank's, start afresh: their step numbers are another run's)
    verdict_agents: frozenset[str] = frozenset()
    #: straggler: the Ray job ``verdicts`` are of; each job's ranks are a population of
    #: their own, and the other jobs' verdicts wait here while one is judged
    job: str | None = None
    other_jobs: dict[str | None, tuple[dict[int, StepVerdict], frozenset[str]]] = field(
        default_factory=dict
    )

    def judge_job(self, job: str | None) -> None:
        """Judge Ray job ``job``'s ranks next: its own verdicts, not another job's."""
        if job == self.job:
            return
        self.other_jobs[self.job] = (self.verdicts, self.verdict_agents)
        self.verdicts, self.verdict_agents = self.other_jobs.pop(job, ({}, frozenset()))
        self.job = job
        while len(self.other_jobs) > KEPT_JOBS:  # jobs end; their verdicts go, oldest first
            del self.other_jobs[next(iter(self.other_jobs))]

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

    def replace(self, trigger_id: str, request: TriggerRequest) -> Trigger:
        """Trigger ``trigger_id`` watches ``request`` from now on, under the same id. Its
        firings stay (cooldown, the hourly cap and the disk budget count them), and a firing
        still due stays if the condition did not change (else it fails, saying why); what it
        judged on (straggler verdicts) starts afresh."""
        t = self.get(trigger_id)
        fresh = Trigger(trigger_id, request, t.created_at)
        fresh.firings, fresh.fired_at, fresh.last_fired_at = t.firings, t.fired_at, t.last_fired_at
        fresh.suppressed, fresh.disk_bytes = t.suppressed, t.disk_bytes
        self._triggers[trigger_id] = fresh
        if t.due is not None and request.when != t.request.when:
            # judged by the condition replaced: it ends, saying so (its ranks may not be
            # the new condition's role at all); one of an unchanged condition still fires
            why = "the trigger's condition was changed before its session started"
            self._settle(fresh, replace(t.due, state=FiringState.FAILED, error=why))
        else:
            fresh.due = t.due
        return fresh

    def named(self, name: str) -> Trigger | None:
        """The trigger called ``name`` (names are unique among those added by request)."""
        return next((t for t in self._triggers.values() if t.request.name == name), None)

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

    def __len__(self) -> int:
        return len(self._triggers)

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
        spans: Spans | None = None,
        profiled: Callable[[str], bool] | None = None,
        job: str | None = None,
    ) -> list[Firing]:
        """:meth:`observe_pass` of one report (``step``: the agent's current step, for the
        evidence)."""
        one = report(agent_id, role, rank, times, step)
        return self.observe_pass([one], history, spans, profiled, job)

    def observe_pass(
        self,
        reports: Sequence[Report],
        history: History,
        spans: Spans | None = None,
        profiled: Callable[[str], bool] | None = None,
        job: str | None = None,
    ) -> list[Firing]:
        """The firings that ``reports`` (their durations just added to the rolling windows)
        make due. ``spans``: the role's stage spans per rank (straggler triggers);
        ``profiled``: whether an agent's marks carry a profiler's cost now (its durations
        are not held against it, nor is it called late).

        Each trigger reads its role once for the whole pass (the baseline, the ranks' spans)
        and a straggler trigger judges each step the pass completed once, so a pass over a
        fleet's reports costs one read of the role, not one per report. A trigger that
        fails is logged and the others are judged. ``job``: the Ray job all ``reports``
        (and ``history``, ``spans``) are of: two jobs' ranks are never pooled."""
        profiled = profiled or (lambda _aid: False)
        by_role: dict[str, list[Report]] = {}
        for r in reports:
            by_role.setdefault(r[ROLE], []).append(r)
        out = []
        for t in list(self._triggers.values()):
            cond = t.request.when
            mine = by_role.get(cond.role)
            if not mine or cond.kind is TriggerKind.OOM:
                continue
            try:
                if cond.kind is TriggerKind.STRAGGLER:
                    t.judge_job(job)
                    firing = (
                        None if spans is None else self._straggler(t, mine, spans, profiled, job)
                    )
                    out += [firing] if firing is not None else []
                else:
                    out += self._slow(t, mine, history, profiled, job)
            except Exception:  # one trigger must not keep the others from being judged
                log.exception("trigger %s: judging the live times failed", t.request.name)
        return out

    def _slow(
        self,
        t: Trigger,
        reports: list[Report],
        history: History,
        profiled: Callable[[str], bool],
        job: str | None = None,
    ) -> list[Firing]:
        """A step / stage time trigger: each report's rank against the role's baseline."""
        cond = t.request.when
        new = [r for r in reports if not profiled(r[AGENT]) and has_durations(r, cond.mark)]
        if not new:
            return []
        per_rank, baseline, pooled = _baseline(t, history)
        if baseline is None:
            return []  # not armed: too little history to call anything slow
        out = []
        for r in new:
            newest = _tail(per_rank.get(r[RANK], ()), cond.for_steps)
            if len(newest) < cond.for_steps:
                continue
            weakest = min(newest)
            if weakest <= cond.factor * baseline or weakest * 1000.0 < cond.min_ms:
                continue
            evidence = Evidence(
                r[ROLE], r[RANK], r[AGENT], cond.mark or "step", newest[-1], baseline,
                cond.factor, pooled, r[STEP], kind=cond.kind.value,
            )  # fmt: skip
            firing = self._hold(t, evidence, job)
            if firing is not None:
                out.append(firing)
        return out

    def _straggler(
        self,
        t: Trigger,
        reports: list[Report],
        spans: Spans,
        profiled: Callable[[str], bool],
        job: str | None = None,
    ) -> Firing | None:
        """Judge the steps of the watched stage that ``reports`` completed (every rank that
        reports the stage has its end there), then, for each of them oldest first, whether
        a rank was late in the ``for_steps`` steps judged up to it: as when each report was
        judged on its own, a late step is not hidden by a later one of the same pass."""
        cond = t.request.when
        stage = cond.stage or ""
        new = sorted({s for r in reports for s in span_steps(r, stage)})
        if not new:
            return None
        role_spans = spans(cond.role, stage)
        agents = frozenset(role_spans.agents.values())
        if agents != t.verdict_agents:  # another job's agents, or a restarted rank
            t.verdicts.clear()
            t.verdict_agents = agents
        if len(role_spans.steps) < 2:
            return None
        for step in judge_new_steps(t.verdicts, new, role_spans.steps):
            evidence = self._late_up_to(t, step, role_spans, profiled)
            if evidence is not None:  # one rank held a pass: fired, or suppressed
                return self._hold(t, evidence, job)
        return None

    @staticmethod
    def _late_up_to(
        t: Trigger, step: int, role_spans: RoleSpans, profiled: Callable[[str], bool]
    ) -> Evidence | None:
        """The latest rank late (by ``min_ms`` at least) in each of the ``for_steps``
        steps judged up to ``step``, as evidence; ``None`` when none was."""
        cond = t.request.when
        newest = sorted(s for s in t.verdicts if s <= step)[-cond.for_steps :]
        if len(newest) < cond.for_steps:
            return None
        last = t.verdicts[newest[-1]]
        held = []
        for r, x in last.late.items():  # late in the newest step judged, and in each before
            runs = [t.verdicts[s].late.get(r) for s in newest]
            late = all(y is not None and y.late * 1e3 >= cond.min_ms for y in runs)
            if late and r in role_spans.agents and not profiled(role_spans.agents[r]):
                held.append((-x.late, r))
        if not held:
            return None
        rank = min(held)[1]
        x = last.late[rank]
        return Evidence(
            cond.role, rank, role_spans.agents[rank], cond.stage or "", x.late, x.threshold,
            None, last.members - 1, newest[-1], kind=cond.kind.value,
            peer_rank=last.peer, late_s=x.late,
            threshold_s=x.threshold, end_s=x.end, peer_median_end_s=x.reference, cause=x.cause,
        )  # fmt: skip

    def out_of_memory(
        self,
        agent_id: str,
        role: str,
        rank: int,
        oom: OutOfMemory,
        step: int | None = None,
        job: str | None = None,
    ) -> list[Firing]:
        """The firings an out-of-memory error on ``agent_id`` makes due."""
        out = []
        for t in self._triggers.values():
            cond = t.request.when
            if cond.kind is not TriggerKind.OOM or cond.role != role:
                continue
            evidence = Evidence(
                role, rank, agent_id, oom.stage or "step", 0.0, 0.0, None, 0, step,
                kind=cond.kind.value, error=oom.error, snapshot_path=oom.snapshot_path,
            )  # fmt: skip
            firing = self._hold(t, evidence, job)
            if firing is not None:
                out.append(firing)
        return out

    def _hold(self, t: Trigger, evidence: Evidence, job: str | None = None) -> Firing | None:
        evidence = replace(evidence, job_id=job)
        now = self._clock()
        while t.fired_at and now - t.fired_at[0] > HOUR_S:
            t.fired_at.popleft()
        if t.due is not None:
            return None  # one firing at a time: the due one still waits for its ranks
        reason = None
        # (a cooldown may be longer than the hour fired_at keeps)
        if t.last_fired_at is not None and now - t.last_fired_at < t.request.cooldown_s:
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
        t.last_fired_at = self._clock()
        t.fired_at.append(t.last_fired_at)
        return self._settle(t, replace(firing, state=FiringState.FIRED, session_id=session_id))

    def failed(self, firing: Firing, error: str) -> Firing:
        t = self.get(firing.trigger_id)
        log.warning("trigger %s: its session was refused: %s", t.request.name, error)
        return self._settle(t, replace(firing, state=FiringState.FAILED, error=error))

    def number_after(self, firing_ids: Iterable[str]) -> None:
        """Number new firings after every one of ``firing_ids`` (``<trigger_id>.<n>``: the
        firings a restored coordinator's sessions name), whichever trigger they belong to."""
        highest = [int(n) for f in firing_ids if (n := f.rpartition(".")[2]).isdigit()]
        if highest:
            self._seq = itertools.count(max(next(self._seq), max(highest) + 1))

    def recall(self, trigger_id: str, fired: list[tuple[float, str, dict[str, Any]]]) -> None:
        """A restored trigger's sessions, oldest first, as ``(created_at, session_id,
        origin)``: its firings again, so cooldown and the hourly cap hold across a
        coordinator restart. A firing keeps the id its origin names (call
        :meth:`number_after` with every restored id first); an origin without one (an older
        profd's) gets a new number."""
        t = self.get(trigger_id)
        now = self._clock()
        for at, session_id, origin in fired:
            firing_id = origin.get("firing_id")
            if not isinstance(firing_id, str):
                firing_id = f"{trigger_id}.{next(self._seq)}"
            evidence = evidence_from(origin.get("evidence") or {})
            # when its condition held (the origin says since it was kept), not its session
            when = origin.get("at")
            when = float(when) if isinstance(when, int | float) else at
            t.firings.append(
                Firing(firing_id, trigger_id, when, evidence, FiringState.FIRED, session_id)
            )
            t.last_fired_at = at if t.last_fired_at is None else max(t.last_fired_at, at)
            if now - at <= HOUR_S:
                t.fired_at.append(at)

    def recall_due(self, trigger_id: str, saved: dict[str, Any]) -> Firing | None:
        """A firing that was due (its ranks busy, or its session being started) when the
        coordinator went down, as :func:`saved_firing` kept it: due again, so it starts once
        its ranks are free. ``None`` when the record cannot be read (logged)."""
        t = self.get(trigger_id)
        try:
            firing = Firing(
                str(saved["firing_id"]),
                trigger_id,
                float(saved["at"]),
                evidence_from(dict(saved.get("evidence") or {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("trigger %s: its due firing could not be restored (%s)", trigger_id, exc)
            return None
        t.due = firing
        t.firings.append(firing)
        return firing

    def recall_failed(self, trigger_id: str, saved: Iterable[dict[str, Any]]) -> int:
        """A restored trigger's failed firings, as :func:`saved_firing` kept them (they made
        no session to restore them from), among its other firings by time; the number
        restored (a record that cannot be read is logged and left out)."""
        t = self.get(trigger_id)
        failed = []
        for row in saved:
            try:
                failed.append(
                    Firing(
                        str(row["firing_id"]),
                        trigger_id,
                        float(row["at"]),
                        evidence_from(dict(row.get("evidence") or {})),
                        FiringState.FAILED,
                        error=None if row.get("error") is None else str(row["error"]),
                    )
                )
            except (KeyError, TypeError, ValueError) as exc:
                log.warning(
                    "trigger %s: a failed firing could not be restored (%s)", trigger_id, exc
                )
        if failed:
            firings = sorted([*t.firings, *failed], key=lambda f: f.at)
            t.firings.clear()
            t.firings.extend(firings)  # the newest KEPT_FIRINGS
        return len(failed)

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


def saved_firing(f: Firing) -> dict[str, Any]:
    """What the store keeps of a due or failed firing (:meth:`TriggerBook.recall_due` and
    :meth:`TriggerBook.recall_failed` read it)."""
    kept = {"firing_id": f.firing_id, "at": f.at, "evidence": f.evidence.as_dict()}
    return {**kept, "error": f.error} if f.state is FiringState.FAILED else kept


def _baseline(t: Trigger, history: History) -> tuple[dict[int, Sequence[float]], float | None, int]:
    """The role's durations per rank, the pooled median of their newest ``baseline_steps``
    (``None``: too few to call anything slow) and how many were pooled."""
    cond = t.request.when
    per_rank = history(cond.role, cond.mark, cond.baseline_steps)
    pooled = [x for values in per_rank.values() for x in _tail(values, cond.baseline_steps)]
    armed = len(pooled) >= cond.baseline_steps
    return per_rank, statistics.median(pooled) if armed else None, len(pooled)


def _tail(values: Sequence[float], n: int) -> list[float]:
    """The newest ``n`` of ``values`` (a window: no slicing, and no copy of the rest)."""
    return list(itertools.islice(values, max(0, len(values) - n), None))
