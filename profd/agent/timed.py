"""Timed windows (``duration_s``) of backends that need no training thread.

py-spy samples from outside, nsys capture ranges and CUDA allocator history are process-wide:
such a window starts at once on a thread of its own and stops after ``duration_s`` (or when
the session is cancelled), so a loop that is stalled — no marks at all — can still be
profiled. Windows of thread-bound backends (torch) are opened by the recorder at the next
mark instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from profd.agent.clock_sync import ClockEstimate
from profd.agent.export import trace_event
from profd.agent.specs import build_spec
from profd.agent.window_state import FinishedIds
from profd.backends import backend_class
from profd.backends.base import Backend
from profd.core.naming import TIMED_SCOPE
from profd.core.protocol import AgentEvent, AgentInfo, EventKind, PartDone, WindowPlan

__all__ = ["TimedWindows", "is_timed_thread_free"]

log = logging.getLogger(__name__)


def is_timed_thread_free(window: WindowPlan) -> bool:
    if window.duration_s is None:
        return False
    cls = backend_class(window.tool)
    return bool(cls is not None and cls.thread_free)


class TimedWindows:
    def __init__(
        self,
        info: Callable[[], AgentInfo],
        emit: Callable[[AgentEvent], None],
        make_backend: Callable[[str, dict[str, Any]], Backend],
        clock: Callable[[], ClockEstimate | None] = lambda: None,
    ) -> None:
        self._info = info
        self._emit = emit
        self._make_backend = make_backend
        self._clock = clock
        self._running: dict[str, tuple[threading.Thread, threading.Event]] = {}
        self._finished = FinishedIds()  # a window is run once, even while still planned
        self._lock = threading.Lock()

    def sync(self, windows: tuple[WindowPlan, ...]) -> None:
        """Start new thread-free timed windows; stop those whose session went away."""
        wanted = {w.session_id: w for w in windows if is_timed_thread_free(w)}
        with self._lock:
            for sid, (_, cancel) in self._running.items():
                if sid not in wanted:
                    cancel.set()
            for sid, window in wanted.items():
                if sid in self._running or sid in self._finished:
                    continue
                cancel = threading.Event()
                thread = threading.Thread(
                    target=self._run, args=(window, cancel), name="profd-timed", daemon=True
                )
                self._running[sid] = (thread, cancel)
                thread.start()

    def close(self, timeout: float) -> None:
        with self._lock:
            running = list(self._running.values())
        for _, cancel in running:
            cancel.set()
        for thread, _ in running:
            thread.join(timeout)

    def _run(self, window: WindowPlan, cancel: threading.Event) -> None:
        sid = window.session_id
        info = self._info()
        files, errors = [], []
        try:
            backend = self._make_backend(window.tool, window.tool_config)
            coll = backend.open(build_spec(info, window, TIMED_SCOPE, None, clock=self._clock()))
            self._emit(AgentEvent(EventKind.RECORDING, sid))
            cancel.wait(window.duration_s)
            outputs = coll.close()
            self._emit(AgentEvent(EventKind.COLLECTING, sid))
            for out in outputs:
                try:
                    files.extend(out.write())
                except Exception as exc:
                    errors.append(f"export failed: {type(exc).__name__}: {exc}")
        except Exception as exc:
            log.warning("profd: timed window of session %s failed: %r", sid, exc)
            errors.append(f"recording failed: {type(exc).__name__}: {exc}")
        for f in files:
            self._emit(trace_event(info.node_id, sid, [], TIMED_SCOPE, window.tool, f))
        for e in errors:
            self._emit(AgentEvent(EventKind.ERROR, sid, None, e))
        with self._lock:
            self._running.pop(sid, None)
            self._finished.add(sid)
        self._emit(AgentEvent(EventKind.PART_DONE, sid, payload=PartDone()))
