"""Freed heap goes back to the OS (profd.core.heap), and the coordinator does it now and then."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

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


def test_collection_is_held_off_while_deferred_and_comes_back_after() -> None:
    import gc

    from profd.core.heap import collection_deferred

    assert gc.isenabled()
    outer = collection_deferred()
    outer.__enter__()
    assert not gc.isenabled()
    with collection_deferred():  # a second holder (an overlapping create_session)
        assert not gc.isenabled()
    assert not gc.isenabled(), "the first holder still holds it off"
    outer.__exit__(None, None, None)
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collection_deferred():
        raise RuntimeError("admission refused")
    assert gc.isenabled(), "back on after a refused request"
    gc.disable()  # off by the process's own choice: it stays off
    try:
        with collection_deferred():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_sessions_plans_leave_with_the_collector_held_off(tmp_path: Path) -> None:
    """A fleet-wide create_session runs no cyclic collection until its plans have gone out
    (bench/create_latency.py: at 10,000 agents one to three fell there); on after."""
    import gc

    from profd.actors.coordinator import ProfileCoordinator
    from profd.core.protocol import AgentInfo

    seen: list[bool] = []

    class PushTarget:  # a node relay's handle: each push records the collector's state
        def __init__(self) -> None:
            self.push = self

        def remote(self, key: str, replies: Any, refresh: Any) -> Any:
            seen.append(gc.isenabled())
            replies = getattr(replies, "value", replies)

            async def held() -> dict[str, int]:
                return {a: r.plan.version for a, r in replies.items() if r.plan is not None}

            return held()

    async def go() -> tuple[list[bool], bool]:
        coord = ProfileCoordinator(coordinator_settings(tmp_path))
        await coord.start()
        for n, node in enumerate(("n0", "n1")):
            known, steps = {}, {}
            for rank in range(4 * n, 4 * n + 4):
                info = AgentInfo(f"{node}-{rank}", "actor", rank, 8, {}, node, 100 + rank,
                                 node_id=node, capabilities={"torch": None})  # fmt: skip
                known[info.agent_id] = (await coord.register(info, 1)).plan.version
                steps[info.agent_id] = 1
            await coord.relay_sync(node, known, steps, PushTarget(), node)
        seen.clear()
        placing = coord._admission._alignment  # (a collection between the steps: none)
        place = placing.place

        async def place_seen(*args: Any) -> None:
            seen.append(gc.isenabled())
            await place(*args)

        placing.place = place_seen
        await coord.create_session({"steps": [5, 6], "roles": {"actor": {"all_ranks": True}}})
        on_after = gc.isenabled()
        coord.close()
        return list(seen), on_after

    pushes, on_after = asyncio.run(go())
    assert pushes == [False, False, False], pushes  # placed, and both relays' pushes, held off
    assert on_after
