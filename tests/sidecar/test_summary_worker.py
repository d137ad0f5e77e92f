"""Summaries of local files are computed in one worker process at a lower priority than the
sidecar's (not on its threads, whose GIL its event loop needs); a worker that dies is started
again, and a summary that kills it twice is an error, not computed in the sidecar."""

from __future__ import annotations

import asyncio
import os

import pytest

from profd.api.summaries import WORKER_NICE, SummaryCache, SummaryUnavailable


def _die() -> None:
    os._exit(3)  # as the OOM killer would end it


def test_summaries_run_in_a_lower_priority_process_started_again_when_it_dies() -> None:
    async def go() -> None:
        cache = SummaryCache()
        try:
            pid = await cache.compute(os.getpid)
            assert pid != os.getpid()
            assert await cache.compute(os.nice, 0) == min(19, os.nice(0) + WORKER_NICE)
            assert await cache.compute(os.getpid) == pid  # one worker, kept

            with pytest.raises(SummaryUnavailable, match="died twice"):
                await cache.compute(_die)
            again = await cache.compute(os.getpid)  # a new worker for the next summary
            assert again not in (pid, os.getpid())
        finally:
            cache.close()

    asyncio.run(go())
