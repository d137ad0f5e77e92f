"""Giving freed heap back to the operating system (glibc's ``malloc_trim``), and pacing the
cyclic collector of a process that holds a fleet's state.

A long-running process that takes bursts of calls (the coordinator: thousands of agents
registering, a fleet's events as its windows end) frees most of what a burst allocated, but
glibc keeps the freed pages, so its resident size stays at the burst's high-water mark.
Measured on the coordinator with 10,000 agents: 20 MB (2 KB an agent) of its 57 MB growth was
such pages. Trimming now and then makes the resident size what the process holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
from collections.abc import Iterator
from typing import Any

__all__ = ["collect_young_every", "collection_deferred", "trim_heap"]

log = logging.getLogger(__name__)


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        return libc if hasattr(libc, "malloc_trim") else None  # glibc only (not musl, macOS)
    except OSError:
        return None


def trim_heap() -> bool:
    """Return the heap's free pages to the OS; whether the C library can (and did)."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.malloc_trim(0))


def collect_young_every(objects: int) -> None:
    """Collect the young generation every ``objects`` allocations (Python: 700) and the
    middle one every 20 young collections at least (Python: 10), for this whole process.

    At 10,000 agents the coordinator's heap holds about a million objects, and Python's
    default pacing ran a full collection (60-80 ms, every RPC waiting) two or three times
    in one ``create_session`` of the whole fleet and again as the fleet's events came in
    (measured in-process: 230 ms of a 660 ms ``create_session``, 220 ms of 2.1 s of
    events). Its objects are freed by reference counting; cycles are rare, and still
    collected, only later."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(objects, max(older, 20), oldest)


class _Deferral:
    """Who holds the collector off now (coroutines of one event loop may overlap)."""

    holders = 0
    #: Whether the collector was on when the first holder came (it is turned back on only then).
    was_enabled = False


@contextlib.contextmanager
def collection_deferred() -> Iterator[None]:
    """No cyclic collection inside (it runs after, at the next allocation past the threshold).

    For a stretch whose latency matters and which allocates a lot: a fleet-wide
    ``create_session`` until its plans have gone out. At 10,000 agents a full collection
    takes 60-150 ms and Python's pacing ran one to three of them before the plans left
    (measured in process: ``bench/create_latency.py``). Nesting and overlapping holders
    are counted (no lock: one event loop's coroutines, on its thread); the collector comes
    back on when the last one leaves, if it was on. Hold it for a stretch of work, not
    across a wait of unknown length."""
    if _Deferral.holders == 0:
        _Deferral.was_enabled = gc.isenabled()
        gc.disable()
    _Deferral.holders += 1
    try:
        yield
    finally:
        _Deferral.holders -= 1
        if _Deferral.holders == 0 and _Deferral.was_enabled:
            gc.enable()
