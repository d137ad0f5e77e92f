"""Single-controller drivers (verl style): the driver announces each step.

::

    ctl = profd.controller()
    for step in range(first, last):
        with ctl.step(step):
            with ctl.rollout():          # generation (rollout replicas profile inside it)
                ray.get([r.generate.remote(batch) for r in rollout])
            ray.get([w.update_actor.remote(batch) for w in actors])

Workers only mark stages. ``step(n)`` tells every agent of a live session that step ``n``
begins *before* any worker call of the step runs: the coordinator pushes the step into their
plans and waits until each has it (bounded; slow agents are named in the log). With no live
session nobody is contacted, so the driver pays one small RPC per step.

Rollout replicas (``profd.attach_rollout``) follow the same announcements: a replica on its
own devices records from step entry to exit; a replica colocated with training records
inside ``rollout()`` only, and the driver waits until its engine has stopped before training
stages run. ``rollout()`` costs nothing when no replica is profiled.

A worker's step-``n`` window closes at its first mark of a later step, or when its agent
closes — a worker has no thread of its own that could stop a profiler in between.

**Never in the driver's way.** Every call to the coordinator runs on one background thread
(``profd-controller``); the driver's thread only waits for its answer, at most
:attr:`ControllerConfig.step_budget_s` for a step. A call that fails or runs past its budget
opens the circuit (:class:`Link` ``OPEN``): later steps skip the announcement at the cost of
an attribute read, while the background thread looks the coordinator up again with back-off
and closes the circuit once it answers. A Ray whose GCS has gone away is noticed within
milliseconds (a TCP probe of its address) instead of waiting out the budget, and the driver's
thread never calls into Ray itself, so it cannot hang there.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from profd.core.protocol import DriverAck
from profd.core.ray_env import call_coordinator, find_coordinator, gcs_probe, ray_context
from profd.core.states import ControllerPhase

__all__ = ["Controller", "ControllerConfig", "Link", "LinkChange", "controller"]

log = logging.getLogger(__name__)


class ControllerConfig(BaseModel):
    """How a driver's controller talks to the coordinator (``profd.controller()``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    delivery_timeout_s: float = Field(
        1.0,
        gt=0,
        le=600,
        description="How long the coordinator waits for profiled agents to hold a new step "
        "before it answers (agents long-poll: delivery takes milliseconds when they are up).",
    )
    step_grace_s: float = Field(
        0.25,
        ge=0,
        le=60,
        description="Extra time the driver allows the answer to a step announcement on top "
        "of delivery_timeout_s; past delivery_timeout_s + step_grace_s the circuit opens.",
    )
    rollout_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="How long the driver waits for rollout engines to start / stop at a "
        "rollout phase (a vLLM stop returns only once its traces are written).",
    )
    backoff_initial_s: float = Field(
        0.5, gt=0, description="First wait before looking the coordinator up again."
    )
    backoff_max_s: float = Field(
        2.0,
        gt=0,
        description="Longest wait between two attempts to reconnect (the attempt's probe "
        "tells a coordinator that came back the job's step, which its sessions align on).",
    )
    gcs_probe_after_s: float = Field(
        0.02,
        gt=0,
        description="A call unanswered after this long makes the driver check, with a TCP "
        "connect, that Ray's GCS still answers; when it does not, the circuit opens at once.",
    )
    gcs_watch_s: float = Field(
        0.1,
        ge=0,
        description="How often a background thread checks (TCP connect) that Ray's GCS "
        "answers; while it does not, announcements are skipped even though the coordinator "
        "itself may still answer (a cluster losing its GCS is going down). 0 turns it off.",
    )

    @property
    def step_budget_s(self) -> float:
        """The most one step announcement may add to a driver's step."""
        return self.delivery_timeout_s + self.step_grace_s


class Link(enum.Enum):
    """Whether announcements reach the coordinator."""

    CLOSED = "closed"  # calls go through (the circuit is closed)
    OPEN = "open"  # the last call failed: skip, reconnect in the background


@dataclass(frozen=True)
class LinkChange:
    """One transition of the controller's link, kept in :attr:`Controller.history`."""

    at: float
    to: Link
    why: str


class _Caller(Protocol):
    def call(self, method: str, *args: Any, timeout: float) -> Any: ...


class _RayCaller:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def call(self, method: str, *args: Any, timeout: float) -> Any:
        return call_coordinator(self.handle, method, *args, timeout=timeout)


def _ray_lookup() -> _Caller | None:
    """The coordinator, or ``None``; runs on the daemon thread, whose caller counts any
    exception as a failed attempt (and backs off)."""
    handle = find_coordinator()
    return _RayCaller(handle) if handle is not None else None


