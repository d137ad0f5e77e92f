"""A CUDA out-of-memory error leaving a mark, reported as one ``oom`` event.

The error is told by its class name (``torch.cuda.OutOfMemoryError`` or a subclass) or its
"CUDA out of memory" message: torch is not imported for it. The event carries the
``torch_memory`` snapshot when such a window records. The mark re-raises the error either
way; a failure to report it is only logged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from profd.agent.window_state import ArmedPlan
from profd.core.protocol import AgentEvent, EventKind, OutOfMemory

__all__ = ["OOM_MESSAGE_CHARS", "OutOfMemoryReports", "is_out_of_memory"]

log = logging.getLogger(__name__)

#: What an ``oom`` event keeps of the error's message.
OOM_MESSAGE_CHARS = 2000


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA out-of-memory error: ``torch.cuda.OutOfMemoryError`` (or a subclass, by class
    name: torch is not imported here) or any error saying "CUDA out of memory"."""
    if any(c.__name__ == "OutOfMemoryError" for c in type(exc).__mro__):
        return True
    try:
        return "CUDA out of memory" in str(exc)
    except Exception:  # a __str__ that fails: not ours to judge
        return False


class OutOfMemoryReports:
    """One agent's out-of-memory reports: what its marks call when an error leaves them.

    ``armed``, ``active`` and ``step`` read the agent's armed plan, its recording scope
    (or None) and its current step when an error comes."""

    def __init__(
        self,
        emit: Callable[[AgentEvent], None],
        armed: Callable[[], ArmedPlan],
        active: Callable[[], Any],
        step: Callable[[], int | None],
    ) -> None:
        self._emit = emit
        self._armed = armed
        self._active = active
        self._step = step
        self._snapshots: set[Path] = set()  # torch_memory snapshots already reported

    def mark_error(self, exc: BaseException, stage: str | None) -> None:
        """Training thread: ``exc`` is leaving a mark. A CUDA out-of-memory error is
        reported once, at the innermost mark it leaves."""
        try:
            if not is_out_of_memory(exc) or getattr(exc, "_profd_oom_reported", False):
                return
            try:
                exc._profd_oom_reported = True  # type: ignore[attr-defined]
            except Exception:  # an error type without attributes: reported by every mark
                pass
            error = f"{type(exc).__name__}: {exc}"[:OOM_MESSAGE_CHARS]
            path = self._snapshot()
            log.warning("profd: out of memory in %s: %s", stage or "a step", error)
            payload = OutOfMemory(error=error, stage=stage, snapshot_path=path)
            event = AgentEvent(EventKind.OOM, None, self._step(), message=error, payload=payload)
            self._emit(event)
        except Exception:
            log.exception("profd: reporting an out-of-memory error failed")

    def _snapshot(self) -> str | None:
        """The ``torch_memory`` snapshot of this error, when such a window is armed: the one
        its OOM observer wrote (on CUDA, before the error is raised), else one the recording
        collection dumps now; None without one."""
        windows = [w for w in self._armed().plan.windows if w.tool == "torch_memory"]
        scope = self._active()
        dump = None
        if scope is not None and scope.ws.window.tool == "torch_memory":
            dump = getattr(scope.current, "dump_oom", None)
            windows.append(scope.ws.window)
        if not windows:
            return None
        dirs = {Path(w.save_dir) for w in windows}
        pattern = f"*_pid{os.getpid()}_*_oom*.pickle"

        def fresh() -> set[Path]:
            return {p for d in dirs if d.is_dir() for p in d.glob(pattern)} - self._snapshots

        new = fresh()
        if not new and dump is not None:
            dump()  # writes <stem>_oom<n>.pickle now (the job may not survive the error)
            new = fresh()
        if not new:
            return None
        self._snapshots |= new
        return str(max(new, key=lambda p: p.stat().st_mtime_ns))
