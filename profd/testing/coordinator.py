"""Run a coordinator inside this process (tests, single-process tools).

The coordinator's async methods run on a private event-loop thread; agents reach it through
:class:`LocalLink`, which has the same blocking interface as the Ray link.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any

from profd.agent.channel import LinkDown
from profd.core.protocol import AgentEvent, AgentInfo, PollReply

__all__ = ["InProcessCoordinator", "LocalLink"]

log = logging.getLogger(__name__)


class InProcessCoordinator:
    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="profd-coord", daemon=True
        )
        self._thread.start()
        self.down = False  # tests flip this to simulate an outage
        start = getattr(coordinator, "start", None)
        if start is not None:  # housekeeping runs on the loop thread, as in the Ray actor
            asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)

    def call(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        coro = getattr(self.coordinator, method)(*args)
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:  # the loop is closed (an agent retrying after tear-down)
            coro.close()  # never run: no "coroutine was never awaited" warning
            raise
        return fut.result(timeout)

    def run(self, fn: Any, *args: Any) -> Any:
        """Run a plain (sync) method on the loop thread."""

        async def _wrap() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(_wrap(), self.loop).result(30)

    def link(self) -> LocalLink | None:
        return None if self.down else LocalLink(self)

    def close(self) -> None:
        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(5)
        except (TimeoutError, RuntimeError):  # a task that ignores cancel; the loop stops anyway
            log.warning("in-process coordinator: tasks still running at close", exc_info=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        closer = getattr(self.coordinator, "close", None)
        if closer is not None:
            closer()
        if not self._thread.is_alive():
            self.loop.close()


class LocalLink:
    def __init__(self, owner: InProcessCoordinator) -> None:
        self._owner = owner

    def _call(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        if self._owner.down:
            raise LinkDown("coordinator down")
        try:
            return self._owner.call(method, *args, timeout=timeout)
        except (RuntimeError, concurrent.futures.CancelledError) as exc:  # loop stopped
            raise LinkDown(str(exc) or type(exc).__name__) from exc

    def register(self, info: AgentInfo, step: int | None) -> Any:
        return self._call("register", info, step)

    def poll(self, agent_id: str, version: int, step: int | None, timeout: float) -> PollReply:
        return self._call("poll", agent_id, version, step, timeout, timeout=timeout + 30)

    def report(self, agent_id: str, events: list[AgentEvent]) -> bool:
        return self._call("report", agent_id, events)

    def clock_ns(self) -> int:
        return self._call("clock_ns", timeout=5.0)
