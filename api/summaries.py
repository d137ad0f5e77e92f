"""The sidecar's session summaries (one :class:`SummaryCache` per app, on ``app.state``): the
newest few kept, and where they are computed.

A summary of files on this node is computed in one worker process at a lower CPU priority
(:data:`WORKER_NICE`; :mod:`profd.analysis.worker`), not on a thread of the sidecar: parsing
traces holds the GIL for tens of milliseconds, and the event loop that answers every other
route waited for it. Summaries that read files on other nodes (Ray tasks) are only waited
for here, on a thread.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from profd.analysis.models import SessionSummary
from profd.analysis.worker import HEADER, encode
from profd.analysis.worker import NICE as WORKER_NICE
from profd.core.errors import ProfdError

__all__ = ["WORKER_NICE", "SummaryCache", "SummaryUnavailable", "SummaryWorker"]

log = logging.getLogger(__name__)


class SummaryUnavailable(ProfdError):
    """The summary worker died twice on one summary (out of memory on huge traces, most
    likely): not computed in the sidecar itself, which serves every other route."""

    status_code = 503
    code = "summary_unavailable"


class WorkerDied(Exception):
    """The worker process ended (or closed its pipe) before it answered."""


class SummaryWorker:
    """``python -m profd.analysis.worker`` as a child of the sidecar, driven from its event
    loop, one call at a time. Started on first use; it ends when its stdin closes, so a
    sidecar that dies does not leave it behind."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self._one = asyncio.Lock()  # the pipe carries one call's frames at a time

    async def call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        async with self._one:
            return await self._call(fn, args, kw)

    async def _call(self, fn: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        proc = await self._started()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(encode((fn, args, kw)))
            await proc.stdin.drain()
            (size,) = HEADER.unpack(await proc.stdout.readexactly(HEADER.size))
            ok, value = pickle.loads(await proc.stdout.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self.close()
            raise WorkerDied(f"the summary worker ended ({type(exc).__name__})") from exc
        except BaseException:  # cancelled mid-call: the pipe is out of step, start afresh
            self.close()
            raise
        if not ok:
            raise value
        return value

    async def _started(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "profd.analysis.worker",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
        return self._proc

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            try:
                proc.kill()
            except ProcessLookupError:  # ended just now
                pass

    async def aclose(self) -> None:
        """:meth:`close`, then wait for the process (its pipes closed while the loop runs)."""
        proc = self._proc
        self.close()
        if proc is not None:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except Exception as exc:  # it is killed; only its exit was not seen
                log.warning("profd: the summary worker did not exit (%s)", exc)


class SummaryCache:
    """Summaries of finished sessions (their traces no longer change), the newest few, and
    the lock that lets one summary be computed at a time."""

    def __init__(self, size: int = 32) -> None:
        self._size = size
        self._items: OrderedDict[tuple[Any, ...], SessionSummary] = OrderedDict()
        self.lock = asyncio.Lock()  # bound to the app's loop on first use
        self.worker = SummaryWorker()

    async def compute(self, fn: Callable[..., SessionSummary], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` in the worker process (started on first use; when it dies,
        started again and the summary tried once more)."""
        for attempt in (1, 2):
            try:
                return await self.worker.call(fn, *args, **kw)
            except WorkerDied:
                log.warning("profd: the summary worker died (attempt %d of 2)", attempt)
        raise SummaryUnavailable(
            "the summary worker died twice computing this summary (out of memory?); "
            "`profd summarize` on the session directory reads it in a process of its own"
        )

    def close(self) -> None:
        self.worker.close()

    async def aclose(self) -> None:
        await self.worker.aclose()

    def get(self, key: tuple[Any, ...]) -> SessionSummary | None:
        if key in self._items:
            self._items.move_to_end(key)
        return self._items.get(key)

    def put(self, key: tuple[Any, ...], value: SessionSummary) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self._size:
            self._items.popitem(last=False)
