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
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

__all__ = ["Controller", "controller"]

log = logging.getLogger(__name__)


class _Caller(Protocol):
    def call(self, method: str, *args: Any, timeout: float) -> Any: ...


class _RayCaller:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def call(self, method: str, *args: Any, timeout: float) -> Any:
        import ray

        return ray.get(getattr(self.handle, method).remote(*args), timeout=timeout)


def _ray_lookup() -> _Caller | None:
    try:
        import ray

        if not ray.is_initialized():
            return None
        from profd.actors import get_coordinator

        handle = get_coordinator()
        return _RayCaller(handle) if handle is not None else None
    except Exception:
        return None


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
    def __init__(
        self,
        lookup: Callable[[], _Caller | None] | None = None,
        timeout_s: float = 10.0,
        rollout_timeout_s: float = 1800.0,
    ) -> None:
        self._lookup = lookup or _ray_lookup
        self._timeout = timeout_s
        #: A vLLM stop returns only once its traces are written: allow for slow flushes.
        self._rollout_timeout = rollout_timeout_s
        self._caller: _Caller | None = None
        self._step: int | None = None
        self._rollout = False  # the last announcement involved rollout replicas
        self._mark = _ControllerStep(self)
        self._warned: set[str] = set()
        self.last_reply: dict[str, Any] | None = None

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
            self._phase("rollout_begin")
        try:
            yield
        finally:
            if self._rollout:
                self._phase("rollout_end")

    # -- internals (never raise: without a coordinator the driver simply goes on) ----------------
    def _call(self, method: str, *args: Any, timeout: float) -> Any | None:
        if self._caller is None:
            self._caller = self._lookup()
            if self._caller is None:
                return None
        try:
            return self._caller.call(method, *args, timeout=timeout + 30)
        except Exception as exc:
            self._caller = None
            key = f"{method}:{type(exc).__name__}"
            if key not in self._warned:
                self._warned.add(key)
                log.warning("profd: %s for step %s failed (%r); going on", method, self._step, exc)
            return None

    def _announce(self) -> None:
        reply = self._call("controller_step", self._step, self._timeout, timeout=self._timeout)
        self.last_reply = reply
        self._rollout = bool(reply and reply.get("rollout"))
        slow = reply.get("slow") if reply else None
        if slow and "slow" not in self._warned:
            self._warned.add("slow")
            log.warning("profd: step %s reached %d agent(s) late: %s", self._step, len(slow), slow)

    def _phase(self, phase: str) -> None:
        self._call(
            "controller_phase",
            self._step,
            phase,
            self._rollout_timeout,
            timeout=self._rollout_timeout,
        )

    def _end_step(self) -> None:
        if self._rollout:
            self._phase("step_end")


_CONTROLLER: Controller | None = None
_LOCK = threading.Lock()


def controller() -> Controller:
    """The driver's controller (one per process)."""
    global _CONTROLLER
    with _LOCK:
        if _CONTROLLER is None:
            _CONTROLLER = Controller()
        return _CONTROLLER
