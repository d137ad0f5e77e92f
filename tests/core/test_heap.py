"""Freed heap goes back to the OS (profd.core.heap), and the coordinator does it now and then."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from profd.core.heap import trim_heap

from helpers import coordinator_settings


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_leaves_the_resident_size() -> None:
    trim_heap()
    before = rss_kb()
    burst = [bytearray(1000) for _ in range(100_000)]  # ~100 MB in small chunks
    keep = [bytearray(100) for _ in range(10)]  # allocated after: the heap's top stays used
    del burst
    high = rss_kb()
    assert trim_heap() is True
    assert high - before > 50_000 and rss_kb() - before < 20_000, (before, high, rss_kb())
    assert keep


def test_the_coordinator_trims_its_heap_now_and_then(tmp_path: Path, monkeypatch) -> None:
    from profd.actors import coordinator as module
    from profd.actors.coordinator import ProfileCoordinator

    trims: list[int] = []
    monkeypatch.setattr(module, "trim_heap", lambda: trims.append(1) or True)
    monkeypatch.setattr(module, "HEAP_TRIM_S", 0.2)

    async def go() -> None:
        coord = ProfileCoordinator(coordinator_settings(tmp_path, tick_s=0.05))
        await coord.start()
        for _ in range(200):
            if len(trims) >= 2:
                break
            await asyncio.sleep(0.05)
        coord.close()

    asyncio.run(go())
    assert len(trims) >= 2
