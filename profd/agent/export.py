"""The exporter thread: writes stopped collections to disk so the training loop never waits.

Jobs are written one at a time, in the order they were submitted (a torch window's Kineto
export then runs before the next window's, see ``profd.backends.torch_output.KinetoGate``).
A failed job is reported through ``on_done``; its traceback is logged once per session and
kind of failure, later ones of the same kind at debug level.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from profd.backends.base import HeldSteps, PendingOutput, WrittenFile
from profd.core.naming import trace_id_for
from profd.core.protocol import AgentEvent, EventKind, TraceWritten

__all__ = ["ExportJob", "Exporter", "trace_event"]

log = logging.getLogger(__name__)


def trace_event(
    node_id: str | None,
    session_id: str,
    steps: list[int],
    scope: str,
    tool: str,
    written: WrittenFile,
    stall_s: float = 0.0,
) -> AgentEvent:
    """The ``trace`` event announcing one written file."""
    path = str(written.path)
    written_at = TraceWritten(
        trace_id=trace_id_for(node_id, path),
        path=path,
        bytes=written.bytes,
        steps=tuple(steps),
        scope=scope,
        tool=tool,
        warnings=tuple(written.warnings),
        stall_s=round(stall_s, 6),
    )
    return AgentEvent(EventKind.TRACE, session_id, steps[0] if steps else None, payload=written_at)


@dataclass(frozen=True, slots=True)
class ExportJob:
    session_id: str
    steps: tuple[int, ...]
    scope: str
    tool: str
    output: PendingOutput
    #: Whatever the submitter needs back in the callback (the recorder's ticket).
    context: Any = None
    #: What the file holds of the loop's steps, for its header (see
    #: :meth:`PendingOutput.write`); ``None``: not counted.
    held: HeldSteps | None = None


class Exporter:
    """One daemon thread writing :class:`ExportJob` s in order.

    ``on_done(job, files, error)`` is called on this thread after every job; ``error`` is the
    failure message or ``None``.
    """

    def __init__(self, on_done: Callable[[ExportJob, list[WrittenFile], str | None], None]) -> None:
        self._on_done = on_done
        self._jobs: queue.Queue[ExportJob | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._failures_logged: set[tuple[str, str]] = set()

    def submit(self, job: ExportJob) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="profd-exporter", daemon=True
                )
                self._thread.start()
        self._jobs.put(job)

    def drain(self, timeout: float) -> bool:
        """Wait until every submitted job is written; True when none is left."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._jobs.unfinished_tasks == 0:
                return True
            time.sleep(0.02)
        return self._jobs.unfinished_tasks == 0

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                self._write(job)
            except Exception:  # the callback itself must never kill the thread
                log.exception("profd: exporter callback failed")
            finally:
                job = None  # drop the window's events before waiting for the next job
                self._jobs.task_done()

    def _write(self, job: ExportJob) -> None:
        started = time.perf_counter()
        try:
            files = job.output.write(job.held)
        except Exception as exc:
            self._log_failure(job, exc)
            self._on_done(job, [], f"export failed: {type(exc).__name__}: {exc}")
            return
        for f in files:
            log.info(
                "profd: trace saved to %s (%.1f MB, %.2f s)",
                f.path,
                f.bytes / 1e6,
                time.perf_counter() - started,
            )
        self._on_done(job, files, None)

    def _log_failure(self, job: ExportJob, exc: Exception) -> None:
        key = (job.session_id, type(exc).__name__)
        if key in self._failures_logged:
            log.debug("profd: writing a trace of session %s failed again: %r", job.session_id, exc)
            return
        self._failures_logged.add(key)
        log.warning(
            "profd: writing the trace of session %s failed (reported to the session; later "
            "failures of this kind are logged at debug level): %r",
            job.session_id,
            exc,
            exc_info=exc,
        )
