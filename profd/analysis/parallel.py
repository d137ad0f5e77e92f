"""Run a per-file function over many files: in this process, in local worker processes, or
as Ray tasks on the nodes that hold the files.

Each worker handles one file at a time and returns a small result, so memory is bounded by
the number of workers, never by the size of the trace set.

Start method: ``fork`` when this process runs a single thread (workers start in
milliseconds and inherit the imported modules), else ``forkserver`` — forking a process
that has other threads (a Ray worker, the sidecar's event loop) can deadlock the child.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["MapStats", "map_files", "map_files_ray", "pick_start_method", "resolve_workers"]

T = TypeVar("T")
R = TypeVar("R")

#: Below this much JSON in total, worker start-up costs more than it saves.
SERIAL_BELOW_BYTES = 16 << 20
MAX_WORKERS = 8

_baseline_kb: int | None = None


@dataclass(frozen=True, slots=True)
class MapStats:
    """How a map ran. ``worker_memory_mb`` is the sum over workers of their peak resident
    memory above what each held when it started (an upper bound on the extra memory they
    used at once); ``None`` when not measurable (in-process, Ray, or not Linux)."""

    mode: str
    workers: int
    start_method: str | None = None
    worker_memory_mb: float | None = None


def resolve_workers(workers: int | None, n_items: int, total_bytes: int) -> int:
    """``workers`` if given (validated), else one per CPU for big inputs and 1 for small ones."""
    if workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers: must be an int >= 1, got {workers!r}")
        return min(workers, max(1, n_items))
    if n_items <= 1 or total_bytes < SERIAL_BELOW_BYTES:
        return 1
    return max(1, min(n_items, os.cpu_count() or 1, MAX_WORKERS))


def pick_start_method() -> str:
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and sys.platform == "linux" and threading.active_count() == 1:
        return "fork"
    return "forkserver" if "forkserver" in methods else "spawn"


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _init_worker() -> None:
    """Reset this process's peak-RSS mark (Linux) and remember where it started."""
    global _baseline_kb
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    _baseline_kb = _status_kb("VmRSS:")


def _run(fn: Callable[[Any], Any], item: Any) -> tuple[Any, int, int | None]:
    result = fn(item)
    peak = _status_kb("VmHWM:")
    growth = None if peak is None or _baseline_kb is None else max(0, peak - _baseline_kb)
    return result, os.getpid(), growth


def map_files(
    fn: Callable[[T], R],
    items: Sequence[T],
    *,
    workers: int = 1,
    sizes: Sequence[int] | None = None,
    start_method: str | None = None,
) -> tuple[list[R], MapStats]:
    """``[fn(item) for item in items]``, in order, on ``workers`` local processes."""
    if workers <= 1 or len(items) <= 1:
        return [fn(item) for item in items], MapStats("serial", 1)
    method = start_method or pick_start_method()
    order = sorted(range(len(items)), key=lambda i: -(sizes[i] if sizes else 0))  # big first
    results: list[Any] = [None] * len(items)
    growth: dict[int, int] = {}
    ctx = multiprocessing.get_context(method)
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker) as pool:
        futures = {pool.submit(_run, fn, items[i]): i for i in order}
        for fut in as_completed(futures):
            result, pid, kb = fut.result()
            results[futures[fut]] = result
            if kb is not None:
                growth[pid] = max(growth.get(pid, 0), kb)
    memory = sum(growth.values()) / 1024 if growth else None
    return results, MapStats("processes", workers, method, memory)


def map_files_ray(
    fn: Callable[[T], R], items: Sequence[T], nodes: Sequence[str | None]
) -> tuple[list[R], MapStats]:
    """Run ``fn(item)`` as Ray tasks, each on the node that holds its file (soft affinity:
    a task whose node is gone runs elsewhere and reports the file as unreadable)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        raise ValueError("executor: 'ray' needs a connected Ray (ray.init) in this process")
    if len(nodes) != len(items):
        raise ValueError(f"nodes: expected {len(items)} entries (one per file), got {len(nodes)}")
    task = ray.remote(num_cpus=1, max_retries=1)(fn)
    refs = []
    for item, node in zip(items, nodes, strict=True):
        options: dict[str, Any] = {}
        if node:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
        refs.append(task.options(**options).remote(item))
    return list(ray.get(refs)), MapStats("ray", len({n for n in nodes if n}) or 1)
