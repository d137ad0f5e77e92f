"""The agent's link to the coordinator, run entirely on background threads.

Two daemon threads per agent:

* the *poller* finds the coordinator by name, registers, then long-polls for plan changes
  (carrying the agent's current step) and installs each new plan as an immutable snapshot
  the training thread reads without locking;
* the *reporter* sends queued events in batches, and about once a second adds the step and
  stage durations the marks measured meanwhile (``take_times``; one ``times`` event riding
  the same reports, never a call per step).

A missing or restarting coordinator is normal: the poller retries discovery with back-off,
re-registers when the coordinator no longer knows the agent, and events wait in a bounded
queue. Nothing here ever raises into the training thread.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from profd.agent.clock_sync import ClockEstimate, estimate_offset
from profd.agent.stacks import read_stack
from profd.core.errors import CoordinatorUnavailable
from profd.core.protocol import (
    AgentEvent,
    AgentInfo,
    AgentPlan,
    EventKind,
    MarkDurations,
    PollReply,
    StackSample,
)
from profd.core.ray_env import call_coordinator, current_address, find_coordinator

__all__ = [
    "Channel",
    "CoordinatorLink",
    "LinkDown",
    "LinkMoved",
    "RayLink",
    "Registration",
    "find_ray_link",
]

log = logging.getLogger(__name__)

#: How often an agent measures its clock offset again (clocks drift slowly; NTP steps are
#: rare): a few round trips every five minutes.
CLOCK_EVERY_S = 300.0

_MAX_QUEUED_EVENTS = 100_000
#: How often the reporter takes the marks' durations (while connected): how live the
#: coordinator's step times are, and the most ``times`` events an agent sends per second.
TIMES_EVERY_S = 1.0
#: After this long without finding a coordinator, an agent that never registered says so
#: (once): a job whose ray.init() found no cluster runs on a Ray of its own, silently.
ABSENT_WARN_S = 30.0
#: How long a closing agent's poller, answered "unknown", waits for the coordinator's word
#: that it took the `closed` event before it registers again instead.
LEAVE_WAIT_S = 2.0
#: Failed takes of the step and stage times in a row after which the reporter stops taking.
MAX_TIMES_FAILURES = 5


class LinkDown(Exception):
    """The coordinator cannot be reached right now (absent, restarting, dead)."""


class LinkMoved(LinkDown):
    """A better link exists now (a node's relay is back): connect again, without back-off."""


class Registration(Protocol):
    plan: AgentPlan
    poll_timeout_s: float


class CoordinatorLink(Protocol):
    """Blocking calls to the coordinator; raise :class:`LinkDown` when it is unreachable."""

    def register(self, info: AgentInfo, step: int | None) -> Registration: ...

    def poll(self, agent_id: str, version: int, step: int | None, timeout: float) -> PollReply: ...

    def report(self, agent_id: str, events: list[AgentEvent]) -> bool: ...

    def clock_ns(self) -> int: ...


class RayLink:
    """:class:`CoordinatorLink` over a Ray actor handle."""

    def __init__(self, handle: Any, call_timeout_s: float = 30.0) -> None:
        self._handle = handle
        self._timeout = call_timeout_s

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        try:
            return call_coordinator(self._handle, method, *args, timeout=timeout or self._timeout)
        except CoordinatorUnavailable as exc:
            raise LinkDown(str(exc)) from exc

    def register(self, info: AgentInfo, step: int | None) -> Registration:
        return self._call("register", info, step)

    def poll(self, agent_id: str, version: int, step: int | None, timeout: float) -> PollReply:
        return self._call("poll", agent_id, version, step, timeout, timeout=timeout + self._timeout)

    def report(self, agent_id: str, events: list[AgentEvent]) -> bool:
        return self._call("report", agent_id, events)

    def clock_ns(self) -> int:
        return self._call("clock_ns", timeout=5.0)


def find_ray_link() -> RayLink | None:
    """The coordinator by its fixed name, or ``None`` when Ray is down or it does not exist."""
    handle = find_coordinator()
    return RayLink(handle) if handle is not None else None


class Channel:
    """Background poller and reporter for one agent."""

    def __init__(
        self,
        info: AgentInfo,
        find_link: Callable[[], CoordinatorLink | None],
        current_step: Callable[[], int | None],
        install_plan: Callable[[AgentPlan], None],
        *,
        poll_timeout_s: float = 5.0,
        retry_s: tuple[float, float] = (0.5, 5.0),
        now_ns: Callable[[], int] = time.time_ns,
        take_times: Callable[[], MarkDurations | None] | None = None,
        times_every_s: float = TIMES_EVERY_S,
        absent_warn_s: float = ABSENT_WARN_S,
        on_down: Callable[[], None] = lambda: None,
    ) -> None:
        """``on_down``: poller thread, when a registered agent loses the coordinator (it is
        down, restarting, or forgot the agent); not when the agent moves between links."""
        self.info = info
        self._on_down = on_down
        self._absent_warn_s = absent_warn_s
        #: This process's offset to the coordinator's clock (None until measured); traces
        #: written from now on carry it.
        self.clock: ClockEstimate | None = None
        self._now_ns = now_ns
        self._clock_due = 0.0
        self._find_link = find_link
        self._current_step = current_step
        self._install_plan = install_plan
        self._poll_timeout = poll_timeout_s
        self._retry_min, self._retry_max = retry_s
        self._link: CoordinatorLink | None = None
        self._version = 0
        self._events: queue.Queue[AgentEvent] = queue.Queue(maxsize=_MAX_QUEUED_EVENTS)
        self._registered = threading.Event()
        self._was_registered = False
        self._stop = threading.Event()
        #: The agent is closing (its ``closed`` event is queued) / the coordinator took that
        #: event: from then on it forgets the agent, which must not register again.
        self._leaving = threading.Event()
        self._left = threading.Event()
        self._dropped = 0
        self._seq = 0  # the last event number given (reporter thread)
        self._reregister = False
        #: Registrations so far (poller thread): an "unknown" answer to a report sent before
        #: the newest one is stale (the poller registered again meanwhile).
        self._generation = 0
        self._warned: set[str] = set()
        self._take_times = take_times
        self._times_every_s = times_every_s
        self._times_due = 0.0
        self._times_failures = 0
        self._stacks_answered = 0
        self._threads = [
            threading.Thread(target=self._poll_loop, name="profd-poller", daemon=True),
            threading.Thread(target=self._report_loop, name="profd-reporter", daemon=True),
        ]

    # -- public -------------------------------------------------------------------------
    def start(self) -> None:
        for t in self._threads:
            t.start()

    @property
    def connected(self) -> bool:
        return self._registered.is_set()

    def reachable(self, timeout: float) -> bool:
        """Registered now, or again within ``timeout`` when it was before (an agent moving to
        its node's relay, or re-registering, is between two links for a moment); ``False``
        at once for an agent that never reached the coordinator."""
        if self._registered.is_set():
            return True
        return self._was_registered and self._registered.wait(timeout)

    def leave(self) -> None:
        """The agent closes (its ``closed`` event comes next). Once the coordinator has it,
        it answers "unknown" for the agent (its relay drops it): a poll answered so then
        ends the poller instead of registering the agent again. One answered "unknown"
        before the coordinator took the event (a coordinator restarted) still registers
        again, so that the last events get through."""
        self._leaving.set()

    def update_info(self, info: AgentInfo) -> None:
        """Register again with new details (same agent id) at the next poll."""
        self.info = info
        self._reregister = True

    def send(self, event: AgentEvent) -> None:
        try:
            self._events.put_nowait(event)
        except queue.Full:
            self._dropped += 1
            self._warn_once("full", "profd: event queue full; events are being dropped")

    def flush(self, timeout: float) -> bool:
        """Wait until queued events are sent (or ``timeout``); True when the queue is empty."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._events.unfinished_tasks == 0:
                return True
            time.sleep(0.02)
        return self._events.unfinished_tasks == 0

    def stop(self, timeout: float = 2.0) -> None:
        """Stop both threads. The reporter is joined (it may be sending the last events); the
        poller may sit in a long-poll and exits on its own when it returns."""
        self._stop.set()
        reporter = self._threads[1]
        if reporter.is_alive():
            reporter.join(timeout)

    # -- internals ----------------------------------------------------------------------
    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _backoff(self, attempt: int) -> None:
        self._stop.wait(min(self._retry_max, self._retry_min * (2 ** min(attempt, 6))))

    def _connect(self) -> CoordinatorLink | None:
        link = self._find_link()
        if link is None:
            return None
        reg = link.register(self.info, self._current_step())
        self._poll_timeout = float(getattr(reg, "poll_timeout_s", self._poll_timeout))
        self._accept(reg.plan)
        self._generation += 1
        self._registered.set()
        self._was_registered = True
        log.info("profd: agent %s registered with the coordinator", self.info.agent_id)
        self._clock_due = 0.0  # a new coordinator (or the first): measure again now
        self._sync_clock(link)
        return link

    def _sync_clock(self, link: CoordinatorLink) -> None:
        """Measure the offset to the coordinator's clock when due (at registration, then
        every CLOCK_EVERY_S); a failure keeps the previous estimate."""
        if time.monotonic() < self._clock_due:
            return
        self._clock_due = time.monotonic() + CLOCK_EVERY_S
        try:
            estimate = estimate_offset(link.clock_ns, now_ns=self._now_ns)
        except LinkDown:
            raise
        except Exception as exc:  # an older coordinator without clock_ns, a bad answer
            self._warn_once("clock", "profd: cannot measure the clock offset (%s)", exc)
            return
        if estimate is not None:
            self.clock = estimate

    def _accept(self, plan: AgentPlan | None) -> None:
        if plan is None:
            return
        # A restarted coordinator may count versions from scratch: accept any change.
        if plan.version != self._version:
            self._version = plan.version
            if plan.stacks and plan.stacks != self._stacks_answered:
                self._answer_stacks(plan.stacks)
            self._install_plan(plan)

    def _answer_stacks(self, request: int) -> None:
        """Poller thread: send the training thread's stack for request ``request``."""
        self._stacks_answered = request
        try:
            sample = read_stack(request, self.info.thread_id)
        except Exception as exc:  # never let a stack request stop the poller
            sample = StackSample(request, (), error=f"reading the stack failed: {exc}")
        self.send(AgentEvent(EventKind.STACK, payload=sample))

    def _poll_loop(self) -> None:
        attempt = 0
        started = time.monotonic()
        while not self._stop.is_set():
            try:
                if self._link is None:
                    self._link = self._connect()
                    if self._link is None:
                        self._say_absent(time.monotonic() - started)
                        attempt += 1
                        self._backoff(attempt)
                        continue
                    attempt = 0
                if self._reregister:
                    self._reregister = False
                    self._link.register(self.info, self._current_step())
                    self._generation += 1
                    self._registered.set()  # (the reporter may be waiting for this one)
                self._sync_clock(self._link)
                reply = self._link.poll(
                    self.info.agent_id, self._version, self._current_step(), self._poll_timeout
                )
                if not reply.known:
                    self._lost()
                    self._forget_link()
                    # closing: the answer may come from the coordinator that just took the
                    # `closed` event, whose acknowledgement is on its way to the reporter
                    if self._leaving.is_set() and self._left.wait(LEAVE_WAIT_S):
                        return  # closed, and the coordinator knows it
                    continue
                self._accept(reply.plan)
            except LinkMoved as exc:
                self._registered.clear()
                self._forget_link()
                log.info("profd: agent %s: %s; connecting again", self.info.agent_id, exc)
            except LinkDown as exc:
                self._lost()
                self._forget_link()
                if self._stop.is_set():
                    return  # shutting down: the coordinator going away is expected
                self._warn_once("down", "profd: coordinator unreachable (%s); retrying", exc)
                attempt += 1
                self._backoff(attempt)
            except Exception:
                self._lost()
                self._forget_link()
                if self._stop.is_set():
                    return
                if "poll" not in self._warned:
                    self._warned.add("poll")
                    log.exception("profd: plan poll failed; retrying")
                attempt += 1
                self._backoff(attempt)
        self._forget_link()  # stopped

    def _lost(self) -> None:
        """Poller thread: not registered any more; the agent is told once per loss (not
        while it is leaving: then the coordinator forgetting it is the point)."""
        was = self._registered.is_set()
        self._registered.clear()
        if was and not self._leaving.is_set() and not self._stop.is_set():
            try:
                self._on_down()
            except Exception:  # the poller goes on whatever the agent does with it
                log.debug("profd: the agent's on_down failed", exc_info=True)

    def _say_absent(self, waited_s: float) -> None:
        if self._was_registered or waited_s < self._absent_warn_s:
            return
        where = current_address()
        self._warn_once(
            "absent",
            "profd: agent %s found no profd coordinator in %.0f s (Ray cluster %s); it "
            "stays inert until one appears. Is `profd up` running on this cluster? A job "
            "joins profd's cluster with ray.init(address=...) or RAY_ADDRESS (`profd status` "
            "prints it)",
            self.info.agent_id,
            waited_s,
            where or "none: this process joined no Ray cluster",
        )

    def _forget_link(self) -> None:
        """Poller thread: drop the link (closing what it holds open, a relay socket's
        connections; a report in flight on it ends first)."""
        link, self._link = self._link, None
        close = getattr(link, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # nothing to keep from a link being dropped
                log.debug("profd: closing a link failed", exc_info=True)

    def _drain(self, first: AgentEvent) -> list[AgentEvent]:
        """The next batch, each event numbered (sent again as is until it is taken)."""
        batch = [first]
        while len(batch) < 1000:
            try:
                batch.append(self._events.get_nowait())
            except queue.Empty:
                break
        seq = self._seq
        for i, ev in enumerate(batch):
            seq += 1
            batch[i] = dataclasses.replace(ev, seq=seq)
        self._seq = seq
        return batch

    def _queue_times(self) -> None:
        """Queue a ``times`` event when one is due: only while registered, so a ring the
        coordinator cannot receive keeps its newest samples (and counts the rest lost)
        instead of events piling up here."""
        if self._take_times is None or not self._registered.is_set():
            return
        now = time.monotonic()
        if now < self._times_due:
            return
        self._times_due = now + self._times_every_s
        try:
            times = self._take_times()
        except Exception:
            self._times_failures += 1
            if "times" not in self._warned:
                self._warned.add("times")
                log.exception("profd: taking step and stage times failed; trying again")
            if self._times_failures >= MAX_TIMES_FAILURES:  # broken for good: stop trying
                log.warning("profd: step and stage times failed %d times in a row; they stop "
                            "here", self._times_failures)  # fmt: skip
                self._take_times = None
            return
        self._times_failures = 0
        if times is not None:  # with the step marked last (a trigger's evidence says it)
            self.send(AgentEvent(EventKind.TIMES, step=self._current_step(), payload=times))

    def _report_loop(self) -> None:
        pending: list[AgentEvent] = []
        attempt = 0
        while True:
            if not pending:
                self._queue_times()
                try:
                    first = self._events.get(timeout=0.2)
                except queue.Empty:
                    if self._stop.is_set():
                        return
                    continue
                pending = self._drain(first)
            link = self._link
            if link is None or not self._registered.is_set():
                if self._stop.is_set():
                    self._done(pending)
                    return
                self._registered.wait(0.5)
                continue
            generation = self._generation
            try:
                known = link.report(self.info.agent_id, pending)
            except Exception as exc:
                self._warn_once("report", "profd: sending events failed (%s); retrying", exc)
                attempt += 1
                if self._stop.is_set():
                    self._done(pending)
                    return
                self._backoff(attempt)
                continue
            if not known:
                # The coordinator does not know the agent: the poller registers it again (at
                # its next turn) and the events go then. An answer older than the newest
                # registration is not about it: clearing that registration left the agent
                # waiting for one that had already come, for good.
                if generation == self._generation:
                    self._registered.clear()
                    self._reregister = True
                continue
            if any(e.kind is EventKind.CLOSED for e in pending):
                self._left.set()
            self._done(pending)
            pending = []
            attempt = 0

    def _done(self, batch: list[AgentEvent]) -> None:
        for _ in batch:
            self._events.task_done()
