"""Keep glibc's heap from shrinking between the files a worker process digests.

glibc hands memory back to the system as soon as (by default) 128 KiB lie free at the top of
its heap, so each digest's arrays (a few MB, freed when it ends) are faulted in again by
the next one: 1,400-1,700 page faults per 12 MB file of ``bench/analysis.py``'s trace set,
5-15 % of the workers' CPU time (the kernel zeroing pages, then cache misses on them).
In the worker processes a summary starts (``parallel.map_files``: short-lived, one per CPU)
the top of the heap is kept padded instead, at most 16 MiB more resident memory per worker.
Nothing changes anywhere else: not in the calling process, not in Ray tasks (long-lived
processes that profd does not own), not without glibc.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import sys

__all__ = ["pad_worker_heap"]

_M_TOP_PAD = -2  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_TOP_PAD = 16 << 20
_MMAP_THRESHOLD = 8 << 20
_done = False


def pad_worker_heap() -> None:
    """Once per process, in a ``multiprocessing`` child on Linux: pad the heap's top."""
    global _done
    if _done:
        return
    _done = True
    if not sys.platform.startswith("linux") or multiprocessing.parent_process() is None:
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    # Setting one parameter freezes glibc's adaptive mmap threshold where it stands: set it
    # too, so that a read block or an array under 8 MiB comes from the padded heap rather
    # than from a fresh mapping (faulted in page by page).
    mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(_MMAP_THRESHOLD))
    mallopt(ctypes.c_int(_M_TOP_PAD), ctypes.c_int(_TOP_PAD))
