"""GPU time of one trace file, the way HTA (Holistic Trace Analysis) defines it, and its
breakdown by RL stage; :func:`gpu_breakdowns` adds the files of each track up.

The definitions (docs/gpu-breakdown.md has them in full, with HTA's names):

* the **device events** of a file are its ``kernel``, ``gpu_memcpy`` and ``gpu_memset``
  events, on every stream of every device lane of the file (one file is one rank);
* each is COMMUNICATION (an NCCL / RCCL / HCCL kernel), MEMORY (a memcpy / memset) or
  COMPUTATION (anything else): :func:`kernel_class`;
* *window* = last end - first start of the device events kept (those launched inside the
  file's step ranges, or all of them when the file has none); *busy* = length of the union
  of their intervals (across streams); *idle* = window - busy; *compute* = length of the union
  of the COMPUTATION intervals; *non-compute* = busy - compute (some memory or communication
  kernel runs and no computation does); *communication* / *memory* = length of the union of
  those intervals; *overlap* = length of union(COMMUNICATION) ∩ union(COMPUTATION), and
  HTA's overlap percentage is ``100 * overlap / communication``.

Per stage, a device event belongs to the stage its launch was in (its ``cuda_runtime`` /
``cuda_driver`` event, found by correlation id; the event's own start when it has none), and
idle time belongs to the stage the host was in at that moment.

Pure numpy and the standard library: no Ray, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from profd.analysis.models import GpuBreakdown
    from profd.analysis.ranges import Range

__all__ = [
    "GpuFile",
    "GpuTimes",
    "KernelClass",
    "file_gpu",
    "gpu_breakdowns",
    "kernel_class",
    "launch_times",
    "merge_intervals",
    "stage_index",
    "stage_pieces",
    "union_length",
]

# HTA's communication pattern (hta/common/types.py) is "^nccl", "^hccl", "ncclKernel" and
# "^hip"; the last one is left out here: it would count any kernel named hip* as
# communication. RCCL (ROCm) kernels keep NCCL's names; "rccl" is there for forks.
_COMM = re.compile(r"^(?:void )?(?:nccl|rccl|hccl)|ncclKernel|ncclDevKernel", re.IGNORECASE)
# HTA's memory pattern; Kineto's own categories say it first.
_MEMORY = re.compile(r"^(?:hip)?(?:Memcpy|Memset)|^dma")
_MEMORY_CATEGORIES = frozenset({"gpu_memcpy", "gpu_memset"})


class KernelClass(IntEnum):
    """HTA's kernel types (``KernelType``): what a device event spends its time on."""

    COMPUTATION = 0
    COMMUNICATION = 1
    MEMORY = 2


def kernel_class(category: str, name: str) -> KernelClass:
    """The class of a device event from its category and name."""
    if category in _MEMORY_CATEGORIES:
        return KernelClass.MEMORY
    if _COMM.search(name):
        return KernelClass.COMMUNICATION
    if _MEMORY.match(name):
        return KernelClass.MEMORY
    return KernelClass.COMPUTATION


@dataclass(frozen=True, slots=True)
class GpuTimes:
    """Device time of a set of device events, in µs (adds up over files and stage calls)."""

    kernels: int = 0
    window: float = 0.0
    idle: float = 0.0
    compute: float = 0.0
    non_compute: float = 0.0
    communication: float = 0.0
    memory: float = 0.0
    overlap: float = 0.0  # communication time during which some computation also runs

    def __add__(self, other: GpuTimes) -> GpuTimes:
        return GpuTimes(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True, slots=True)
class GpuFile:
    """One file's device time: in total and per stage label (None: outside every stage)."""

    total: GpuTimes
    stages: dict[str | None, GpuTimes] = field(default_factory=dict)


