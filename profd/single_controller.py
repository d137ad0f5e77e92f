"""Single-controller drivers (verl style): the driver announces each step.

::

    ctl = profd.controller()
    for step in range(first, last):
        with ctl.step(step):
            ray.get([w.generate.remote(batch) for w in rollout])
            ray.get([w.update_actor.remote(batch) for w in actors])

Workers only mark stages. ``step(n)`` tells every agent of a live session that step ``n``
begins *before* any worker call of the step runs: the coordinator pushes the step into their
plans and waits until each has it (bounded; slow agents are named in the log). With no live
session nobody is contacted, so the driver pays one small RPC per step.

A worker's step-``n`` window closes at its first mark of a later step, or when its agent
closes — a worker has no thread of its own that could stop a profiler in between.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Controller", "controller"]

log = logging.getLogger(__name__)


class _ControllerStep:
    __slots__ = ("_ctl",)

    def __init__(self, ctl: Controller) -> None:
        self._ctl = ctl

    def __enter__(self) -> None:
        self._ctl._announce()

    def __exit__(self, *exc: Any) -> bool:
        return False


class Controller:
    def __init__(
        self, lookup: Callable[[], Any | None] | None = None, timeout_s: float = 10.0
    ) -> None:
        self._lookup = lookup
        self._timeout = timeout_s
        self._handle: Any | None = None
        self._step: int | None = None
        self._mark = _ControllerStep(self)
        self._warned: set[str] = set()
        self.last_reply: dict[str, Any] | None = None

    def step(self, step: int) -> _ControllerStep:
        """Mark one step of the job (the unit sessions count)."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step: must be an int, got {step!r}")
        self._step = step
        return self._mark

    def _find(self) -> Any | None:
        if self._handle is not None:
            return self._handle
        if self._lookup is not None:
            self._handle = self._lookup()
            return self._handle
        try:
            import ray

            if not ray.is_initialized():
                return None
            from profd.actors import get_coordinator

            self._handle = get_coordinator()
        except Exception:
            self._handle = None
        return self._handle

    def _announce(self) -> None:
        """Never raises: without a coordinator the driver simply goes on."""
        handle = self._find()
        if handle is None:
            return
        try:
            import ray

            ref = handle.controller_step.remote(self._step, self._timeout)
            self.last_reply = ray.get(ref, timeout=self._timeout + 30)
        except Exception as exc:
            self._handle = None
            key = type(exc).__name__
            if key not in self._warned:
                self._warned.add(key)
                log.warning("profd: announcing step %s failed (%r); going on", self._step, exc)
            return
        slow = self.last_reply.get("slow") if self.last_reply else None
        if slow and "slow" not in self._warned:
            self._warned.add("slow")
            log.warning("profd: step %s reached %d agent(s) late: %s", self._step, len(slow), slow)


_CONTROLLER: Controller | None = None
_LOCK = threading.Lock()


def controller() -> Controller:
    """The driver's controller (one per process)."""
    global _CONTROLLER
    with _LOCK:
        if _CONTROLLER is None:
            _CONTROLLER = Controller()
        return _CONTROLLER
