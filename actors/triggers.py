"""The coordinator's triggers: the :class:`~profd.actors.trigger_book.TriggerBook` fed with
live times and out-of-memory events, and the sessions its firings start.

A firing targets the offending rank and one healthy peer of its role, for the trigger's
``next_steps``: for a straggler the rank whose stage ended closest to the median in the
step judged; otherwise the alive rank whose own rolling median of the watched mark (the
step, for ``oom``) is closest to the role's baseline, leaving out ranks that ran out of
memory within the hour (the lowest rank on a tie, or when no rank has times). A live
session holding those ranks makes the firing wait (retried by each tick and each new times
event) rather than fail. An agent's durations while it is profiled, and for a few seconds
after, are not held against its role, nor is it called a straggler then: they carry the
profiler's own cost. Triggers are kept in the coordinator's store: a restarted coordinator
watches the same ones (their firings and counts start again).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from profd.actors.trigger_book import Firing, Trigger, TriggerBook
from profd.actors.trigger_reports import AGENT, Report, RoleSpans, report
from profd.actors.trigger_saved import restore_triggers, saved_trigger
from profd.core.errors import ConflictError, NotFoundError, ProfdError
from profd.core.protocol import AgentEvent, AgentInfo, MarkDurations, OutOfMemory
from profd.core.trigger_request import TriggerKind, TriggerRequest
from profd.core.views import FiringView, TriggerView

if TYPE_CHECKING:
    from profd.actors.admission import Admission
    from profd.actors.mark_stats import MarkStats
    from profd.actors.planbook import PlanBook
    from profd.actors.registry import AgentRecord, AgentRegistry
    from profd.actors.sessions import Session
    from profd.actors.store import Store
    from profd.actors.trace_index import TraceIndex
    from profd.actors.trigger_evidence import Evidence

__all__ = ["TriggerDesk"]

log = logging.getLogger(__name__)

#: After a session, an agent's durations are left out this long: its last profiled step
#: (the profiler's stop and export) reaches the coordinator up to a report later.
PROFILED_GRACE_S = 3.0
#: A rank that ran out of memory is not anyone's healthy peer for this long.
OOM_UNHEALTHY_S = 3600.0
#: Agents' durations arriving within this long of each other are judged in one pass: a
#: trigger reads its role's history and spans once a pass, not once a report (a fleet's
#: agents each report about once a second; reading the role per report is O(ranks^2)).
OBSERVE_COALESCE_S = 0.1


class TriggerDesk:
    def __init__(
        self,
        registry: AgentRegistry,
        times: MarkStats,
        traces: TraceIndex,
        admission: Admission,
        clock: Callable[[], float],
        recent: Callable[[float], Iterable[Session]] = lambda since: (),
        plans: PlanBook | None = None,
        store: Store | None = None,
    ) -> None:
        self._registry = registry
        self._plans = plans
        self._store = store
        self._times = times
        self._traces = traces
        self._admission = admission
        self._clock = clock
        #: Sessions live, or ended at or after the time given.
        self._recent = recent
        self._profiled_at: dict[str, float] = {}  # agent id -> last seen in a live session
        self._oom_at: dict[str, float] = {}  # agent id -> its last out-of-memory error
        self.book = TriggerBook(clock)
        self._sessions: dict[str, list[str]] = {}  # trigger id -> the sessions it started
        self._firing: asyncio.Task | None = None
        self.firings_total = 0
        #: Reports waiting for the next pass, flat (``trigger_reports.report``).
        self._unjudged: list[Report] = []
        self._pass: asyncio.TimerHandle | None = None
        self.passes = 0
        #: A restored coordinator's agents come back within this (wall clock): a due firing
        #: whose rank is not back yet waits for it until then, rather than fail.
        self._returning_until = 0.0

    # -- the API -------------------------------------------------------------------------
    def add(self, request: TriggerRequest | dict) -> TriggerView:
        """A new trigger; its name must be free (a file re-posted finds its triggers by
        name: two of one name would be changed or deleted at random)."""
        request = self._checked(request, None)
        t = self.book.add(request)
        self._sessions[t.trigger_id] = []
        log.info("trigger %s (%s) added: %s", t.trigger_id, request.name, request.when)
        self._save(t)
        return self.view(t)

    def replace(self, trigger_id: str, request: TriggerRequest | dict) -> TriggerView:
        """Trigger ``trigger_id`` watches ``request`` instead, at once and under the same id
        (``PUT``): never a moment with neither, nor with both."""
        self.get(trigger_id)  # 404 before any other complaint
        t = self.book.replace(trigger_id, self._checked(request, trigger_id))
        log.info("trigger %s (%s) replaced: %s", trigger_id, t.request.name, t.request.when)
        self._save(t)
        return self.view(t)

    def _checked(self, request: TriggerRequest | dict, trigger_id: str | None) -> TriggerRequest:
        if not isinstance(request, TriggerRequest):
            request = TriggerRequest.model_validate(request)
        same = self.book.named(request.name)
        if same is not None and same.trigger_id != trigger_id:
            raise ConflictError(
                f"name: a trigger named {request.name!r} exists ({same.trigger_id}); "
                f"PUT /api/v1/triggers/{same.trigger_id} replaces it",
                trigger_id=same.trigger_id,
            )
        return request

    def _save(self, t: Trigger) -> None:
        self._persist(t)
        self._sync_spans()

    def _persist(self, t: Trigger) -> None:
        if self._store is not None:  # a restarted coordinator watches it again
            self._store.save_trigger(t.trigger_id, saved_trigger(t))

    def restore(
        self,
        saved: Iterable[dict[str, Any]],
        sessions: Iterable[Session] = (),
        return_within_s: float = 0.0,
    ) -> int:
        """The triggers a previous incarnation persisted; the number restored. A row this
        version cannot read is skipped. ``sessions``: the restored sessions; those a trigger
        started are its firings again (cooldown, the hourly cap and the disk budget count
        them); only its suppressed counts start again from zero. A firing that was due is
        due again (unless its session was made: then it fired), and waits up to
        ``return_within_s`` for its rank's agent to come back."""
        restored = restore_triggers(self.book, saved, sessions, self._clock())
        self._sessions.update(restored)
        self._returning_until = self._clock() + return_within_s
        self._sync_spans()
        return len(restored)

    def remove(self, trigger_id: str) -> TriggerView:
        try:
            t = self.book.remove(trigger_id)
        except KeyError:
            raise NotFoundError(f"no trigger {trigger_id!r}", trigger_id=trigger_id) from None
        self._sessions.pop(trigger_id, None)
        if self._store is not None:
            self._store.save_trigger(trigger_id, None)
        self._sync_spans()
        return self.view(t)

    # -- span mode -----------------------------------------------------------------------
    def _span_roles(self) -> set[str]:
        """The roles a straggler trigger watches: their agents' marks keep end times."""
        return {
            t.request.when.role
            for t in self.book.all()
            if t.request.when.kind is TriggerKind.STRAGGLER
        }

    def _sync_spans(self) -> None:
        if self._plans is None:
            return
        roles = self._span_roles()
        for rec in self._registry.all():
            self._plans.set_spans(rec.info.agent_id, rec.info.role in roles)

    def adopt(self, info: AgentInfo) -> None:
        """A new (or re-registered) agent: span mode if a straggler trigger watches its role."""
        if self._plans is not None:
            self._plans.set_spans(info.agent_id, info.role in self._span_roles())

    def get(self, trigger_id: str) -> TriggerView:
        try:
            return self.view(self.book.get(trigger_id))
        except KeyError:
            raise NotFoundError(f"no trigger {trigger_id!r}", trigger_id=trigger_id) from None

    def views(self) -> list[TriggerView]:
        return [self.view(t) for t in self.book.all()]

    def view(self, t: Trigger) -> TriggerView:
        return TriggerView(
            trigger_id=t.trigger_id,
            name=t.request.name,
            request=t.request.model_dump(mode="json"),
            created_at=t.created_at,
            fired=t.fired,
            suppressed={k.value: v for k, v in t.suppressed.items()},
            disk_bytes=t.disk_bytes,
            firings=[_firing_view(f) for f in reversed(t.firings)],
            idle_reason=self._idle_reason(t),
        )

    def _idle_reason(self, t: Trigger) -> str | None:
        """Why ``t`` cannot judge anything now (see ``TriggerView.idle_reason``)."""
        cond = t.request.when
        agents = [r.info.agent_id for r in self._registry.alive() if r.info.role == cond.role]
        if not agents:
            return f"no alive agent of role {cond.role!r}"
        if cond.kind is TriggerKind.OOM:
            return None
        steps, stages = False, set()
        for aid in agents:
            has_step, labels = self._times.marks(aid)
            steps |= has_step
            stages.update(labels)
        if not steps and not stages:
            return None  # no times yet: nothing to say the watched mark is wrong
        if cond.mark is None:
            return None if steps else (
                f"no agent of role {cond.role!r} marks steps (a worker following its driver "
                f"marks none; its stages: {', '.join(sorted(stages))})"
            )  # fmt: skip
        if cond.mark in stages:
            return None
        timed = ", ".join(sorted(stages)) or "none"
        return f"no agent of role {cond.role!r} times stage {cond.mark!r} (its stages: {timed})"

    def counts(self) -> dict[str, dict[str, int]]:
        """Per trigger name: sessions started and conditions suppressed (for /metrics)."""
        return {
            t.request.name: {"fired": t.fired, **{k.value: v for k, v in t.suppressed.items()}}
            for t in self.book.all()
        }

    # -- evaluation ----------------------------------------------------------------------
    def on_oom(self, agent_id: str, event: AgentEvent) -> None:
        """An agent's mark saw a CUDA out-of-memory error (an ``oom`` event)."""
        oom = event.payload
        log.warning("agent %s: out of memory: %s", agent_id, event.message)
        rec = self._registry.get(agent_id)
        if rec is None or not isinstance(oom, OutOfMemory):
            return
        now = self._clock()
        self._oom_at = {a: at for a, at in self._oom_at.items() if now - at < OOM_UNHEALTHY_S}
        self._oom_at[agent_id] = now
        if not len(self.book):
            return
        self._count_disk()
        info = rec.info
        firings = self.book.out_of_memory(
            agent_id, info.role, info.rank, oom, event.step, info.job_id
        )
        self._due(firings)

    def on_times(self, agent_id: str, times: MarkDurations, step: int | None = None) -> None:
        """New durations of one agent (already in the rolling windows); ``step``: the step
        it marked last when it sent them. Judged in the next pass, :data:`OBSERVE_COALESCE_S`
        later (at once without a running loop: a plain call in a test)."""
        if not len(self.book):
            return
        rec = self._registry.get(agent_id)
        if rec is not None:  # the report flat, not the report itself: see trigger_reports
            self._unjudged.append(report(agent_id, rec.info.role, rec.info.rank, times, step))
        if self._pass is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.judge_pending()
            return
        self._pass = loop.call_later(OBSERVE_COALESCE_S, self.judge_pending)

    def close(self) -> None:
        """Stop judging: a pass still waiting is cancelled and its reports dropped (the
        coordinator is closing; a pass run later would judge against a closed store)."""
        if self._pass is not None:
            self._pass.cancel()
            self._pass = None
        self._unjudged = []

    def judge_pending(self) -> None:
        """One pass over the durations that arrived since the last: each trigger reads its
        role once (history, spans, who is profiled), then every report is judged."""
        self._pass = None
        pending, self._unjudged = self._unjudged, []
        if not pending or not len(self.book):
            return
        self.passes += 1
        self._count_disk()
        profiled = self._profiling_now()
        by_job: dict[str | None, list[Report]] = {}
        for r in pending:  # each reporting agent's grace is kept, whatever its triggers read
            profiled(r[AGENT])
            rec = self._registry.get(r[AGENT])
            by_job.setdefault(rec.info.job_id if rec is not None else None, []).append(r)
        firings = []
        for job, reports in by_job.items():  # two jobs' ranks are never one population
            history = functools.partial(self._history, job=job)
            spans = functools.partial(self._spans, job=job)
            firings += self.book.observe_pass(reports, history, spans, profiled, job=job)
        self._due(firings)

    def _due(self, firings: list[Firing]) -> None:
        """New due firings: kept (a restarted coordinator starts them), then started."""
        for f in firings:
            self._persist(self.book.get(f.trigger_id))
        if firings:
            self.fire_soon()

    def _count_disk(self) -> None:
        for t in self.book.all():
            t.disk_bytes = sum(
                tr.bytes for sid in self._sessions.get(t.trigger_id, ()) for tr in
                self._traces.of_session(sid)
            )  # fmt: skip

    def _profiling_now(self) -> Callable[[str], bool]:
        """Whether an agent's durations carry a profiler's cost now: it is in a live
        session, or was within :data:`PROFILED_GRACE_S` (the last step's stop and export,
        shipped late). The sessions are listed once (a pass asks for every agent)."""
        now = self._clock()
        sessions = list(self._recent(now - PROFILED_GRACE_S))
        return functools.cache(lambda agent_id: self._profiling(agent_id, sessions, now))

    def _profiling(self, agent_id: str, sessions: list[Session], now: float) -> bool:
        """The grace runs from the later of the session's end and the agent's last report
        while it was live: a rank whose window's stop held its loop (and so its reports of
        durations) for seconds is still spared the steps right after its session ended."""
        ended = 0.0
        for s in sessions:
            if agent_id not in s.targets:
                continue
            if s.is_live:
                self._profiled_at[agent_id] = now
                return True
            ended = max(ended, s.finished_at or 0.0)
        at = max(self._profiled_at.get(agent_id, 0.0), ended)
        if now - at > PROFILED_GRACE_S:
            self._profiled_at.pop(agent_id, None)
            return False
        return True

    def _oomed(self, agent_id: str, now: float) -> bool:
        at = self._oom_at.get(agent_id)
        return at is not None and now - at < OOM_UNHEALTHY_S

    def _spans(self, role: str, stage: str, *, job: str | None) -> RoleSpans:
        """The role's ranks (of Ray job ``job``) that mark ``stage``, with its span per
        step: a rank whose spans have not come yet (span mode just began there) is listed
        with none, so no step is judged without it."""
        agents: dict[int, str] = {}
        spans: dict[int, dict[int, Any]] = {}
        for rec in self._registry.alive():
            if rec.info.role == role and rec.info.job_id == job:
                aid = rec.info.agent_id
                steps = self._times.spans(aid, stage)
                if steps or self._times.times_stage(aid, stage):
                    agents[rec.info.rank], spans[rec.info.rank] = aid, steps
        return RoleSpans(agents, spans)

    def _history(
        self, role: str, mark: str | None, n: int, *, job: str | None
    ) -> dict[int, Sequence[float]]:
        """Each rank's window (ranks of the role in Ray job ``job``) itself, read only (its
        newest ``n`` are the tail): a pass over a fleet copies none of them."""
        out = {}
        for rec in self._registry.alive():
            if rec.info.role == role and rec.info.job_id == job:
                values = self._times.window(rec.info.agent_id, mark)
                if values:
                    out[rec.info.rank] = values
        return out

    def fire_soon(self) -> None:
        """Start the sessions of due firings on the running loop (one pass at a time)."""
        if not self.book.due() or (self._firing is not None and not self._firing.done()):
            return
        try:
            self._firing = asyncio.get_running_loop().create_task(self.fire_due())
        except RuntimeError:  # no loop (a plain call in a test): the next tick fires them
            pass

    async def fire_due(self) -> None:
        for firing in self.book.due():
            t = self._trigger_of(firing)  # (the awaits below let a PUT or DELETE in)
            if t is None or t.due is not firing or self._not_back(firing):
                continue
            ranks = self._ranks(firing, t)
            job = firing.evidence.job_id
            origin = {
                "trigger_id": t.trigger_id,
                "firing_id": firing.firing_id,
                "at": firing.at,
                "evidence": firing.evidence.as_dict(),
            }
            try:
                s = await self._admission.admit(t.request.session_for(ranks, job), origin)
            except ConflictError:
                continue  # a live session holds the ranks: stays due, the next tick retries
            except (ProfdError, ValueError) as exc:
                if (t := self._trigger_of(firing)) is not None:
                    self.book.failed(firing, str(exc))
                    self._persist(t)
                continue
            self._sessions.setdefault(firing.trigger_id, []).append(s.session_id)
            self.firings_total += 1
            if (t := self._trigger_of(firing)) is not None:  # deleted meanwhile: its session
                self.book.fired(firing, s.session_id)  # runs, and names it (origin)
                self._persist(t)  # the trigger as it is now, no longer due
            ev = firing.evidence
            log.info(
                "trigger %s fired: %s rank %d %s %.3f s against %.3f s; session %s on ranks %s",
                firing.trigger_id, ev.role, ev.rank, ev.mark, ev.observed_s, ev.baseline_s,
                s.session_id, list(ranks),
            )  # fmt: skip

    def _trigger_of(self, firing: Firing) -> Trigger | None:
        try:
            return self.book.get(firing.trigger_id)
        except KeyError:
            return None

    def _not_back(self, firing: Firing) -> bool:
        """A restored firing whose rank's agent, or every peer of its role, has not come
        back yet (agents register again after a coordinator restart): it waits, up to the
        restart's grace, rather than fail or start without a healthy peer."""
        if self._clock() >= self._returning_until:
            return False
        ev = firing.evidence
        return self._registry.get(ev.agent_id) is None or not self._peers(ev)

    def _peers(self, ev: Evidence) -> list[AgentRecord]:
        """The offending rank's alive peers: its role's other ranks, in its Ray job."""
        return [
            r
            for r in self._registry.alive()
            if r.info.role == ev.role and r.info.rank != ev.rank and r.info.job_id == ev.job_id
        ]

    def _ranks(self, firing: Firing, t: Trigger) -> tuple[int, ...]:
        """The offending rank, and the healthy peer: the one the condition chose
        (straggler), else the one closest to the baseline."""
        ev, cond = firing.evidence, t.request.when
        alive = self._peers(ev)
        if ev.peer_rank is not None and any(r.info.rank == ev.peer_rank for r in alive):
            return ev.rank, ev.peer_rank
        now = self._clock()
        alive = [r for r in alive if not self._oomed(r.info.agent_id, now)]
        durations = cond.kind in (TriggerKind.STEP_TIME, TriggerKind.STAGE_TIME)
        mark = cond.mark if durations else None  # oom, straggler: their step times
        medians = []
        for rec in alive:
            values = self._times.recent(rec.info.agent_id, mark, cond.baseline_steps)
            if values:
                medians.append((sorted(values)[len(values) // 2], rec.info.rank))
        if not medians:  # no times (or none yet): the lowest rank
            return (ev.rank, min(r.info.rank for r in alive)) if alive else (ev.rank,)
        # the role's baseline; without one (oom, straggler), the middle of the peers
        baseline = ev.baseline_s if durations else sorted(medians)[len(medians) // 2][0]
        return ev.rank, min((abs(m - baseline), r) for m, r in medians)[1]


def _firing_view(f: Firing) -> FiringView:
    return FiringView(
        firing_id=f.firing_id, at=f.at, state=f.state.value, session_id=f.session_id,
        error=f.error, evidence=f.evidence.as_dict(),
    )  # fmt: skip
