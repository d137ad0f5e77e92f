"""The in-worker agent and its marks.

``profd.attach(...)`` creates one :class:`ProfilerAgent` per (role, rank) in a worker process.
Its marks (``step``, ``stage``, ``mini_batch``, ``micro_batch``) are what the training loop
calls; while no window is armed a step or stage mark returns its own reused context manager,
which records the mark's duration (:mod:`profd.agent.timings`), and a mini- or micro-batch
mark a shared no-op: an idle agent costs about as much as an empty ``with`` block and never
makes an RPC, takes a lock or allocates on the training thread.

Without a coordinator (no Ray, or profd not started yet) the agent is inert; inside a Ray job
it keeps looking for the coordinator in the background, so ``profd up`` can come later.

A CUDA out-of-memory error leaving a step or stage mark (a ``torch.cuda.OutOfMemoryError``,
told by its class name or its "CUDA out of memory" message: torch is not imported for it)
becomes one ``oom`` event, with the ``torch_memory`` snapshot when such a window records;
the mark re-raises it either way, and a failure to report it is only logged
(:mod:`profd.agent.oom`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from profd.agent.channel import Channel, CoordinatorLink
from profd.agent.clock_sync import ClockEstimate
from profd.agent.oom import OutOfMemoryReports, is_out_of_memory
from profd.agent.recorder import Recorder
from profd.agent.step_marks import ADOPT, StepMark, TimedStepMark
from profd.agent.timed import TimedWindows
from profd.agent.timings import UNTIMED, TimedRange, Timings, mark_clock
from profd.agent.window_state import IDLE, ArmedPlan
from profd.backends import NULL_RANGE, Backend, capabilities, make_backend, orphaned_here
from profd.backends.nvtx_guard import apply_guard as apply_nvtx_guard
from profd.backends.torch_backend import warm_up_profiler
from profd.core.naming import sanitize
from profd.core.protocol import (
    AgentEvent,
    AgentInfo,
    AgentPlan,
    EventKind,
    MarkDurations,
)
from profd.core.ray_env import process_start, ray_context, ray_up
from profd.core.request import ToolKind

__all__ = ["ProfilerAgent", "is_out_of_memory"]

log = logging.getLogger(__name__)

#: How long ``close`` waits for an agent that is between two links (moving to its node's
#: relay, or registering again) before it gives up on sending its last events.
RELINK_WAIT_S = 5.0
#: A single-controller worker that lost the coordinator this long ago cuts its step in
#: progress at its next mark (else the outage is recorded into that one step); a shorter
#: loss is judged by the driver's next step (see ``_follow_controller``).
CUT_AFTER_S = 2.0


class ProfilerAgent:
    """Marks for one (role, rank) of a worker. Create it with :func:`profd.attach`."""

    def __init__(
        self,
        role: str,
        rank: int,
        world_size: int | None = None,
        topology: Mapping[str, int] | None = None,
        *,
        find_link: Callable[[], CoordinatorLink | None] | None = None,
        backend_factory: Callable[[str, dict[str, Any]], Backend] = make_backend,
        poll_timeout_s: float = 5.0,
        now_ns: Callable[[], int] = time.time_ns,
        mark_times: bool = True,
    ) -> None:
        """``now_ns``: this process's wall clock, the one its traces are on (tests inject a
        skewed one to check that offsets to the coordinator's clock are applied).
        ``mark_times=False``: marks do not record their durations (live step and stage
        times, :mod:`profd.agent.timings`); for loops whose marks are microseconds apart."""
        self.info = new_agent_info(role, rank, world_size, topology)
        self._next_step: int | None = None
        self._current_step: int | None = None
        self._armed: ArmedPlan = IDLE
        self._step_mark = TimedStepMark(self) if mark_times else StepMark(self)
        if not mark_times:  # the marks as they were before they were timed
            self.step = self._untimed_step  # type: ignore[method-assign]
            self.stage = self._untimed_stage  # type: ignore[method-assign]
        self._timings = Timings(enabled=mark_times, on_error=self._mark_error)
        self._oom = OutOfMemoryReports(
            lambda event: self._emit(event),  # read when it reports (tests replace _emit)
            armed=lambda: self._armed,
            active=lambda: self._recorder.active,
            step=lambda: self._current_step,
        )
        #: The training thread's lookups of stage timers (replaced when roles change).
        self._stage_timers = self._timings.plain
        self._role_timers = self._timings.by_role
        #: An untimed agent's loop marked a step (a timed one's step mark tells, see _spmd).
        self._steps_marked = False
        #: Single-controller jobs: the step the driver announced, and the one followed.
        self._announced: int | None = None
        self._followed: int | None = None
        #: Bumped by the poller when the training thread has something to do at its next
        #: mark (a controller step, a timed window); marks compare it with what they saw.
        self._attention = 0
        self._attended = 0
        #: Losses of the coordinator (poller thread counts) and those judged (training
        #: thread): a worker that follows a driver cannot see the step in progress end.
        self._losses = 0
        self._losses_judged = 0
        self._lost_at = 0.0
        self._cut = False  # the step in progress was cut during this outage
        self._closed = False
        self._pid = os.getpid()  # a forked child inherits the object, not the agent
        self._recorder = Recorder(
            self.info,
            self._emit,
            backend_factory,
            self._clock_estimate,
            self._recording_changed,
            self._wake_at_next_mark,
        )
        self._timed = TimedWindows(
            lambda: self.info, self._emit, backend_factory, self._clock_estimate
        )
        self._channel: Channel | None = None
        self._find_link = find_link
        self._poll_timeout_s = poll_timeout_s
        self._now_ns = now_ns
        self._roles = [role]

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> ProfilerAgent:
        """Start looking for the coordinator in the background (idempotent)."""
        if self._channel is not None or self._closed:
            return self
        channel = None
        try:
            find = self._find_link or _default_find_link()
            if find is None:
                log.info("profd: not inside a Ray job; agent %s stays inert", self.info.agent_id)
                return self
            apply_nvtx_guard(under_nsys=os.environ.get("PROFD_NSYS") == "1")
            channel = Channel(
                self.info,
                find,
                # only a step of its own: a driven worker's step is its driver's (the
                # coordinator has it), not the last one a session pushed to it
                lambda: self._current_step if self._spmd else None,
                self._install_plan,
                poll_timeout_s=self._poll_timeout_s,
                now_ns=self._now_ns,
                take_times=self._take_times,
                on_down=self._coordinator_lost,
            )
            channel.start()
        except Exception:  # never into the job: the agent stays inert, said once
            if channel is not None:  # a thread may have started: no agent half-attached
                with contextlib.suppress(Exception):
                    channel.stop(0.1)
            log.warning(
                "profd: agent %s could not start and stays inert (training goes on)",
                self.info.agent_id,
                exc_info=True,
            )
            return self
        self._channel = channel
        return self

    def _clock_estimate(self) -> ClockEstimate | None:
        return self._channel.clock if self._channel is not None else None

    def close(self, timeout: float = 60.0) -> bool:
        """Flush open windows, write pending traces and tell the coordinator; idempotent.

        Call it from the training thread at the end of the loop (or use the agent as a context
        manager). Returns True when every trace was written within ``timeout``.
        """
        if self._closed:
            return True
        self._closed = True
        if os.getpid() != self._pid:  # a forked child: the threads and the link are the
            return True  # parent's; nothing here to flush, and nobody to tell
        ok = True
        if not self._spmd and self._current_step is not None and self._recorder.has_windows:
            self._exit_step(self._current_step)  # the driver's last step is over
        try:
            ok = self._recorder.close(timeout, self._armed)
            self._timed.close(timeout)
        except Exception:
            log.exception("profd: closing the recorder failed")
            ok = False
        self._sync_wake()
        if self._channel is not None:
            # events cannot leave an agent that never connected; one between two links
            # (moving to its relay) is waited for briefly, or its last traces were lost
            if self._channel.reachable(min(RELINK_WAIT_S, timeout)):
                self._channel.leave()
                self._emit(AgentEvent(EventKind.CLOSED, None, self._current_step))
                self._channel.flush(min(10.0, timeout))
            self._channel.stop()
        return ok

    def __enter__(self) -> ProfilerAgent:
        return self

    def __exit__(self, *exc_info: Any) -> bool:
        self.close()
        return False

    def add_role(self, role: str) -> None:
        """Host another role in this process: one collection, named by the combined role
        (``actor`` + ``ref`` → ``actor_ref``); the agent registers again under that name."""
        if role in self._roles:
            return
        self._roles.append(role)
        self.info = dataclasses.replace(self.info, role="_".join(self._roles))
        self._recorder.info = self.info
        self._timings.relabel()  # stage labels now name their role
        self._recording_changed(self._recorder.active is not None)
        if self._channel is not None:
            self._channel.update_info(self.info)

    @property
    def _spmd(self) -> bool:
        """The loop marks steps itself (SPMD), rather than following a driver's. Derived,
        not stored by every step mark: a store less per step."""
        return self._steps_marked or getattr(self._step_mark, "t0", 0.0) != 0.0

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self._roles)

    # -- introspection --------------------------------------------------------------------
    @property
    def agent_id(self) -> str:
        return self.info.agent_id

    @property
    def current_step(self) -> int | None:
        return self._current_step

    @property
    def plan(self) -> AgentPlan:
        return self._armed.plan

    @property
    def connected(self) -> bool:
        return self._channel is not None and self._channel.connected

    @property
    def recording(self) -> bool:
        return self._recorder.active is not None

    # -- marks ----------------------------------------------------------------------------
    def step(self, step: int) -> AbstractContextManager[None]:
        """Mark one training step (the unit ``steps`` / ``next_steps`` count), as
        ``with agent.step(n):`` (the step begins when this is called)."""
        self._current_step = step
        mark = self._step_mark
        # O(1) on every mark: a plan not adopted yet, or a step some window waits for
        try:
            due = step >= mark.wake
        except TypeError:  # a step that is not a number: nothing can be due at it
            due = False
        if due:
            self._enter_step(step, self._armed)
        mark.t0 = mark_clock()  # after a window's start: the step's own time begins here
        return mark

    def _untimed_step(self, step: int) -> AbstractContextManager[None]:
        """:meth:`step` of an agent made with ``mark_times=False``."""
        self._next_step = step
        return self._step_mark

    def stage(
        self, name: str, role: str | None = None, update_loop: bool = False
    ) -> AbstractContextManager[Any]:
        """Mark a stage. The label is ``name``, or ``f"{role}_{name}"`` when ``role`` is given.
        Pass ``role`` and ``update_loop`` by keyword (they are not keyword-only because
        keyword-only defaults cost an idle mark a tenth of its time in CPython 3.11).

        ``update_loop=True`` marks the stage whose mini-batches drive the torch schedule.
        In single-controller jobs the first stage of a new step is where the agent moves to the
        step the driver announced.
        """
        if self._attention != self._attended:
            self._attend()
        # idle: the label's timer in one lookup (while a window records the lookups are
        # empty, see _recording_changed, and every stage takes the slow path to its range)
        try:
            timer = self._stage_timers[name] if role is None else self._role_timers[role][name]
        except KeyError:
            return self._stage_slow(name, role, update_loop)
        timer.t0 = mark_clock()  # the timer's __enter__ is a C no-op (see timings)
        return timer

    def _untimed_stage(
        self, name: str, *, role: str | None = None, update_loop: bool = False
    ) -> AbstractContextManager[Any]:
        """:meth:`stage` of an agent made with ``mark_times=False``."""
        if self._attention != self._attended:
            self._attend()
        scope = self._recorder.active
        if scope is None:
            return NULL_RANGE
        if role is None and len(self._roles) > 1:
            role = self._roles[0]  # several roles share the trace: every label names its role
        return scope.stage(name if role is None else f"{role}_{name}", update_loop)

    def _stage_slow(
        self, name: str, role: str | None, update_loop: bool
    ) -> AbstractContextManager[Any]:
        """A label's first idle mark (its timer is made), or any mark while a window records."""
        first = role
        if role is None and len(self._roles) > 1:
            role = self._roles[0]  # several roles share the trace: every label names its role
        label = name if role is None else f"{role}_{name}"
        try:
            timer: Any = self._timings.timer(name, first, label)
        except Exception:  # never into the loop: this stage goes untimed
            log.exception("profd: timing stage %r failed", label)
            timer = UNTIMED
        scope = self._recorder.active
        if scope is None:
            timer.t0 = mark_clock()  # type: ignore[attr-defined]
            return timer
        rng = scope.stage(label, update_loop)
        if timer is UNTIMED:
            return rng
        return TimedRange(timer, rng)  # type: ignore[arg-type]

    def mini_batch(self, index: int) -> AbstractContextManager[Any]:
        """Mark update mini-batch ``index`` (a ``mini_batch<i>`` range; advances schedules)."""
        scope = self._recorder.active
        if scope is None:
            return NULL_RANGE
        return scope.mini_batch(index)

    def micro_batch(self, index: int) -> AbstractContextManager[Any]:
        """Mark micro-batch ``index`` (a ``micro_batch<j>`` range)."""
        scope = self._recorder.active
        if scope is None:
            return NULL_RANGE
        return scope.micro_batch(index)

    # -- internals --------------------------------------------------------------------------
    def _recording_changed(self, recording: bool) -> None:
        """Training thread (the recorder's ``active`` changed): while a window records,
        stage marks find no timer in their one lookup and go to the recording path; so an
        idle stage mark needs no check of its own."""
        self._stage_timers = {} if recording else self._timings.plain
        self._role_timers = {} if recording else self._timings.by_role

    def _take_times(self) -> MarkDurations | None:
        """Reporter thread: the step and stage durations measured since the last call, with
        the stage spans on the coordinator's clock (none until its offset is measured)."""
        estimate = self._clock_estimate()
        base = None
        if estimate is not None:  # mark_clock -> this process's wall clock -> the coordinator's
            base = (self._now_ns() + estimate.offset_ns) / 1e9 - mark_clock()
        return self._timings.take(self._step_mark, base)

    def _mark_error(self, exc: BaseException, stage: str | None) -> None:
        """Training thread: an exception is leaving a mark (which re-raises it)."""
        self._oom.mark_error(exc, stage)

    def _emit(self, event: AgentEvent) -> None:
        if self._channel is not None:
            self._channel.send(event)

    def _install_plan(self, plan: AgentPlan) -> None:
        """Poller thread: publish a plan snapshot and acknowledge new windows."""
        if plan.spans != self._timings.spans:
            self._timings.set_spans(plan.spans, self._step_mark)
        held = self._armed.plan
        if (plan.windows, plan.controller_step, plan.controller_phase) == (
            held.windows,
            held.controller_step,
            held.controller_phase,
        ):
            return  # a stack request or span mode (done above): the marks keep their plan
        old = {w.session_id for w in held.windows}
        self._armed = ArmedPlan(plan, self._current_step)
        self._step_mark.wake = ADOPT  # after _armed: see _sync_wake
        self._timed.sync(plan.windows)  # thread-free timed windows start right away
        if plan.controller_step is not None and plan.controller_step != self._announced:
            self._announced = plan.controller_step
            self._attention += 1
        if any(w.duration_s is not None and w.session_id not in old for w in plan.windows):
            self._attention += 1
        if old - {w.session_id for w in plan.windows}:
            # a window ended (cancelled, or its session's deadline): its collection stops at
            # the next mark of any kind; a followed worker may see no step mark for long
            self._attention += 1
        for w in plan.windows:
            if w.session_id not in old:
                self._emit(AgentEvent(EventKind.ARMED, w.session_id, self._current_step))
                if w.tool == ToolKind.TORCH:
                    warm_up_profiler()  # the first start's imports, off the training thread

    def _wake_at_next_mark(self) -> None:
        """The next mark attends, a step mark too (after a failed window: see Recorder's
        on_fault; a window refused off its thread is stopped there). Race-free as
        :meth:`_sync_wake` says: the window is held as refused before this runs."""
        self._attention += 1
        self._step_mark.wake = ADOPT

    def _coordinator_lost(self) -> None:
        """Poller thread: the coordinator is out of reach. A worker that follows a driver's
        steps learns them only through it, so the step in progress is cut at the next mark
        (else its window records until the coordinator is back: seconds to minutes of
        profiler cost, all in one "step"). A loop that marks its own steps goes on."""
        if not self._spmd and (self._recorder.has_windows or self._armed.plan.windows):
            if self._losses == self._losses_judged:  # (a second loss: timed from the first)
                self._lost_at = time.monotonic()
            self._losses += 1
            self._attention += 1

    def _attend(self) -> None:
        """Training thread, at a mark: follow the driver's step, open or close timed windows."""
        self._attended = self._attention
        if self._losses != self._losses_judged:
            self._judge_loss()
        if self._announced != self._followed:
            self._follow_controller()
        try:
            # a timed window opened at this mark began inside the step the loop is in
            self._recorder.attend(self._armed, self._current_step)
        except Exception:
            log.exception("profd: attending to a new plan failed")
        self._sync_wake()

    def _judge_loss(self) -> None:
        """Training thread, at a mark after the coordinator went out of reach. Still away
        after :data:`CUT_AFTER_S`: the step in progress is cut (else the profiler records
        the outage into it). Back: the next step the driver announces decides
        (:meth:`_follow_controller`)."""
        if self._cut or (self._channel is not None and self._channel.connected):
            return
        if time.monotonic() - self._lost_at < CUT_AFTER_S:
            self._attended = -1  # not yet: look again at the next mark
            return
        self._cut_followed()

    def _cut_followed(self, lost: bool = True) -> None:
        self._cut = True
        try:
            self._recorder.cut_followed(self._current_step, lost)
        except Exception:
            log.exception("profd: cutting the step in progress failed")

    def _follow_controller(self) -> None:
        """Training thread: leave the previous step and enter the one the driver announced.
        The first step announced after the coordinator was out of reach: if the driver
        moved more than one step on meanwhile, the step in progress ended long ago (its
        trace would hold the steps since): it is cut, and the steps between are missed as
        not followed; one step on, or none, was a blip and the step records whole."""
        step = self._announced
        self._followed = step
        if self._spmd or step is None:
            return
        # Any jump of more than a step means the step in progress ended unseen (a lost
        # coordinator, or one a relay re-synced without the agent knowing, or a late plan)
        losses, current = self._losses, self._current_step
        jumped = current is not None and step > current + 1
        if step != current and (jumped or losses != self._losses_judged):
            if jumped and not self._cut:
                self._cut_followed(lost=losses != self._losses_judged)
            self._losses_judged, self._cut = losses, False
        if step != self._current_step:
            previous = self._current_step
            if previous is not None and self._recorder.has_windows:
                self._exit_step(previous)
            self._current_step = step
            armed = self._armed
            if armed.plan.windows or self._recorder.has_windows:
                self._enter_step(step, armed)
        self._recorder.unfollowed = None  # following again: later gaps are the loop's own

    def _enter_step(self, step: int | None, armed: ArmedPlan) -> None:
        if step is None:
            return
        try:
            self._recorder.enter_step(step, armed)
        except Exception:
            log.exception("profd: step %s enter failed", step)
        self._sync_wake()

    def _exit_step(self, step: int | None) -> None:
        if step is None:
            return
        try:
            self._recorder.exit_step(step)
        except Exception:
            log.exception("profd: step %s exit failed", step)
        self._sync_wake()

    def _sync_wake(self) -> None:
        """Training thread, after the recorder ran: copy when the step mark has work next.

        Race-free without a lock: the poller sets ``_armed`` and then ``wake = ADOPT``; this
        sets ``wake`` and then reads ``_armed``. Whatever the interleaving, a plan the
        recorder has not adopted leaves ``wake`` at ``ADOPT``."""
        mark = self._step_mark
        wake = self._recorder.wake_at
        mark.wake_exit = wake
        mark.wake = wake
        if self._armed is not self._recorder.seen or orphaned_here():
            mark.wake = ADOPT  # (a window of this thread refused elsewhere: stopped then)


