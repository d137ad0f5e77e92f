"""Which thread may stop a torch window, and the one window a process may record at once.

torch.profiler is process-wide, and a window's state belongs to the thread that started it:
only that thread can stop it. Stopped elsewhere, ``stop()`` finds no session and returns an
empty result whose export crashes the process (a segmentation fault in
``export_chrome_trace``); a thread that ends with its profiler running crashes the process
at exit. :class:`OneProfilerPerProcess` keeps a second window from starting beside the first;
:class:`Orphans` holds the windows refused off their thread until a thread may stop them.
No torch import here.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Protocol

__all__ = ["ORPHANS", "OneProfilerPerProcess", "Orphans", "end_orphaned_windows", "orphaned_here"]

log = logging.getLogger(__name__)


class ThreadBoundWindow(Protocol):
    """A window that only the thread that started it can stop."""

    @property
    def opener(self) -> threading.Thread: ...

    def stop_discarding(self) -> None: ...


class OneProfilerPerProcess:
    """torch.profiler is process-wide: a second one in the same process corrupts the first
    (and can crash the process). profd refuses it instead."""

    lock = threading.Lock()
    holder: str | None = None

    #: The holder is a window refused off its thread, waiting for that thread (see Orphans).
    orphaned_on: str | None = None

    @classmethod
    def acquire(cls, who: str) -> None:
        with cls.lock:
            if cls.holder is not None and cls.orphaned_on is not None:
                raise RuntimeError(
                    f"a torch window of this process ({cls.holder}) was ended off its thread "
                    f"and still records until thread {cls.orphaned_on} marks again or ends; "
                    "no second window starts beside it"
                )
            if cls.holder is not None:
                raise RuntimeError(
                    f"another torch profiler window is open in this process ({cls.holder}); "
                    "attach the roles of one process to one agent (profd.attach once per "
                    "role in the same process shares it)"
                )
            cls.holder = who

    @classmethod
    def orphaned(cls, thread: str) -> None:
        with cls.lock:
            cls.orphaned_on = thread

    @classmethod
    def release(cls) -> None:
        with cls.lock:
            cls.holder = cls.orphaned_on = None


class Orphans:
    """Windows that could not be stopped where their end came (off the thread that started
    them, which still runs): each is stopped, its result discarded, on its own thread's next
    mark (:func:`end_orphaned_windows`, which the agent calls at the mark after a failure) or
    next window start, or by anyone once that thread has ended (and at exit). Until then it
    keeps the process's one profiler slot: no second Kineto trace starts beside it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[ThreadBoundWindow] = []
        self._at_exit = False

    def __bool__(self) -> bool:
        return bool(self._held)  # read without the lock: a hint, checked again under it

    def of(self, thread: threading.Thread) -> bool:
        """Whether one of them is ``thread``'s (read without the lock: a hint)."""
        return any(c.opener is thread for c in list(self._held))

    def add(self, coll: ThreadBoundWindow) -> None:
        with self._lock:
            self._held.append(coll)
            if not self._at_exit:
                self._at_exit = True
                atexit.register(self.reap)

    def reap(self) -> int:
        """Stop the windows this thread may stop now (its own, or whose thread ended)."""
        here = threading.current_thread()
        with self._lock:
            due = [c for c in self._held if c.opener is here or not c.opener.is_alive()]
            self._held = [c for c in self._held if c not in due]
        for coll in due:
            try:
                coll.stop_discarding()
            except Exception:  # each its own: one failure leaves none of the others running
                log.exception("profd: stopping a torch window refused off its thread failed")
        return len(due)


ORPHANS = Orphans()


def orphaned_here() -> bool:
    """Whether this thread has a torch window refused off it, to stop at its next mark."""
    return bool(ORPHANS) and ORPHANS.of(threading.current_thread())


def end_orphaned_windows() -> int:
    """Stop the torch windows left running off their thread that this thread may stop now;
    how many. Cheap when there are none (a mark after a failure calls it); never raises."""
    if not ORPHANS:
        return 0
    try:
        return ORPHANS.reap()
    except Exception:  # a mark must go on whatever happens here
        log.exception("profd: stopping torch windows refused off their thread failed")
        return 0
