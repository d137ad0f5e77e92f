"""A relay's batches of its agents' events: queued per agent, sent in ``report_many`` calls.

Each agent's ``report`` answers once the coordinator took the batch that carried it (False:
the coordinator does not know the agent, which registers again). One batch is in flight at a
time; what agents send meanwhile goes in the next one.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from profd.core.protocol import AgentEvent

if TYPE_CHECKING:
    from profd.actors.relay_caller import CoordinatorCaller

__all__ = ["MAX_BATCH_EVENTS", "REPORT_TIMEOUT_S", "ReportBatches"]

#: A ``report_many`` carries about this many events at most (whole agents' lists, so at
#: least one agent's): a node's burst is sent in calls the coordinator answers in time.
MAX_BATCH_EVENTS = 2000
#: How long the relay waits for the coordinator to take a batch.
REPORT_TIMEOUT_S = 30.0


class ReportBatches:
    """The events a relay's agents sent and the coordinator has not taken yet."""

    def __init__(self, caller: CoordinatorCaller) -> None:
        self._caller = caller
        self._pending: dict[str, list[AgentEvent]] = {}
        self._waiters: dict[str, list[asyncio.Future[bool]]] = {}
        self._flush_task: asyncio.Task[None] | None = None
        self.reports = 0
        self.events = 0
        self.errors = 0

    async def report(self, agent_id: str, events: list[AgentEvent]) -> bool:
        """Queue the events for the next batch; whether the coordinator knows the agent."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.setdefault(agent_id, []).extend(events)
        self._waiters.setdefault(agent_id, []).append(fut)
        if self._flush_task is None or self._flush_task.done():
            self._flush_task = asyncio.create_task(self._flush())
        return await fut

    def _take_batch(
        self, most: int
    ) -> tuple[dict[str, list[AgentEvent]], dict[str, list[asyncio.Future[bool]]]]:
        """The next batch: whole agents' events, oldest first, up to ``most`` (an agent's
        events stay in order: its later ones go in a later batch)."""
        batch: dict[str, list[AgentEvent]] = {}
        waiters: dict[str, list[asyncio.Future[bool]]] = {}
        n = 0
        for aid in list(self._pending):
            if n and n + len(self._pending[aid]) > most:
                break
            batch[aid] = self._pending.pop(aid)
            waiters[aid] = self._waiters.pop(aid, [])
            n += len(batch[aid])
        return batch, waiters

    async def _flush(self) -> None:
        while self._pending:
            batch, waiters = self._take_batch(MAX_BATCH_EVENTS)
            try:
                known = await self._caller.call("report_many", batch, timeout=REPORT_TIMEOUT_S)
            except ConnectionError as exc:
                self.errors += 1
                for futs in waiters.values():
                    for f in futs:
                        if not f.done():
                            f.set_exception(ConnectionError(str(exc)))
                continue
            self.reports += 1
            self.events += sum(len(v) for v in batch.values())
            for aid, futs in waiters.items():
                for f in futs:
                    if not f.done():
                        f.set_result(bool(known.get(aid, False)))