# -- interval math ----------------------------------------------------------------------------
def merge_intervals(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals [start, end) as sorted, disjoint intervals."""
    if len(start) == 0:
        return np.zeros(0), np.zeros(0)
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    reach = np.maximum.accumulate(e)
    # A new interval begins where the start lies beyond everything before it ends.
    first = np.flatnonzero(np.r_[True, s[1:] > reach[:-1]])
    return s[first], np.maximum.reduceat(e, first)


def union_length(start: np.ndarray, end: np.ndarray) -> float:
    """Length of the union of intervals [start, end)."""
    s, e = merge_intervals(start, end)
    return float((e - s).sum())


def _overlap(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """|union(a) ∩ union(b)| = |union(a)| + |union(b)| - |union(a ∪ b)|."""
    both = union_length(np.r_[a[0], b[0]], np.r_[a[1], b[1]])
    return max(0.0, union_length(*a) + union_length(*b) - both)


def _times(start: np.ndarray, end: np.ndarray, cls: np.ndarray, idle: float) -> GpuTimes:
    """The figures of one set of device events, given the idle time that goes with them."""
    busy = union_length(start, end)
    comp = cls == KernelClass.COMPUTATION
    comm = cls == KernelClass.COMMUNICATION
    mem = cls == KernelClass.MEMORY
    compute = union_length(start[comp], end[comp])
    communication = union_length(start[comm], end[comm])
    overlap = _overlap((start[comm], end[comm]), (start[comp], end[comp])) if communication else 0.0
    return GpuTimes(
        kernels=len(start),
        window=busy + idle,
        idle=idle,
        compute=compute,
        non_compute=max(0.0, busy - compute),
        communication=communication,
        memory=union_length(start[mem], end[mem]),
        overlap=overlap,
    )


# -- stages -------------------------------------------------------------------------------------
def stage_pieces(stages: Sequence[Range]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Which stage the host is in, over time: stage i (sorted by start) holds from its start
    until it ends or the next stage starts, whichever is first — the rule the operator
    tables use (the latest stage that started and has not ended)."""
    ordered = sorted(stages, key=lambda s: s.ts)
    start = np.array([s.ts for s in ordered], np.float64)
    end = np.array([s.end for s in ordered], np.float64)
    if len(start) > 1:
        end[:-1] = np.minimum(end[:-1], start[1:])
    return start, end, [s.name for s in ordered]


def stage_index(start: np.ndarray, end: np.ndarray, when: np.ndarray) -> np.ndarray:
    """Index of the piece of :func:`stage_pieces` that holds each time, -1 for none."""
    at = np.searchsorted(start, when, side="right") - 1
    inside = (at >= 0) & (when < end[np.maximum(at, 0)]) if len(start) else at >= 0
    return np.where(inside, at, -1)


def _idle_in(
    piece: tuple[np.ndarray, np.ndarray],
    window: tuple[float, float],
    busy: tuple[np.ndarray, np.ndarray],
    busy_len: float,
) -> float:
    """Idle time inside some host-time pieces: |P ∩ (W \\ B)| = |P ∪ B| - |B|, with P clipped
    to the window W and B (the busy intervals) inside W."""
    s, e = np.clip(piece[0], *window), np.clip(piece[1], *window)
    return max(0.0, union_length(np.r_[s, busy[0]], np.r_[e, busy[1]]) - busy_len)


def launch_times(
    ts: np.ndarray, corr: np.ndarray, device: np.ndarray, launcher: np.ndarray
) -> np.ndarray:
    """The host time each event belongs to: its start, and for a device event the start of
    the launcher (a ``*_runtime`` / ``*_driver`` call) with its correlation id, when the trace
    has one. Kernels run after their launch, often after the launching stage has ended; the
    launch is what says which stage asked for them."""
    when = ts.copy()
    host = np.flatnonzero(launcher & (corr >= 0))
    dev = np.flatnonzero(device & (corr >= 0))
    if len(host) == 0 or len(dev) == 0:
        return when
    order = host[np.argsort(corr[host], kind="stable")]
    keys = corr[order]
    at = np.minimum(np.searchsorted(keys, corr[dev]), len(keys) - 1)
    hit = keys[at] == corr[dev]
    when[dev[hit]] = ts[order[at[hit]]]
    return when


# -- one file ---------------------------------------------------------------------------------
def file_gpu(
    start: np.ndarray,
    dur: np.ndarray,
    cls: np.ndarray,
    when: np.ndarray,
    steps: Sequence[tuple[float, float]],
    stages: Sequence[Range],
) -> GpuFile | None:
    """The device time of one file, or None without device events (in its steps).

    ``start`` / ``dur`` / ``cls``: its device events; ``when``: the host time each belongs to
    (its launch, or its own start); ``steps``: the file's step ranges (none: keep all)."""
    keep = np.ones(len(start), bool)
    if steps:
        keep[:] = False
        for a, b in steps:  # a handful of steps per file
            keep |= (when >= a) & (when <= b)
    s, e, c, w = start[keep], start[keep] + dur[keep], cls[keep], when[keep]
    if len(s) == 0:
        return None
    window = (float(s.min()), float(e.max()))
    busy = merge_intervals(s, e)
    busy_len = float((busy[1] - busy[0]).sum())
    idle = max(0.0, window[1] - window[0] - busy_len)
    p_start, p_end, labels = stage_pieces(stages)
    piece = stage_index(p_start, p_end, w)
    per: dict[str | None, GpuTimes] = {}
    for name in dict.fromkeys(labels):
        mine = [i for i, label in enumerate(labels) if label == name]
        sel = np.isin(piece, mine)
        part = _times(
            s[sel], e[sel], c[sel], _idle_in((p_start[mine], p_end[mine]), window, busy, busy_len)
        )
        if part.kernels or part.idle > 0:
            per[name] = part
    # the rest: launched, or idle, while the host was outside every stage
    rest = _times(
        s[piece < 0], e[piece < 0], c[piece < 0], max(0.0, idle - sum(t.idle for t in per.values()))
    )
    if rest.kernels or rest.idle > 0:
        per[None] = rest
    return GpuFile(_times(s, e, c, idle), per)


# -- per track ----------------------------------------------------------------------------------
def gpu_breakdowns(
    files: Iterable[tuple[str, GpuFile | None]],
    tracks: Sequence[str],
    stage_order: Mapping[str, int],
) -> list[GpuBreakdown]:
    """One :class:`~profd.analysis.models.GpuBreakdown` per track with device events, in
    ``tracks`` order: the files of a track add up (each is its own profiled window)."""
    from profd.analysis.models import GpuBreakdown, GpuStageBreakdown

    total: dict[str, GpuTimes] = {}
    per: dict[str, dict[str | None, GpuTimes]] = {}
    for track, g in files:
        if g is None:
            continue
        total[track] = total.get(track, GpuTimes()) + g.total
        stages = per.setdefault(track, {})
        for name, t in g.stages.items():
            stages[name] = stages.get(name, GpuTimes()) + t
    out = []
    for track in tracks:
        if track not in total:
            continue
        names = sorted(per[track], key=lambda n: (n is None, stage_order.get(n or "", 0), n or ""))
        rows = [GpuStageBreakdown(stage=n, **_ms(per[track][n])) for n in names]
        out.append(GpuBreakdown(track=track, **_ms(total[track]), stages=rows))
    return out


def _ms(t: GpuTimes) -> dict[str, Any]:
    """The model's fields of a :class:`GpuTimes` (µs → ms)."""
    return {
        "kernels": t.kernels,
        "window_ms": t.window / 1000.0,
        "idle_ms": t.idle / 1000.0,
        "compute_ms": t.compute / 1000.0,
        "non_compute_ms": t.non_compute / 1000.0,
        "communication_ms": t.communication / 1000.0,
        "memory_ms": t.memory / 1000.0,
        "comm_comp_overlap_pct": 100.0 * t.overlap / t.communication
        if t.communication > 0
        else None,
    }
