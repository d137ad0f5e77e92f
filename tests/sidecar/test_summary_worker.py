"""Summaries of local files are computed in one worker process at a lower priority than the
sidecar's (not on its threads, whose GIL its event loop needs); a worker that dies is started
again, and a summary that kills it twice is an error, not computed in the sidecar."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from profd.api.summaries import WORKER_NICE, SummaryCache, SummaryUnavailable, SummaryWorker


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
            await cache.aclose()

    asyncio.run(go())


def test_a_call_that_fails_in_the_worker_raises_its_error_and_keeps_the_worker() -> None:
    async def go() -> None:
        cache = SummaryCache()
        try:
            pid = await cache.compute(os.getpid)
            with pytest.raises(ValueError, match="invalid literal"):
                await cache.compute(int, "not a number")
            assert await cache.compute(os.getpid) == pid
        finally:
            await cache.aclose()

    asyncio.run(go())


def test_the_worker_ends_when_its_sidecar_closes_the_pipe() -> None:
    async def go() -> int | None:
        worker = SummaryWorker()
        try:
            await worker.call(os.getpid)
            proc = worker._proc
            assert proc is not None and proc.stdin is not None
            proc.stdin.close()  # what the kernel does when the sidecar dies
            return await asyncio.wait_for(proc.wait(), 30)
        finally:
            await worker.aclose()

    assert asyncio.run(go()) == 0


# What the sidecar actor's process looks like: its main module is Ray's worker script.
RAY_MAIN = """\
import ray  # as Ray's default_worker.py does before the sidecar's code runs
import asyncio, json
from profd.api.summaries import SummaryCache

PROBE = "(sorted(m for m in ('ray', 'torch', 'fastapi') if m in __import__('sys').modules), "
PROBE += "__import__('sys').modules['__main__'].__spec__.name)"


async def go():
    cache = SummaryCache()
    try:
        return await cache.compute(eval, PROBE)
    finally:
        await cache.aclose()


print(json.dumps(asyncio.run(go())))
"""


def test_the_worker_imports_neither_ray_nor_its_parents_main_module(tmp_path: Path) -> None:
    """A spawned child imported the sidecar actor's main module again (Ray's worker
    script): seconds before the first summary, and Ray's memory in the worker."""
    main = tmp_path / "ray_main.py"
    main.write_text(RAY_MAIN)
    r = subprocess.run(
        [sys.executable, str(main)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    imported, main_name = json.loads(r.stdout.strip().splitlines()[-1])
    assert imported == [] and main_name == "profd.analysis.worker", (imported, main_name)
