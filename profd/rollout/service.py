"""A rollout replica's agent, connected to the coordinator.

``profd.attach_rollout(replica, parallelism, engine, ...)`` registers the replica (role
``rollout``, rank = replica index, its global GPU rank range in the topology) and drives the
engine's own profiler from the coordinator's plans:

* **step windows** follow a single-controller driver (``profd.controller()``). A replica on
  devices of its own records from ``step(n)`` entry to exit; a *colocated* replica (sharing
  devices with training, ``colocated=True``) records only inside ``controller().rollout()``,
  so its window is closed before the first training stage — never two profilers on one
  device. A colocated replica whose driver never marks ``rollout()`` reports the step missed
  with that reason instead of overlapping.
* **timed windows** (``duration_s``) run by themselves, for rollout-only sessions.

Engine calls block (a vLLM stop returns only once its traces are written), so they run on a
worker thread of this service, never on the poller; the wait for a stopped window's files
runs on a collector thread, so a later group's window starts while they settle. Every
failure becomes the replica's part outcome, never an exception.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from profd.agent.channel import Channel, CoordinatorLink
from profd.agent.relay_link import default_link_finder
from profd.core.protocol import (
    AgentEvent,
    AgentPlan,
    EventKind,
    IncompleteFile,
    PartDone,
    PhaseDone,
    StepsMissed,
    WindowPlan,
)
from profd.core.ray_env import process_start, ray_context
from profd.core.states import ControllerPhase
from profd.rollout.engine_args import EngineProfileOptions
from profd.rollout.rollout_agent import RolloutAgent
from profd.rollout.window_end import StoppedWindow
from profd.rollout.windows import WindowMode, WindowOutcome

__all__ = ["RolloutService", "attach_rollout"]

log = logging.getLogger(__name__)


@dataclass
class _Window:
    plan: WindowPlan
    group_of: dict[int, tuple[int, ...]]
    recorded: set[int] = field(default_factory=set)
    missed: dict[int, str] = field(default_factory=dict)
    open_group: tuple[int, ...] | None = None
    #: Gathered from each collection's outcome for the window's ``part_done``.
    kept_in_subdir: list[str] = field(default_factory=list)
    incomplete: list[IncompleteFile] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: Steps whose engine stopped and whose files are being collected (off the worker).
    collecting: set[int] = field(default_factory=set)
    #: Why the window ended before its steps (its steps not recorded are missed for it).
    ended: str | None = None
    done: bool = False

    @property
    def resolved(self) -> bool:
        return set(self.plan.steps) <= self.recorded | set(self.missed)


@dataclass(frozen=True, slots=True)
class _Collected:
    """A collection's outcome, handed back to the worker thread (which owns the windows)."""

    session_id: str
    group: tuple[int, ...]
    outcome: WindowOutcome


