"""The ProfileCoordinator: the RPC surface of the coordinator, as a plain (async) class.

``ray.remote`` is applied where the actor is created
(:func:`profd.actors.get_or_create_coordinator`), so tests run the same class in-process.
Nothing here is on a training path: agents reach it only from their background threads.

The class is a facade over delegates that each own their state:

* :class:`~profd.actors.agent_desk.AgentDesk` — registration, long-polls, reports;
* :class:`~profd.actors.session_book.SessionBook` — sessions, persistence, plans;
* :class:`~profd.actors.admission.Admission` — admitting sessions and late agents;
* :class:`~profd.actors.alignment.Alignment` — where a new window falls;
* :class:`~profd.actors.drivers.DriverTable` — single-controller drivers' steps and phases;
* :class:`~profd.actors.trace_index.TraceIndex` — the traces agents wrote.

It keeps the housekeeping loop (:meth:`ProfileCoordinator.start`, :meth:`tick`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from profd.actors.admission import Admission
from profd.actors.agent_desk import AgentDesk, Registration
from profd.actors.alignment import Alignment
from profd.actors.drivers import DriverTable
from profd.actors.liveness import Periodic, find_gone
from profd.actors.mark_stats import MarkStats, placed
from profd.actors.planbook import PlanBook
from profd.actors.registry import AgentRegistry
from profd.actors.relay_desk import RelayDesk
from profd.actors.reporting import metrics_snapshot
from profd.actors.runner import NodeRunner, default_runner
from profd.actors.session_book import SessionBook
from profd.actors.stack_desk import StackDesk
from profd.actors.store import Store, open_store
from profd.actors.trace_index import TraceIndex
from profd.actors.triggers import TriggerDesk
from profd.core.constants import __version__
from profd.core.errors import ProfdError, RequestInvalid
from profd.core.heap import collect_young_every, trim_heap
from profd.core.json_body import BATCHED_READS, JSON_READS, JsonItems, encode_read
from profd.core.paging import Page
from profd.core.protocol import AgentEvent, AgentInfo, DriverAck, MarkDurations, PollReply
from profd.core.ray_env import current_address
from profd.core.request import SessionRequest
from profd.core.settings import CoordinatorSettings
from profd.core.stacks import StackQuery
from profd.core.states import AgentState
from profd.core.trigger_request import TriggerRequest
from profd.core.views import (
    AgentView,
    SessionView,
    StacksView,
    StatusView,
    TraceView,
    TriggerView,
)

__all__ = ["ProfileCoordinator", "Registration"]

log = logging.getLogger(__name__)

_C = TypeVar("_C", bound=type)

#: How often the coordinator gives freed heap back to the OS (profd.core.heap): a burst of
#: registrations or events leaves its resident size at the burst's peak otherwise (a trim
#: costs well under a millisecond: measured 0.15 ms on a 580 MB heap).
HEAP_TRIM_S = 10.0


async def _trim_heap() -> None:
    """Off the event loop: the C library holds its allocator locks while it trims."""
    await asyncio.to_thread(trim_heap)


def _started_first(cls: _C) -> _C:
    """Make every public RPC of ``cls`` start the coordinator first, if it is not started.

    The creation points call :meth:`ProfileCoordinator.start`; this one guard covers the
    coordinator Ray restarts after its process died (Ray runs ``__init__`` again, nothing
    else) and callers that construct the class themselves. Signatures are kept (Ray reads
    them through ``functools.wraps``)."""

    def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        async def rpc(self: ProfileCoordinator, *args: Any, **kwargs: Any) -> Any:
            if not self.started:
                await self.start()
            return await fn(self, *args, **kwargs)

        return rpc

    for name, fn in list(vars(cls).items()):
        if not name.startswith("_") and name != "start" and inspect.iscoroutinefunction(fn):
            setattr(cls, name, guarded(fn))
    return cls


@_started_first
class ProfileCoordinator:
    """Owns agents, sessions and the trace index; computes each agent's plan."""

    def __init__(
        self,
        settings: CoordinatorSettings | dict,
        clock: Callable[[], float] = time.time,
        *,
        store: Store | None = None,
        runner: NodeRunner | None = None,
    ) -> None:
        if isinstance(settings, dict):
            settings = CoordinatorSettings.model_validate(settings)
        if settings.gc_young_objects:  # only in a process of its own (a setting of the actor)
            collect_young_every(settings.gc_young_objects)
        self.settings = settings
        self._clock = clock
        self._started = clock()
        self._store = store if store is not None else open_store(settings.state_dir)
        self._runner = runner or default_runner()
        #: Where jobs must connect for their agents to register here (``profd status``).
        self._ray_address = current_address()
        self._wire(settings, clock)
        self._liveness = Periodic(settings.liveness_check_s, self._reap, clock)
        self._heap = Periodic(HEAP_TRIM_S, _trim_heap, clock)
        self._ticker: asyncio.Task | None = None
        self._restore()

    def _wire(self, settings: CoordinatorSettings, clock: Callable[[], float]) -> None:
        """The delegates, each handed the others it calls."""
        self._registry = AgentRegistry()
        self._plans = PlanBook()
        self._traces = TraceIndex(self._store)
        self._times = MarkStats()
        self._book = SessionBook(
            settings, clock, self._registry, self._plans, self._store, self._traces, self._runner
        )
        self._drivers = DriverTable(
            clock, settings.heartbeat_timeout_s, self._registry, self._plans, self._book.live
        )
        self._alignment = Alignment(
            settings,
            self._registry,
            self._plans,
            self._drivers,
            self._times.step_period,
            clock,
            self._times.step_age,
        )
        self._admission = Admission(self._registry, self._book, self._alignment, self._drivers)
        self._triggers = TriggerDesk(
            self._registry,
            self._times,
            self._traces,
            self._admission,
            clock,
            self._book.live_or_ended_since,
            self._plans,
            self._store,
        )
        self._stacks = StackDesk(self._registry, self._plans, self._runner, settings, clock)
        self._relays = RelayDesk(
            self._plans,
            lambda aid: self._registry.get(aid) is not None,
            forward_min=settings.relay_forward_min,
        )
        self._agents = AgentDesk(
            relays=self._relays,
            poll_timeout_s=settings.poll_timeout_s,
            clock=clock,
            registry=self._registry,
            plans=self._plans,
            book=self._book,
            traces=self._traces,
            times=self._times,
            on_register=self._adopt,
            on_fresh_step=self._alignment.note_fresh_step,
            on_events=self._drivers.progressed,
            on_times=self._on_times,
            on_stack=self._stacks.on_sample,
            on_oom=self._triggers.on_oom,
            place_spans=self._place_spans,
        )

    def _on_times(self, agent_id: str, times: MarkDurations, step: int | None) -> None:
        """New live times for the triggers, with the job's step: a worker that follows its
        driver marks no step of its own, and then its driver's step is the evidence's."""
        if step is None and (rec := self._registry.get(agent_id)) is not None:
            step = rec.step(self._drivers.driver_step(rec.info.job_id))
        self._triggers.on_times(agent_id, times, step)

    def _adopt(self, info: AgentInfo) -> None:
        """A new agent: launch-time sessions take it, a straggler trigger's role times its
        mark ends."""
        self._triggers.adopt(info)
        self._admission.adopt(info)

    def _restore(self) -> None:
        """Pick up sessions and the trace index a previous incarnation persisted."""
        saved = self._store.load()
        n_traces = self._traces.restore(saved["traces"])
        n_live = self._book.restore(saved["sessions"])
        n_triggers = self._triggers.restore(
            saved.get("triggers", ()), self._book.all(), self.settings.heartbeat_timeout_s
        )
        if n_triggers:
            log.info("coordinator restored %d trigger(s)", n_triggers)
        if saved["sessions"]:
            log.info(
                "coordinator restored %d session(s), %d trace(s); %d live",
                len(saved["sessions"]),
                n_traces,
                n_live,
            )

    # -- housekeeping --------------------------------------------------------------------
    @property
    def started(self) -> bool:
        """Whether the housekeeping loop runs (on the loop serving the RPCs)."""
        return self._ticker is not None and not self._ticker.done()

    async def start(self) -> None:
        """Start housekeeping on the running loop: the tick loop (heartbeats, deadlines,
        liveness checks) and what restored sessions had pending (uploads). Idempotent; a
        loop that ended (its event loop closed) is started again."""
        if self.started:
            return
        self._ticker = asyncio.get_running_loop().create_task(self._tick_loop())
        self._book.resume()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.tick_s)
            try:
                self.tick()
                self._liveness.kick(self._clock())
                self._heap.kick(self._clock())
            except Exception:
                log.exception("coordinator tick failed")

    def tick(self) -> None:
        """Housekeeping: lose silent agents, expire sessions past their deadline."""
        now = self._clock()
        silence = self.settings.heartbeat_timeout_s
        for rec in self._registry.expire(now, silence):
            self._book.lose(rec.info.agent_id, f"no heartbeat for {silence:.0f} s")
        if now - self._started > silence:
            self._book.lose_unreturned()
        self._book.advance_live()
        self._times.retain(self._alive)  # step times of agents gone or closed go too
        self._triggers.fire_soon()  # firings that waited for busy ranks try again

    async def _reap(self) -> None:
        """Lose the agents whose process or node Ray says is gone (see actors/liveness)."""
        gone = await find_gone(self._registry.unconfirmed(), self._runner)
        for g in gone:
            if self._registry.lose(g.agent_id) is not None:
                self._book.lose(g.agent_id, g.reason)
        if gone:
            self._book.advance_live()

    # -- sessions ------------------------------------------------------------------------
    async def create_session(self, request: dict | SessionRequest) -> SessionView:
        return self._book.view(await self._admission.admit(request))

    async def get_session(self, session_id: str) -> SessionView:
        return self._book.view(self._book.get(session_id))

    async def list_sessions(
        self, limit: int | None = None, cursor: str | None = None
    ) -> list[SessionView] | Page:
        """Without ``limit`` and ``cursor``: every session, oldest first (a list). With
        either: one :class:`~profd.core.paging.Page` of ``limit`` sessions (default 50), newest
        first (created_at, then session id, descending), after ``cursor`` (the previous
        page's ``next_cursor``); only the page's sessions are turned into views."""
        return self._book.views(limit, cursor)

    async def cancel_session(
        self, session_id: str, reason: str = "cancelled by user"
    ) -> SessionView:
        return self._book.view(self._book.cancel(session_id, reason))

    # -- triggers ------------------------------------------------------------------------
    async def add_trigger(self, request: dict | TriggerRequest) -> TriggerView:
        return self._triggers.add(request)

    async def replace_trigger(self, trigger_id: str, request: dict | TriggerRequest) -> TriggerView:
        return self._triggers.replace(trigger_id, request)

    async def list_triggers(self) -> list[TriggerView]:
        """Every trigger, newest first."""
        return self._triggers.views()

    async def get_trigger(self, trigger_id: str) -> TriggerView:
        return self._triggers.get(trigger_id)

    async def delete_trigger(self, trigger_id: str) -> TriggerView:
        return self._triggers.remove(trigger_id)

    # -- agents --------------------------------------------------------------------------
    async def register(self, info: AgentInfo, step: int | None) -> Registration:
        return await self._agents.register(info, step)

    async def poll(
        self, agent_id: str, known_version: int, step: int | None, timeout: float
    ) -> PollReply:
        return await self._agents.poll(agent_id, known_version, step, timeout)

    async def poll_many(
        self,
        known: dict[str, int],
        steps: dict[str, int | None],
        timeout: float,
        via: str | None = None,
    ) -> dict[str, PollReply]:
        """One long-poll for many agents: a node's relay (``via``: its name; see
        :mod:`profd.actors.relay`) or every agent of a process (:mod:`profd.agent.multiplex`).
        The replies of the agents whose plan changed (or who must register again)."""
        return await self._agents.poll_many(known, steps, timeout, via)

    async def relay_sync(
        self,
        via: str,
        known: dict[str, int],
        steps: dict[str, int | None],
        target: Any = None,
        key: str = "",
    ) -> dict[str, PollReply]:
        """A node relay that takes pushed plans (:mod:`profd.actors.relay_desk`): its agents'
        versions and steps (they are alive), answered at once with the plans that differ.
        ``target`` (an actor handle with ``push(key, replies, refresh)``) is called from
        then on whenever their plans change."""
        return await self._agents.relay_sync(via, known, steps, target, key)

    async def relay_resync(
        self, via: str, known: dict[str, int], steps: dict[str, int | None]
    ) -> dict[str, PollReply] | None:
        """:meth:`relay_sync` of a relay whose handle the coordinator already holds (the
        handle is not sent again); ``None`` when it holds none (never synced, forgotten
        after a failed push, or a restarted coordinator): sync again with the handle."""
        return await self._agents.relay_resync(via, known, steps)

    async def report(self, agent_id: str, events: list[AgentEvent]) -> bool:
        return await self._agents.report(agent_id, events)

    async def report_many(self, batches: dict[str, list[AgentEvent]]) -> dict[str, bool]:
        """A relay's batch: each agent's events, applied as :meth:`report` does; whether
        each agent is known."""
        return await self._agents.report_many(batches)

    async def list_agents(self) -> list[AgentView]:
        now = self._clock()
        recs = sorted(self._registry.all(), key=lambda r: (r.info.role, r.info.rank))
        return [
            r.view(
                now, self._drivers.driver_step(r.info.job_id), self._times.views(r.info.agent_id)
            )
            for r in recs
        ]

    async def stacks(self, query: dict | StackQuery | None = None) -> StacksView:
        """Where every matching live agent's training thread is now, grouped by stack (see
        :mod:`profd.actors.stack_desk`); no session or step mark needed."""
        if not isinstance(query, StackQuery):
            query = StackQuery.parse(**(query or {}))
        return await self._stacks.collect(query)

    def _alive(self, agent_id: str) -> bool:
        rec = self._registry.get(agent_id)
        return rec is not None and rec.state is AgentState.ALIVE

    def _role_rank(self, agent_id: str) -> tuple[str, int] | None:
        rec = self._registry.get(agent_id)
        return (rec.info.role, rec.info.rank) if rec is not None else None

    # -- drivers -------------------------------------------------------------------------
    async def controller_step(
        self, step: int, timeout: float = 10.0, job_id: str | None = None
    ) -> DriverAck:
        """A driver starts step ``step``: every agent of a live session learns it before this
        returns (or ``timeout`` passes; the slow agents are named). Cheap when nothing is
        being profiled: no agent is contacted. Rollout agents also handle ``step_begin``
        (replicas on their own devices start their engine's profiler) before this returns."""
        return await self._drivers.step(step, timeout, job_id)

    async def controller_phase(
        self, step: int, phase: str, timeout: float = 600.0, job_id: str | None = None
    ) -> DriverAck:
        """A driver reached ``phase`` of ``step`` (``rollout_begin`` / ``rollout_end`` /
        ``step_end``): rollout agents start or stop their engines and confirm before this
        returns — so a colocated engine is stopped before training stages run."""
        return await self._drivers.phase(step, phase, timeout, job_id)

    def latest_driver(self) -> tuple[int, float] | None:
        """(step, seconds since) of the driver heard from last, while it announces."""
        return self._drivers.latest()

    # -- traces --------------------------------------------------------------------------
    async def get_trace(self, trace_id: str) -> TraceView:
        return self._traces.get(trace_id)

    async def list_traces(
        self,
        session_id: str | None = None,
        role: str | None = None,
        rank: int | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> list[TraceView] | Page:
        """Traces matching the filters. Without ``limit`` and ``cursor``: all of them by
        session, role, rank and step (a list). With either: one :class:`~profd.core.paging.Page`
        of ``limit`` traces (default 50), newest first (created_at, then trace id,
        descending), after ``cursor``; its ``total`` and ``bytes`` count every match."""
        return self._traces.find(session_id, role, rank, limit, cursor)

    # -- the service ---------------------------------------------------------------------
    async def status(self) -> StatusView:
        driver = self._drivers.latest()
        return StatusView(
            version=__version__,
            agents=len(self._registry.alive()),
            agents_by_role=self._registry.counts_by_role(),
            sessions_by_state=self._book.counts_by_state(),
            live_sessions=[s.session_id for s in self._book.live()],
            traces=len(self._traces),
            trace_bytes=self._traces.total_bytes,
            save_root=self.settings.save_root,
            uptime_s=round(self._clock() - self._started, 3),
            state_write_failures=self._store.failed_writes,
            state_last_error=self._store.last_error,
            driver_step=driver[0] if driver else None,
            driver_seen_s=driver[1] if driver else None,
            driver_steps={j or "none": s for j, (s, _) in self._drivers.fresh().items()},
            ray_address=self._ray_address,
        )

    async def metrics(self) -> dict[str, Any]:
        return metrics_snapshot(
            self._registry,
            self._book.all(),
            self._traces.written(),
            self._traces.stalls(),
            events=self._agents.events,
            reports=self._agents.reports,
            duplicate_events=self._agents.duplicate_events,
            rejected_events=self._agents.rejected_events,
            uptime_s=self._clock() - self._started,
            mark_times=self._times.metric_rows(self._role_rank),
            triggers=self._triggers.counts(),
        )

    async def read_json(self, method: str, *args: Any) -> bytes | JsonItems:
        """A read of :data:`~profd.core.json_body.JSON_READS`, encoded to JSON here (the
        sidecar's read routes pass it through; see :mod:`profd.core.json_body`)."""
        if method not in JSON_READS:
            raise RequestInvalid.at("method", f"not a JSON read: {method!r}")
        # Views that do not change are encoded once (finished sessions, traces).
        if method == "get_session":
            return self._book.view_json(self._book.get(*args))
        if method == "list_sessions":
            return self._book.views_json(*args)
        if method == "list_traces":
            return self._traces.find_json(*args)
        return encode_read(await getattr(self, method)(*args))

    async def read_many(self, reads: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """Several of the sidecar's reads in one call (:data:`BATCHED_READS`; see
        :class:`profd.api.client.BatchedReads`): each answer in order, or the error it raised
        (the coordinator's own, as :meth:`read_json` raises them; any other as a
        ``RuntimeError`` naming it)."""
        out: list[Any] = []
        for i, (method, args) in enumerate(reads):
            if i:
                await asyncio.sleep(0)  # agents' polls and reports between two reads
            try:
                if method not in BATCHED_READS:
                    raise RequestInvalid.at("method", f"not a batched read: {method!r}")
                out.append(await getattr(self, method)(*args))
            except ProfdError as exc:
                out.append(exc)
            except Exception as exc:  # one read's fault fails that read, not its batch
                log.exception("read_many: %s failed", method)
                out.append(RuntimeError(f"{method}: {type(exc).__name__}: {exc}"))
        return out

    async def ping(self) -> str:
        return __version__

    async def clock_ns(self) -> int:
        """This process's wall clock: agents measure their offset to it (one clock for all
        nodes' traces)."""
        return time.time_ns()

    async def pid(self) -> int:
        return os.getpid()

    async def flush_state(self, timeout_s: float = 10.0) -> bool:
        """Write what the store still has queued; ``False`` if some rows were not written
        within ``timeout_s``. ``profd down`` asks this before it stops the coordinator (a
        killed actor never runs ``close()``)."""
        return await asyncio.to_thread(self._store.flush, timeout_s)

    def _place_spans(self, times: MarkDurations, job_id: str | None) -> MarkDurations:
        """A driver-following worker's stage samples placed in its job's driver steps."""
        return placed(times, functools.partial(self._drivers.step_at, job_id))

    def close(self) -> None:
        """Release the state directory (a coordinator in a process that lives on, once its
        loop is stopped)."""
        self._triggers.close()
        self._store.close()
