"""Turning step / stage / mini-batch marks into collections, on the training thread.

The recorder owns one :class:`WindowState` per session in the agent's plan. At each step
boundary it opens, continues or closes collections; finished windows go to the exporter
thread. Every planned step ends *recorded* (a file holds it) or *missed* (with the reason);
when all are resolved and every file is written the agent reports ``part_done``.

Modes (reference §5):

* continuous (``discrete: false``): one collection per step group, scope ``train``; each
  step is a ``step<n>`` range and stages are ranges inside it. A torch schedule counts the
  group's update mini-batches, with ``repeat`` 0 read as 1;
* discrete (``discrete: true``): no collection per step; each stage inside a profiled step
  opens its own collection whose scope is the stage label. Only ``update_loop`` stages use
  the schedule (verbatim) and name their windows by mini-batch (``_mb3-4``).

Every collection has a :class:`Ticket` that follows its files through the exporter, so a
step counts as recorded only once a file holding it is on disk.

Any failure in here is caught, logged once and reported; the window is then given up and the
training loop goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from profd.agent.clock_sync import ClockEstimate
from profd.agent.export import Exporter, ExportJob, trace_event
from profd.agent.scopes import ContinuousScope, DiscreteScope, Scope, TimedScope, mark_partial
from profd.agent.specs import build_spec
from profd.agent.timed import is_timed_thread_free
from profd.agent.window_state import IDLE, NO_STEP, ArmedPlan, FinishedIds, Ticket, WindowState
from profd.backends import end_orphaned_windows
from profd.backends.base import Backend, Collection, HeldSteps, WrittenFile
from profd.core.protocol import AgentEvent, AgentInfo, EventKind, PartDone, StepsMissed
from profd.core.schedule import continuous_schedule, discrete_schedule

__all__ = ["Recorder"]

log = logging.getLogger(__name__)

#: Why a followed worker's step was cut, and why those it then skipped were not recorded.
CUT = (
    "cut short: the coordinator went out of reach during this step, and a worker sees the "
    "driver's steps end only through it"
)
CUT_SKIPPED = (
    "cut short: the driver's next step reached this worker several steps on, so this "
    "step's end was not seen (its trace holds the steps between)"
)
UNANNOUNCED = "not followed: the driver's announcement of these steps did not reach this worker"
UNFOLLOWED = (
    "not followed: the coordinator was out of reach, and a worker learns the driver's steps "
    "only through it"
)


class Recorder:
    """Window logic of one agent. ``enter_step`` / ``exit_step`` / ``close`` run on the
    training thread; export callbacks run on the exporter thread (state shared under a lock).

    Step marks call in only when :attr:`seen` is not the agent's current plan or the step
    reached :attr:`wake_at`: two attribute reads and a comparison on every other mark, so an
    agent holding a window for a later step costs what an idle one does."""

    def __init__(
        self,
        info: AgentInfo,
        emit: Callable[[AgentEvent], None],
        make_backend: Callable[[str, dict[str, Any]], Backend],
        clock: Callable[[], ClockEstimate | None] = lambda: None,
        on_active: Callable[[bool], None] = lambda recording: None,
        on_fault: Callable[[], None] = lambda: None,
    ) -> None:
        """``on_active(recording)``: training thread, when :attr:`active` turns from ``None``
        to a scope or back (the agent routes stage marks by it). ``on_fault()``: a window
        failed; the agent attends at its next mark (a window refused off its thread is
        stopped there: :func:`~profd.backends.end_orphaned_windows`)."""
        self.info = info
        self._emit = emit
        self._make_backend = make_backend
        self._clock = clock
        self._exporter = Exporter(self._on_export_done)
        self._windows: dict[str, WindowState] = {}
        self._finished = FinishedIds()
        #: The plan last adopted (training thread; marks compare it with the agent's).
        self.seen: ArmedPlan = IDLE
        #: The first step at which a step mark has work here (see ``WindowState.wake_step``).
        self.wake_at: int = NO_STEP
        self._lock = threading.Lock()
        self._warned: set[tuple[str, str]] = set()
        #: The scope stage marks talk to; ``None`` while nothing records. A plain attribute
        #: (marks read it on every call); written only through :meth:`_activate`.
        self.active: Scope | None = None
        self._on_active = on_active
        self._on_fault = on_fault
        #: Why steps a followed worker skips went unrecorded, while it could not follow the
        #: driver (None: they were not entered; see :meth:`cut_followed`).
        self.unfollowed: str | None = None

    def _activate(self, scope: Scope | None) -> None:
        """Set :attr:`active`, telling the agent when recording starts or stops."""
        was = self.active is not None
        self.active = scope
        if (scope is not None) != was:
            self._on_active(scope is not None)

    @property
    def has_windows(self) -> bool:
        return bool(self._windows)

    # -- plan ---------------------------------------------------------------------------
    def sync(self, armed: ArmedPlan) -> None:
        """Adopt a newly installed plan: add new windows, wind down removed ones."""
        self.seen = armed
        wanted = {w.session_id: w for w in armed.windows}
        for sid, ws in list(self._windows.items()):
            if sid not in wanted:
                self._abandon(ws, "the session ended before these steps")
        for sid, window in wanted.items():
            if sid in self._windows or sid in self._finished or is_timed_thread_free(window):
                continue
            group_of = {s: g for g in window.groups for s in g}
            self._windows[sid] = WindowState(window, group_of, armed.received_at_step)

    # -- timed windows of thread-bound backends --------------------------------------------
    def attend(self, armed: ArmedPlan, step: int | None = None) -> None:
        """At a mark: adopt a new plan, open pending timed windows, close expired ones, stop
        a window of this thread that another thread could not. ``step``: the step the loop
        is in, as far as the agent knows (a timed window opened here began inside it)."""
        try:
            end_orphaned_windows()  # never raises
            self._attend(armed, step)
        finally:
            self._refresh_wake()

    def _refresh_wake(self) -> None:
        """Training thread, after anything that may add windows or resolve steps."""
        self.wake_at = min((ws.wake_step() for ws in list(self._windows.values())), default=NO_STEP)

    def _attend(self, armed: ArmedPlan, step: int | None = None) -> None:
        if armed is not self.seen:
            self.sync(armed)
        for ws in list(self._windows.values()):
            if ws.window.duration_s is None or ws.timed_done:
                continue
            try:
                if ws.scope is None:
                    ws.scope = TimedScope(self, ws, ws.window.duration_s, in_step=step)
                    ws.recording_sent = True
                    self._emit(AgentEvent(EventKind.RECORDING, ws.window.session_id))
                    self._activate(ws.scope)
                elif isinstance(ws.scope, TimedScope) and ws.scope.expired():
                    self.close_timed(ws)
            except Exception as exc:
                self.fault(ws, exc)

    def close_timed(self, ws: WindowState) -> None:
        """End a timed window. Never raises: it runs inside the job's marks (a stage whose
        deadline passed), a plan's adoption and ``close``, where a profiler that fails to
        stop ends the window, reported, and nothing else."""
        scope = ws.scope
        ws.scope = None
        if self.active is scope:
            self._activate(None)
        try:
            if isinstance(scope, TimedScope):
                scope.close()
        except Exception as exc:
            ws.timed_done = True
            self.fault(ws, exc)  # says why, then ends the part (in that order)
            return
        ws.timed_done = True
        self._maybe_done(ws)

    # -- step boundaries ----------------------------------------------------------------
    def enter_step(self, step: int, armed: ArmedPlan) -> None:
        try:
            end_orphaned_windows()  # a loop that marks only steps (see attend)
            self._attend(armed)
            for ws in list(self._windows.values()):
                try:
                    self._enter(ws, step)
                except Exception as exc:
                    self.fault(ws, exc)
        finally:
            self._refresh_wake()

    def _enter(self, ws: WindowState, step: int) -> None:
        scope = ws.scope
        if ws.window.duration_s is not None:
            if isinstance(scope, TimedScope):
                scope.enter_step(step)
            return
        if isinstance(scope, ContinuousScope) and step not in scope.group:
            self._close_scope(ws)  # the loop jumped out of the group
        self._miss_before(ws, step)
        if step not in ws.group_of or step in ws.handled:
            self._maybe_done(ws)
            return
        if ws.window.discrete:
            ws.scope = DiscreteScope(self, ws, step)
        else:
            if ws.scope is None:
                # joined mid-group (the plan came late): the trace is named by its first step
                group = ws.group_of[step]
                ws.scope = ContinuousScope(self, ws, group[group.index(step) :])
            ws.scope.enter_step(step)  # type: ignore[union-attr]
        if not ws.recording_sent:
            ws.recording_sent = True
            self._emit(AgentEvent(EventKind.RECORDING, ws.window.session_id, step))
        self._activate(ws.scope)

    def cut_followed(self, step: int | None, lost: bool = True) -> None:
        """A worker that follows a driver did not see ``step`` end: it lost the coordinator
        (``lost``), or the driver's next announcement came several steps on. What it
        recorded is written now and the step counted missed; steps it skips until it
        follows again are missed for the same reason, and a later step of the same group
        records again (a trace named by it) once it is followed."""
        self.unfollowed = UNFOLLOWED if lost else UNANNOUNCED
        cut = CUT if lost else CUT_SKIPPED
        try:
            for ws in list(self._windows.values()):
                scope = ws.scope
                try:
                    if isinstance(scope, ContinuousScope) and step in scope.group:
                        self._close_scope(ws, cut, cut_at=step)
                    elif isinstance(scope, DiscreteScope):
                        self._close_scope(ws)  # each stage's trace is whole by itself
                    self._maybe_done(ws)
                except Exception as exc:
                    self.fault(ws, exc)
        finally:
            self._refresh_wake()

    def exit_step(self, step: int) -> None:
        try:
            for ws in list(self._windows.values()):
                try:
                    self._exit(ws, step)
                except Exception as exc:
                    self.fault(ws, exc)
        finally:
            self._refresh_wake()

    def _exit(self, ws: WindowState, step: int) -> None:
        scope = ws.scope
        if ws.window.duration_s is not None:
            if isinstance(scope, TimedScope):
                if step in scope.ticket.steps:  # type: ignore[union-attr]
                    scope.exit_step(step)
                else:
                    scope.left(step)  # begun before the window
                if scope.expired():
                    self.close_timed(ws)
            return
        if isinstance(scope, DiscreteScope) and scope.step == step:
            ws.scope = None
            self._activate(None)
            with self._lock:
                ws.handled.add(step)
            if not scope.stages:
                self._mark_missed(ws, [step], "no stage ran inside this profiled step")
        elif isinstance(scope, ContinuousScope) and step in scope.group:
            scope.exit_step(step)
            if step == scope.group[-1]:
                self._close_scope(ws)
        self._maybe_done(ws)

    def _miss_before(self, ws: WindowState, step: int) -> None:
        late = [s for s in ws.window.steps if s < step and s not in ws.handled]
        scope = ws.scope
        if isinstance(scope, ContinuousScope):
            late = [s for s in late if s not in scope.group]
        if not late:
            return
        arrived = ws.received_at_step
        if arrived is not None and arrived >= late[0]:
            reason = f"the plan arrived during step {arrived}, after step {late[0]} had begun"
        else:
            reason = self.unfollowed or "the loop never entered these steps"
        self._mark_missed(ws, late, reason)

    def _mark_missed(self, ws: WindowState, steps: list[int], reason: str) -> None:
        with self._lock:
            ws.handled.update(steps)
            ws.missed.update(steps)
        self._emit(
            AgentEvent(
                EventKind.MISSED, ws.window.session_id, steps[0], reason, StepsMissed(tuple(steps))
            )
        )

    # -- collections and tickets ----------------------------------------------------------
    def open_collection(
        self, ws: WindowState, label: str, step: int | None, update_loop: bool = False
    ) -> tuple[Collection, Ticket]:
        window = ws.window
        backend = self._make_backend(window.tool, window.tool_config)
        if not window.discrete or window.duration_s is not None:  # timed: one collection
            schedule, by_mini_batch = continuous_schedule(backend.schedule), False
        elif update_loop:
            schedule, by_mini_batch = discrete_schedule(backend.schedule), True
        else:
            schedule, by_mini_batch = None, False
        group = ws.group_of.get(step, (step,)) if step is not None else ()
        spec = build_spec(
            self.info, window, label, step, group, schedule, by_mini_batch, self._clock()
        )
        collection = backend.open(spec)
        ticket = Ticket(ws, label, [step] if window.discrete and step is not None else [])
        ticket.scheduled = schedule is not None
        ticket.stage_windows = by_mini_batch
        ticket.stall_s = collection.export_wait_s  # waited for an earlier window's export
        with self._lock:
            ws.open_tickets += 1
        return collection, ticket

    def submit(self, ticket: Ticket, outputs: list[Any], final: bool = False) -> None:
        """Send windows to the exporter. ``final``: the collection's last (it was closed), so
        the steps it holds whole are known and go into the file's header; a schedule's
        windows (a few mini-batches each) hold none whole."""
        if not outputs:
            return
        window = ticket.ws.window
        with self._lock:
            ticket.pending += len(outputs)
            # a step cut short (missed, said why) or ended inside (a deadline, a failure) is
            # in the file, but not a step it holds whole
            steps = tuple(
                s for s in ticket.steps if s not in ticket.ws.missed and s not in ticket.partial
            )
        for output in outputs:
            self._exporter.submit(
                ExportJob(
                    window.session_id,
                    steps,
                    ticket.label,
                    window.tool,
                    output,
                    context=ticket,
                    held=_held(ticket, steps, final),
                )
            )

    def close_ticket(self, ticket: Ticket, collection: Collection) -> None:
        """Stop a collection and send its windows to the exporter. Whatever happens, the
        ticket ends up settled, so the window can finish (a failure is re-raised: the
        caller's :meth:`fault` says why, then finishes the window, in that order)."""
        outputs: list[Any] = []
        started = time.perf_counter()
        try:
            outputs = collection.close()
        except Exception as exc:
            with self._lock:
                ticket.errors.append(f"stopping the profiler failed: {exc}")
                ticket.ws.stop_failed = True  # its end waits for fault() to tell why
            raise
        finally:
            ticket.stall_s += time.perf_counter() - started  # what the training thread paid
            ticket.closed = True
            self.submit(ticket, outputs, final=True)
            self._settle(ticket)

    def _close_scope(
        self,
        ws: WindowState,
        leftover_reason: str = "the loop left the step group early",
        cut_at: int | None = None,
    ) -> None:
        """End the window's scope. ``cut_at``: a continuous scope cut in that step, which
        is missed; the group's later steps stay open to a new scope (a rejoin)."""
        scope = ws.scope
        ws.scope = None
        if self.active is scope:
            self._activate(None)
        if isinstance(scope, DiscreteScope):
            if scope.current is not None and scope.ticket is not None:  # ended mid-stage
                collection, ticket = scope.current, scope.ticket
                mark_partial(scope, ticket)
                scope.current = scope.ticket = None
                self.close_ticket(ticket, collection)
            with self._lock:
                ws.handled.add(scope.step)
            return
        if not isinstance(scope, ContinuousScope):
            return
        if cut_at is None:
            leftover, closed = [s for s in scope.group if s not in scope.done], scope.group
        else:
            leftover, closed = [cut_at], tuple(scope.done)
        with self._lock:
            ws.handled.update(closed)
        if leftover:  # before the file is written: a step cut short never counts as recorded
            self._mark_missed(ws, leftover, leftover_reason)
        scope.close()

    def _on_export_done(self, job: ExportJob, files: list[WrittenFile], error: str | None) -> None:
        ticket: Ticket = job.context
        if error is not None:
            self._emit(AgentEvent(EventKind.ERROR, job.session_id, None, error))
        for f in files:
            self._emit(
                trace_event(
                    self.info.node_id,
                    job.session_id,
                    list(job.steps),
                    job.scope,
                    job.tool,
                    f,
                    ticket.stall_s,
                )
            )
        with self._lock:
            ticket.pending -= 1
            ticket.files += len(files)
            if error is not None:
                ticket.errors.append(error)
        self._settle(ticket)

    def _settle(self, ticket: Ticket) -> None:
        """A closed collection whose files are all written: its steps are now resolved, and
        the window ends if that was its last (see :meth:`_maybe_done`)."""
        ws = ticket.ws
        with self._lock:
            if ticket.settled or not ticket.closed or ticket.pending > 0:
                return
            ticket.settled = True
            ws.open_tickets -= 1
            if ticket.files:
                ws.recorded.update(
                    s for s in ticket.steps if s not in ws.missed and s not in ticket.partial
                )
        if not ticket.files and not ticket.errors and ticket.steps:
            self._emit(
                AgentEvent(
                    EventKind.MISSED,
                    ws.window.session_id,
                    ticket.steps[0],
                    f"{ticket.label}: the schedule saved no window in these steps",
                    StepsMissed(tuple(ticket.steps)),
                )
            )
        self._maybe_done(ws)

    def _maybe_done(self, ws: WindowState) -> None:
        """The window's end, once every step is handled and every file written; a window
        whose stop failed only once :meth:`fault` told why (else the coordinator, told the
        window ended, drops the error)."""
        with self._lock:
            if ws.done_sent or not ws.all_handled or ws.scope is not None:
                return
            if ws.stop_failed and not ws.fault_told:
                return
            if not ws.collecting_sent:
                ws.collecting_sent = True
                self._emit(AgentEvent(EventKind.COLLECTING, ws.window.session_id))
            if ws.open_tickets > 0:
                return
            ws.done_sent = True
            sid = ws.window.session_id
            self._finished.add(sid)
            self._windows.pop(sid, None)
            missed = set(ws.window.steps) - ws.recorded
            done = PartDone(tuple(sorted(ws.recorded)), tuple(sorted(missed)))
        self._emit(AgentEvent(EventKind.PART_DONE, sid, payload=done))

    # -- faults and shutdown --------------------------------------------------------------
    def fault(self, ws: WindowState, exc: BaseException) -> None:
        """Give up a window after a failure inside profd; training goes on."""
        key = (ws.window.session_id, type(exc).__name__)
        if key not in self._warned:
            self._warned.add(key)
            log.warning(
                "profd: recording for session %s failed: %r",
                ws.window.session_id,
                exc,
                exc_info=True,
            )
        scope = ws.scope
        ws.scope = None
        if self.active is scope:
            self._activate(None)
        if scope is not None:
            # Detach first: marks still open (a stage's __exit__) must not stop it again.
            collection, ticket = scope.current, scope.ticket
            mark_partial(scope, ticket)
            scope.current = scope.ticket = None
            if collection is not None and ticket is not None and not ticket.closed:
                try:
                    self.close_ticket(ticket, collection)
                except Exception:  # already failing: the window is given up just below
                    log.debug("profd: closing the failed window's collection", exc_info=True)
        self._emit(
            AgentEvent(
                EventKind.ERROR,
                ws.window.session_id,
                None,
                f"recording failed: {type(exc).__name__}: {exc}",
            )
        )
        remaining = [s for s in ws.window.steps if s not in ws.handled]
        with self._lock:
            ws.handled.update(remaining)
            ws.fault_told = True
        self._maybe_done(ws)
        self._on_fault()

    def _abandon(self, ws: WindowState, reason: str) -> None:
        if ws.window.duration_s is not None:
            if ws.scope is None and not ws.timed_done:
                self._emit(
                    AgentEvent(
                        EventKind.MISSED,
                        ws.window.session_id,
                        None,
                        "no mark reached the agent during the timed window (a stalled loop "
                        "can be profiled with py_spy)",
                        StepsMissed(),
                    )
                )
            self.close_timed(ws)
            return
        try:
            self._close_scope(ws, reason)
        except Exception as exc:
            self.fault(ws, exc)
            return
        remaining = [s for s in ws.window.steps if s not in ws.handled]
        if remaining:
            self._mark_missed(ws, remaining, reason)
        self._maybe_done(ws)

    def close(self, timeout: float, armed: ArmedPlan | None = None) -> bool:
        """End of the job: flush open windows, write every file; True when all were written.

        ``armed`` is the latest plan, so windows that arrived after the last mark are
        resolved (and reported) too."""
        if armed is not None and armed is not self.seen:
            self.sync(armed)
        for ws in list(self._windows.values()):
            self._abandon(ws, "the job ended before these steps")
        self._refresh_wake()
        end_orphaned_windows()  # closed on the training thread: its own are stopped here
        if self._exporter.drain(timeout):
            return True
        self._give_up_unwritten(timeout)
        return False

    def _give_up_unwritten(self, timeout: float) -> None:
        """The windows whose files were still being written when ``close`` stopped waiting
        for them end now, saying so (else the coordinator, told the agent closed, reads
        their recorded steps as never reached). A file finished later is reported only if the
        agent can still send it."""
        for ws in list(self._windows.values()):
            with self._lock:
                if ws.done_sent or ws.open_tickets == 0:  # finished meanwhile: _maybe_done's
                    continue
                ws.done_sent = True
                sid = ws.window.session_id
                self._finished.add(sid)
                self._windows.pop(sid, None)
                writing = ws.open_tickets
                missed = set(ws.window.steps) - ws.recorded
                done = PartDone(tuple(sorted(ws.recorded)), tuple(sorted(missed)))
            message = (
                f"the job ended while {writing} trace(s) of this window were still being "
                f"written (not done {timeout:g} s after the agent closed)"
            )
            self._emit(AgentEvent(EventKind.ERROR, sid, None, message))
            self._emit(AgentEvent(EventKind.PART_DONE, sid, payload=done))


def _held(ticket: Ticket, steps: tuple[int, ...], final: bool) -> HeldSteps | None:
    """What a file of the collection holds of the loop's steps: a discrete stage's schedule
    windows (a few mini-batches each) none whole; a continuous schedule's windows are not
    counted (as before profd counted them); a plain collection's, once it closed."""
    if ticket.scheduled:
        return HeldSteps() if ticket.stage_windows else None
    return HeldSteps(steps, ticket.began_in) if final else None