class _Collector:
    """Collects stopped windows' files on a thread of its own, in the order they stopped,
    so the worker can start the replica's next window meanwhile (a later group's step)."""

    def __init__(self, agent: RolloutAgent, done: Callable[[_Collected], None]) -> None:
        self._agent = agent
        self._done = done
        self._todo: queue.Queue[tuple[str, tuple[int, ...], StoppedWindow]] = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(self, session_id: str, group: tuple[int, ...], stopped: StoppedWindow) -> None:
        if self._thread is None:
            thread = threading.Thread(target=self._run, name="profd-rollout-collect", daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:  # no thread to be had: collect here, as before
                log.warning("profd: no collector thread (%s); collecting on the worker", exc)
                self._done(_Collected(session_id, group, self._agent.collect(stopped)))
                return
            self._thread = thread
        self._todo.put((session_id, group, stopped))

    def _run(self) -> None:
        while True:
            sid, group, stopped = self._todo.get()
            self._done(_Collected(sid, group, self._agent.collect(stopped)))  # never raises


class _Confirm:
    """An event sent once: a phase's confirmation to the driver when the window's engine
    stopped (the driver waits for that, not for the files), else after the phase was
    handled; a window's ``collecting`` at its engine's stop."""

    def __init__(self, emit: Callable[[AgentEvent], None], event: AgentEvent) -> None:
        self._emit = emit
        self._event: AgentEvent | None = event

    def __call__(self) -> None:
        event, self._event = self._event, None
        if event is not None:
            self._emit(event)


class RolloutService:
    """Registers one replica and runs its windows; see the module docstring."""

    def __init__(
        self,
        agent: RolloutAgent,
        *,
        replicas: int | None = None,
        colocated: bool = False,
        find_link: Callable[[], CoordinatorLink | None] | None = None,
        poll_timeout_s: float = 5.0,
    ) -> None:
        self.agent = agent
        self.colocated = colocated
        ray = ray_context()
        # How long this replica may take after a window to hand in its files (engine stop,
        # then the flush wait): a timed session's deadline leaves at least this much.
        stop_s = getattr(getattr(agent.engine, "timeouts", None), "stop_s", 0.0)
        info = agent.describe().to_agent_info(
            agent_id=f"rollout-{agent.replica_index}-{uuid.uuid4().hex[:8]}",
            hostname=socket.gethostname(),
            pid=os.getpid(),
            node_id=ray.node_id,
            node_ip=ray.node_ip,
            replicas=replicas,
            colocated=colocated,
            collect_budget_s=int(stop_s + agent.flush.timeout_s) + 1,
        )
        # the process hosting this replica's agent: a dead host is lost within seconds
        self.info = replace(
            info,
            pid_start=process_start(os.getpid()),
            job_id=ray.job_id,
            thread_id=threading.get_native_id(),
        )
        self._windows: dict[str, _Window] = {}
        self._finished: set[str] = set()
        self._phase: tuple[int | None, ControllerPhase | None] = (None, None)
        self._work: queue.Queue[AgentPlan | _Collected | None] = queue.Queue()
        self._collector = _Collector(agent, self._work.put)
        self._closing = False
        self._timed: list[threading.Thread] = []
        self._timed_stop: dict[str, threading.Event] = {}
        self._channel = Channel(
            self.info,
            find_link or default_link_finder(),
            lambda: None,  # no step of its own: the job's step is its driver's
            self._work.put,
            poll_timeout_s=poll_timeout_s,
        )
        self._worker = threading.Thread(target=self._loop, name="profd-rollout", daemon=True)

    def start(self) -> RolloutService:
        self._worker.start()
        self._channel.start()
        return self

    @property
    def connected(self) -> bool:
        return self._channel.connected

    def close(self, timeout: float = 60.0) -> None:
        """Finish any open window, report, and stop."""
        self._work.put(None)
        self._worker.join(timeout)
        for stop in list(self._timed_stop.values()):
            stop.set()  # a timed window still open ends now and reports what it has
        for t in self._timed:
            t.join(timeout)
        if self._channel.connected:
            self._channel.leave()
            self._emit(AgentEvent(EventKind.CLOSED))
            self._channel.flush(min(10.0, timeout))
        self._channel.stop()

    # -- worker thread ----------------------------------------------------------------------
    def _emit(self, event: AgentEvent) -> None:
        self._channel.send(event)

    def _loop(self) -> None:
        while True:
            item = self._work.get()
            try:
                if item is None:
                    self._closing = True
                    for w in list(self._windows.values()):
                        self._end(w, "the replica's agent closed before these steps")
                elif isinstance(item, _Collected):
                    self._on_collected(item)
                elif not self._closing:
                    self._handle(item)
            except Exception:  # never let a bug stop the replica's agent
                log.exception("profd: rollout agent of replica %d failed", self.agent.replica_index)
            if self._closing and not any(w.collecting for w in self._windows.values()):
                return  # every window reported (the collections' outcomes came back)

    def _handle(self, plan: AgentPlan) -> None:
        wanted = {w.session_id: w for w in plan.windows}
        for sid, w in list(self._windows.items()):
            if sid not in wanted:
                self._end(w, "the session ended before these steps")
        for sid, stop in list(self._timed_stop.items()):
            if sid not in wanted:  # cancelled (or expired): stop the engine now
                stop.set()
        for sid, window in wanted.items():
            if sid in self._windows or sid in self._finished:
                continue
            self._emit(AgentEvent(EventKind.ARMED, sid))
            if window.duration_s is not None:
                self._finished.add(sid)
                self._timed_stop[sid] = threading.Event()
                t = threading.Thread(target=self._timed_window, args=(window,), daemon=True)
                self._timed.append(t)
                t.start()
                continue
            group_of = {s: g for g in window.groups for s in g}
            self._windows[sid] = _Window(window, group_of)
        phase = (plan.controller_step, plan.controller_phase)
        if phase != self._phase and phase[0] is not None and phase[1] is not None:
            self._phase = phase
            step, now = int(phase[0]), ControllerPhase(phase[1])
            for w in list(self._windows.values()):
                if w.ended is not None:  # its session is over; its files are being collected
                    continue
                done = PhaseDone(step, now)
                sid = w.plan.session_id
                confirm = _Confirm(self._emit, AgentEvent(EventKind.PHASE, sid, step, payload=done))
                self._on_phase(w, step, now, confirm)
                confirm()  # once: a window that ended confirmed when its engine stopped

    # -- step windows ------------------------------------------------------------------------
    def _on_phase(
        self, w: _Window, step: int, phase: ControllerPhase, confirm: Callable[[], None]
    ) -> None:
        P = ControllerPhase
        starts = phase is (P.ROLLOUT_BEGIN if self.colocated else P.STEP_BEGIN)
        ends = phase is (P.ROLLOUT_END if self.colocated else P.STEP_END)
        for s in w.plan.steps:
            if (
                s < step
                and s not in w.recorded
                and s not in w.missed
                and s not in w.collecting
                and (w.open_group is None or s not in w.open_group)
            ):
                w.missed[s] = "the driver's step passed before the replica's window could start"
        if starts and step in w.group_of and w.open_group is None and step not in w.missed:
            self._start(w, step)
        elif ends and w.open_group is not None and step in w.open_group:
            if step == w.open_group[-1] or step + 1 not in w.plan.steps:
                self._finish(w, confirm)
        elif (
            phase is P.STEP_END
            and self.colocated
            and step in w.group_of
            and w.open_group is None
            and step not in w.recorded
            and step not in w.collecting
        ):
            w.missed[step] = (
                "colocated replica: mark generation with profd.controller().rollout() so "
                "the engine's window closes before training stages"
            )
        if w.resolved and w.open_group is None and not w.collecting:
            self._done(w)

    def _options(self, window: WindowPlan) -> EngineProfileOptions:
        return EngineProfileOptions.from_tool_config(window.tool, window.tool_config)

    def _start(self, w: _Window, step: int) -> None:
        window = w.plan
        mode = WindowMode.DISCRETE if window.discrete else WindowMode.CONTINUOUS
        group = tuple(s for s in w.group_of[step] if s >= step)
        try:
            started = self.agent.start_window(
                window.session_id,
                window.save_dir,
                self._options(window),
                window.keep_global_ranks,
                mode,
                steps=group,
            )
        except ValueError as exc:  # options the engine cannot take
            started = None
            reason = str(exc)
        if started is not None and started.ok:
            w.open_group = group
            w.warnings.extend(started.warnings)
            self._emit(AgentEvent(EventKind.RECORDING, window.session_id, step))
            return
        reason = started.reason if started is not None else reason
        if started is not None:  # the agent keeps a failed window open: close it
            self._report(w, self.agent.finish_window(window.session_id), (step,))
        for s in w.group_of[step]:
            w.missed.setdefault(s, reason)

    def _finish(self, w: _Window, on_stopped: Callable[[], None] | None = None) -> None:
        group, w.open_group = w.open_group or (), None
        sid = w.plan.session_id
        # "collecting" once the engine stopped, never before: the driver reads a replica
        # collecting the session's last step as done recording (DriverTable's _holds)
        collecting = _Confirm(self._emit, AgentEvent(EventKind.COLLECTING, sid))

        def stopped() -> None:
            collecting()
            if on_stopped is not None:
                on_stopped()

        result = self.agent.stop_window(sid, stopped)
        collecting()  # (no window was open: nothing was stopped)
        if isinstance(result, WindowOutcome):  # nothing to collect
            self._collected(w, result, group)
            return
        w.collecting.update(group)
        self._collector.submit(sid, group, result)

    def _on_collected(self, c: _Collected) -> None:
        w = self._windows.get(c.session_id)
        if w is None:  # (never: a window collecting is not done)
            log.error("profd: a collection came back for session %s, not open", c.session_id)
            return
        w.collecting.difference_update(c.group)
        self._collected(w, c.outcome, c.group)
        if w.collecting:
            return
        if w.ended is not None:
            self._end(w, w.ended)
        elif w.resolved and w.open_group is None:
            self._done(w)

    def _collected(self, w: _Window, outcome: WindowOutcome, group: tuple[int, ...]) -> None:
        if self._report(w, outcome, group):
            w.recorded.update(group)
        else:
            for s in group:
                w.missed.setdefault(s, outcome.reason or "the engine wrote no trace")

    def _report(self, w: _Window, outcome: WindowOutcome, steps: tuple[int, ...]) -> bool:
        """Send the outcome's trace / error events; keep its summary for ``part_done``."""
        for ev in outcome.events(w.plan.tool, list(steps), self.info.node_id):
            if isinstance(ev.payload, PartDone):
                w.kept_in_subdir.extend(ev.payload.kept_in_subdir)
                w.incomplete.extend(ev.payload.incomplete)
                w.warnings.extend(ev.payload.warnings)
                continue
            self._emit(ev)
        return bool(outcome.traces)

    def _end(self, w: _Window, reason: str) -> None:
        if w.open_group is not None:
            self._finish(w)
        w.ended = reason
        if w.collecting:
            return  # done once its files are collected (_on_collected)
        for s in w.plan.steps:
            if s not in w.recorded:
                w.missed.setdefault(s, reason)
        self._done(w)

    def _done(self, w: _Window) -> None:
        if w.done:
            return
        w.done = True
        sid = w.plan.session_id
        self._windows.pop(sid, None)
        self._finished.add(sid)
        for reason in sorted(set(w.missed.values())):
            steps = sorted(s for s, r in w.missed.items() if r == reason)
            missed = StepsMissed(tuple(steps))
            self._emit(AgentEvent(EventKind.MISSED, sid, steps[0], reason, missed))
        done = PartDone(
            recorded=tuple(sorted(w.recorded)),
            missed=tuple(sorted(w.missed)),
            kept_in_subdir=tuple(w.kept_in_subdir),
            incomplete=tuple(w.incomplete),
            warnings=tuple(w.warnings),
        )
        self._emit(AgentEvent(EventKind.PART_DONE, sid, payload=done))

    # -- timed windows -------------------------------------------------------------------------
    def _timed_window(self, window: WindowPlan) -> None:
        sid = window.session_id
        self._emit(AgentEvent(EventKind.RECORDING, sid))
        try:
            outcome = self.agent.run_window(
                sid,
                window.save_dir,
                self._options(window),
                window.duration_s or 0.0,
                window.keep_global_ranks,
                WindowMode.DISCRETE if window.discrete else WindowMode.CONTINUOUS,
                cancel=self._timed_stop[sid],
            )
            events = outcome.events(window.tool, [], self.info.node_id)
        except Exception as exc:
            events = [
                AgentEvent(EventKind.ERROR, sid, None, f"{type(exc).__name__}: {exc}"),
                AgentEvent(EventKind.PART_DONE, sid, payload=PartDone()),
            ]
        finally:
            self._timed_stop.pop(sid, None)  # the window is over: nothing left to stop
        for ev in events:
            self._emit(ev)


def attach_rollout(
    replica: int,
    parallelism: Any,
    engine: Any,
    *,
    replicas: int | None = None,
    trace_dir: str | None = None,
    colocated: bool = False,
    **kwargs: Any,
) -> RolloutService:
    """Register a rollout replica with profd and start driving its engine's profiler.

    ``parallelism`` is ``(tp, dp, pp)`` (or a mapping); ``engine`` a
    :class:`~profd.rollout.engines.VllmHttpEngine`, :class:`SglangHttpEngine` or
    :class:`InProcessEngine`; ``trace_dir`` where a vLLM engine was launched to write.
    """
    find_link = kwargs.pop("find_link", None)
    poll = kwargs.pop("poll_timeout_s", 5.0)
    agent = RolloutAgent(replica, parallelism, engine, trace_dir=trace_dir, **kwargs)
    return RolloutService(
        agent, replicas=replicas, colocated=colocated, find_link=find_link, poll_timeout_s=poll
    ).start()