class _Unanswered(Exception):
    """The coordinator did not answer within the budget (or Ray's GCS is gone)."""


class _ControllerStep:
    __slots__ = ("_ctl",)

    def __init__(self, ctl: Controller) -> None:
        self._ctl = ctl

    def __enter__(self) -> None:
        self._ctl._announce()

    def __exit__(self, *exc: Any) -> bool:
        self._ctl._end_step()
        return False


class Controller:
    """The driver's side of step announcements; see the module docstring.

    ``lookup`` finds the coordinator (``None`` when there is none); ``gcs_address`` gives
    the GCS address to probe when a call is slow (``None``: no probe). Both run on the
    background thread only.
    """

    def __init__(
        self,
        lookup: Callable[[], _Caller | None] | None = None,
        timeout_s: float | None = None,
        rollout_timeout_s: float | None = None,
        *,
        config: ControllerConfig | None = None,
        gcs_address: Callable[[], str | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        cfg = config or ControllerConfig()
        overrides: dict[str, float] = {}
        if timeout_s is not None:
            overrides["delivery_timeout_s"] = timeout_s
        if rollout_timeout_s is not None:
            overrides["rollout_timeout_s"] = rollout_timeout_s
        self.config = cfg.model_copy(update=overrides) if overrides else cfg
        self._lookup = lookup or _ray_lookup
        in_ray = lookup is None  # the real coordinator: this process's Ray says where it is
        self._gcs_address = gcs_address or (
            (lambda: ray_context().gcs_address) if in_ray else lambda: None
        )
        self._job_of = (lambda: ray_context().job_id) if in_ray else (lambda: None)
        self._job: str | None = None
        self._clock = clock
        self._caller: _Caller | None = None
        self._gcs: str | None = None
        self._gcs_down = False  # set by the watcher thread
        self._watcher: threading.Thread | None = None
        self._closed = threading.Event()
        self._step: int | None = None
        self._rollout = False  # the last announcement involved rollout replicas
        self._mark = _ControllerStep(self)
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._pool = _DaemonWorker("profd-controller")
        self._busy: concurrent.futures.Future[Any] | None = None  # the call in flight, if any
        self._retry_at = 0.0
        self._backoff = self.config.backoff_initial_s
        self.link = Link.CLOSED
        self.history: list[LinkChange] = []
        self.last_reply: DriverAck | None = None

    # -- the driver's surface ------------------------------------------------------------
    def step(self, step: int) -> _ControllerStep:
        """Mark one step of the job (the unit sessions count)."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step: must be an int, got {step!r}")
        self._step = step
        return self._mark

    @contextlib.contextmanager
    def rollout(self) -> Iterator[None]:
        """Mark generation inside the current step (colocated replicas record only here)."""
        if self._rollout:
            self._phase(ControllerPhase.ROLLOUT_BEGIN)
        try:
            yield
        finally:
            if self._rollout:
                self._phase(ControllerPhase.ROLLOUT_END)

    # -- internals (never raise: without a coordinator the driver simply goes on) ----------------
    def _announce(self) -> None:
        cfg = self.config
        reply = self._call(
            "controller_step", self._step, cfg.delivery_timeout_s, budget=cfg.step_budget_s
        )
        self.last_reply = reply
        self._rollout = bool(reply and reply.rollout)
        slow = reply.slow if reply else None
        if slow and "slow" not in self._warned:
            self._warned.add("slow")
            log.warning("profd: step %s reached %d agent(s) late: %s", self._step, len(slow), slow)

    def _phase(self, phase: ControllerPhase) -> None:
        timeout = self.config.rollout_timeout_s
        self._call("controller_phase", self._step, phase, timeout, budget=timeout + 30)

    def _end_step(self) -> None:
        if self._rollout:
            self._phase(ControllerPhase.STEP_END)

    def _call(self, method: str, *args: Any, budget: float) -> Any | None:
        """Ask the coordinator on the background thread; wait at most ``budget``."""
        if self._gcs_down and self.link is Link.CLOSED:
            gone = _Unanswered(f"Ray's GCS at {self._gcs} does not answer")
            self._trip(f"{method} for step {self._step}: {gone!r}", method, gone)
        if self.link is Link.OPEN:
            self._kick()
            return None
        busy = self._busy
        if busy is not None and not busy.done():  # an abandoned call still runs
            return None
        fut = self._pool.submit(self._remote, method, args, budget)
        self._busy = fut
        try:
            return self._wait(fut, budget)
        except Exception as exc:
            self._trip(f"{method} for step {self._step}: {exc!r}", method, exc)
            return None

    def _remote(self, method: str, args: tuple[Any, ...], budget: float) -> Any:
        """On the background thread: find the coordinator if needed, then call it."""
        if self._caller is None:
            self._gcs = self._gcs_address()  # local: known before the lookup may hang
            self._job = self._job_of()
            self._watch_gcs()
            self._caller = self._lookup()
            if self._caller is None:
                raise LookupError("no profd coordinator is running")
        try:
            return self._caller.call(method, *args, self._job, timeout=budget)
        except Exception:
            self._caller = None
            raise

    def _wait(self, fut: concurrent.futures.Future[Any], budget: float) -> Any:
        """Wait for ``fut`` on the driver's thread; give up early when the GCS is gone."""
        deadline = self._clock() + budget
        first = min(self.config.gcs_probe_after_s, budget)
        try:
            return fut.result(timeout=first)
        except concurrent.futures.TimeoutError:
            pass
        while True:
            gcs = self._gcs
            if gcs is not None and gcs_probe(gcs, 0.25) is False:  # refused: nothing listens
                raise _Unanswered(f"Ray's GCS at {gcs} does not answer")
            left = deadline - self._clock()
            if left <= 0:
                raise _Unanswered(f"no answer within {budget:.2f} s")
            try:
                return fut.result(timeout=min(left, 0.5))
            except concurrent.futures.TimeoutError:
                continue

    def _trip(self, why: str, method: str, exc: Exception) -> None:
        with self._lock:
            if self.link is Link.OPEN:
                return
            self._rollout = False
            self.link = Link.OPEN
            self._retry_at = self._clock() + self._backoff
            self.history.append(LinkChange(self._clock(), Link.OPEN, why))
        key = f"{method}:{type(exc).__name__}"
        if key not in self._warned:
            self._warned.add(key)
            if isinstance(exc, LookupError):
                log.info("profd: %s; the driver goes on and looks again in the background", exc)
            else:
                log.warning("profd: %s failed; the driver goes on without profd for now", why)

    def _kick(self) -> None:
        """While the circuit is open: start one reconnect attempt when it is due."""
        busy = self._busy
        if (busy is not None and not busy.done()) or self._clock() < self._retry_at:
            return
        self._busy = self._pool.submit(self._reconnect)

    def _reconnect(self) -> None:
        """On the background thread: one attempt to reach the coordinator again. The probe
        is the announcement of the driver's latest step, so the coordinator learns it."""
        cfg = self.config
        try:
            if self._gcs_down:
                raise _Unanswered(f"Ray's GCS at {self._gcs} does not answer")
            self._remote("controller_step", (self._step, 0.0), cfg.step_budget_s)
        except Exception as exc:
            with self._lock:
                self._backoff = min(self._backoff * 2, cfg.backoff_max_s)
                self._retry_at = self._clock() + self._backoff
            log.debug("profd: reconnect failed (%r); next try in %.1f s", exc, self._backoff)
            return
        with self._lock:
            self._backoff = cfg.backoff_initial_s
            self.link = Link.CLOSED
            self.history.append(LinkChange(self._clock(), Link.CLOSED, "coordinator answered"))
        log.info("profd: the coordinator answers again; step announcements resume")

    def _watch_gcs(self) -> None:
        """Start the GCS watcher once the GCS address is known (on the background thread)."""
        every = self.config.gcs_watch_s
        if self._gcs is None or every <= 0 or self._watcher is not None:
            return
        gcs = self._gcs

        def watch() -> None:
            # down once the connection is refused, or after 3 probes in a row get no answer:
            # one lost packet or a slow far head must not stop the announcements
            silent = 0
            while not self._closed.wait(every):
                seen = gcs_probe(gcs, max(every, 0.25))
                silent = 0 if seen is not None else silent + 1
                self._gcs_down = seen is False or silent >= 3

        self._watcher = threading.Thread(target=watch, name="profd-gcs-watch", daemon=True)
        self._watcher.start()

    def close(self) -> None:
        """Stop the background threads (a call in flight is left to finish on its own)."""
        self._closed.set()
        self._pool.close()


class _DaemonWorker:
    """One daemon thread running submitted calls in order. Not a ThreadPoolExecutor: the
    interpreter joins those at exit, so a call stuck in Ray (its GCS gone) would keep the
    driver from exiting."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:
                fut.set_exception(exc)

    def close(self) -> None:
        self._queue.put(None)


_CONTROLLER: Controller | None = None
_LOCK = threading.Lock()


def controller() -> Controller:
    """The driver's controller (one per process)."""
    global _CONTROLLER
    with _LOCK:
        if _CONTROLLER is None:
            _CONTROLLER = Controller()
        return _CONTROLLER
