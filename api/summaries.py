"""The sidecar's session summaries (one :class:`SummaryCache` per app, on ``app.state``): the
newest few kept, and where they are computed.

A summary of files on this node is computed in one worker process at a lower CPU priority
(:data:`WORKER_NICE`), not on a thread of the sidecar: parsing traces holds the GIL for tens
of milliseconds, and the event loop that answers every other route waited for it. Summaries
that read files on other nodes (Ray tasks) are only waited for here, on a thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from profd.analysis.models import SessionSummary
from profd.core.errors import ProfdError

__all__ = ["WORKER_NICE", "SummaryCache", "SummaryUnavailable"]

log = logging.getLogger(__name__)

#: How much lower the summary worker's CPU priority is than the sidecar's (``nice``).
WORKER_NICE = 10


class SummaryUnavailable(ProfdError):
    """The summary worker died twice on one summary (out of memory on huge traces, most
    likely): not computed in the sidecar itself, which serves every other route."""

    status_code = 503
    code = "summary_unavailable"


def _lower_priority() -> None:
    try:
        os.nice(WORKER_NICE)
    except OSError:  # not allowed here: the same priority, still off the sidecar's GIL
        pass


class SummaryCache:
    """Summaries of finished sessions (their traces no longer change), the newest few, and
    the lock that lets one summary be computed at a time."""

    def __init__(self, size: int = 32) -> None:
        self._size = size
        self._items: OrderedDict[tuple[Any, ...], SessionSummary] = OrderedDict()
        self.lock = asyncio.Lock()  # bound to the app's loop on first use
        self._pool: ProcessPoolExecutor | None = None

    async def compute(self, fn: Callable[..., SessionSummary], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` in the worker process (started on first use; when it dies,
        started again and the summary tried once more)."""
        call = functools.partial(fn, *args, **kw)
        for attempt in (1, 2):
            if self._pool is None:
                # spawn: a fork of the sidecar would copy Ray's threads and sockets
                ctx = multiprocessing.get_context("spawn")
                self._pool = ProcessPoolExecutor(1, mp_context=ctx, initializer=_lower_priority)
            try:
                return await asyncio.get_running_loop().run_in_executor(self._pool, call)
            except BrokenProcessPool:
                log.warning("profd: the summary worker died (attempt %d of 2)", attempt)
                self.close()
        raise SummaryUnavailable(
            "the summary worker died twice computing this summary (out of memory?); "
            "`profd summarize` on the session directory reads it in a process of its own"
        )

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def get(self, key: tuple[Any, ...]) -> SessionSummary | None:
        if key in self._items:
            self._items.move_to_end(key)
        return self._items.get(key)

    def put(self, key: tuple[Any, ...], value: SessionSummary) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self._size:
            self._items.popitem(last=False)