def _default_find_link() -> Callable[[], CoordinatorLink | None] | None:
    """Inside Ray: the coordinator, through the node's relay (``PROFD_RELAY=0``: directly)."""
    if not ray_up():
        return None
    from profd.agent.relay_link import default_link_finder

    return default_link_finder()


def new_agent_info(
    role: str, rank: int, world_size: int | None, topology: Mapping[str, int] | None
) -> AgentInfo:
    """This process's description of a new agent of ``role`` / ``rank``; bad values are a
    ``ValueError`` naming the argument."""
    if not isinstance(role, str) or not role.strip():
        raise ValueError(f"role: must be a non-empty string, got {role!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank: must be an int >= 0, got {rank!r}")
    if world_size is not None and (
        isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= rank
    ):
        raise ValueError(f"world_size: must be an int > rank ({rank}), got {world_size!r}")
    topo = {str(k): int(v) for k, v in (topology or {}).items()}
    ray = ray_context()
    return AgentInfo(
        agent_id=f"{sanitize(role)}-{rank}-{uuid.uuid4().hex[:8]}",
        role=role,
        rank=rank,
        world_size=world_size,
        topology=topo,
        hostname=socket.gethostname(),
        pid=os.getpid(),
        node_id=ray.node_id,
        node_ip=ray.node_ip,
        capabilities=capabilities(),
        pid_start=process_start(os.getpid()),
        job_id=ray.job_id,
        thread_id=threading.get_native_id(),
    )
