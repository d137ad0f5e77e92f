"""One trace file → a compact :class:`FileDigest`: its header, its ``user_annotation`` ranges,
its stages, and operator time per stage (self and total).

This runs once per file, in a worker process, and is what makes ``profd summarize`` fast: the
events are read into columns by :mod:`.scan` (a regular-expression scan of Kineto text, with
a generic orjson path for other layouts), and everything after that is numpy.

Self time (an event's duration minus that of the events directly inside it on the same
thread) is computed with numpy, by nesting depth, without a Python loop per event.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from profd.analysis.clocks import clock_offset_us
from profd.analysis.gpu import (
    GpuFile,
    file_gpu,
    kernel_class,
    launch_times,
    stage_index,
    stage_pieces,
)
from profd.analysis.heap import pad_worker_heap
from profd.analysis.jsonscan import SEGMENT_BYTES, TraceReadError, TraceStream
from profd.analysis.ranges import RANGE_CATEGORY, Range, marker, select_stages, step_ranges
from profd.analysis.scan import MERGED, Columns, LayoutMismatch, scan_fast, scan_generic
from profd.core.naming import is_stage_scope

__all__ = ["CPU_OP_CATEGORIES", "GPU_OP_CATEGORIES", "FileDigest", "OpTotal", "digest_file"]

log = logging.getLogger(__name__)

#: Host-side events that count as operators (``cuda_runtime`` is where launch overhead shows).
CPU_OP_CATEGORIES = frozenset({"cpu_op", "cuda_runtime", "cuda_driver"})
#: Device-side events that count as operators.
GPU_OP_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


class OpTotal(NamedTuple):
    """Time of one operator inside one stage of one file."""

    stage: str | None  # None: outside every stage
    category: str
    name: str
    calls: int
    self_us: float
    total_us: float


@dataclass(slots=True)
class FileDigest:
    """What the summary needs from one file (small: no per-event data)."""

    path: str
    file_bytes: int
    json_bytes: int = 0
    header: dict[str, Any] = field(default_factory=dict)
    #: Add to a timestamp of this file to get µs since the epoch (Kineto writes ``ts``
    #: relative to ``baseTimeNanoseconds``).
    base_us: float = 0.0
    events: int = 0
    first_ts: float | None = None
    last_end: float | None = None
    threads: list[tuple[Any, Any]] = field(default_factory=list)
    ranges: list[Range] = field(default_factory=list)
    stages: list[Range] = field(default_factory=list)
    ops: list[OpTotal] = field(default_factory=list)
    #: Device time (HTA's temporal breakdown), None without device events in its steps.
    gpu: GpuFile | None = None
    #: Steps the file holds only in part (its window began or ended inside them), left out of
    #: ``ranges`` and ``stages``: profd's header names the steps it holds whole.
    partial_steps: list[int] = field(default_factory=list)
    mode: str = ""
    seconds: float = 0.0
    error: str | None = None


def self_times(thread: np.ndarray, ts: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """Each event's duration minus the durations of the events directly inside it.

    Per thread, with events sorted by (start, longest first), an event's depth is how many
    earlier events are still open when it starts; its parent is the last event one level up
    that started before it.
    """
    n = len(ts)
    out = np.zeros(n)
    if n == 0:
        return out
    order = _event_order(thread, ts, dur)
    th_s, ts_s, dur_s = thread[order], ts[order], dur[order]
    own = dur_s.copy()
    cuts = np.flatnonzero(np.diff(th_s)) + 1
    for a, b in zip(np.r_[0, cuts].tolist(), np.r_[cuts, n].tolist(), strict=True):
        start, length = ts_s[a:b], dur_s[a:b]
        ended = np.searchsorted(np.sort(start + length), start, side="right")
        # A zero-length event counts its own end as "ended"; add it back.
        depth = np.maximum(np.arange(b - a) - ended + (length == 0), 0)
        counts = np.bincount(depth)
        # the same order either way; 16-bit keys get numpy's radix sort, about 3x faster
        by_depth = np.argsort(
            depth.astype(np.int16) if len(counts) < 2**15 else depth, kind="stable"
        )
        parent = np.full(b - a, -1)
        prev = by_depth[: counts[0]]
        offset = int(counts[0])
        for c in counts[1:].tolist():
            cur = by_depth[offset : offset + c]
            offset += c
            if len(prev):
                p = np.searchsorted(prev, cur) - 1
                ok = p >= 0
                parent[cur[ok]] = prev[p[ok]]
            prev = cur
        inner = parent >= 0
        own[a:b] -= np.bincount(parent[inner], weights=length[inner], minlength=b - a)
    out[order] = np.maximum(own, 0.0)
    return out


def _event_order(thread: np.ndarray, ts: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """Sort by (thread, start, longest first). Traces come nearly sorted by start, which a
    stable sort exploits (about 50x faster than a three-key lexsort here)."""
    order = np.argsort(ts, kind="stable")
    if len(order) > 1 and not (np.diff(ts[order]) > 0).all():  # equal starts: longest first
        order = np.lexsort((-dur, ts))
    th = thread[order]
    if th.max() > 0:
        small = th.astype(np.int16) if th.max() < 2**15 else th  # 16-bit keys: radix sort
        order = order[np.argsort(small, kind="stable")]
    return order


def _op_totals(
    heads: Sequence[tuple[Any, ...]],
    gid: np.ndarray,
    when: np.ndarray,
    dur: np.ndarray,
    own: np.ndarray,
    stages: Sequence[Range],
) -> list[OpTotal]:
    """Operator time per (stage, category, name); ``when``: the host time that decides an
    event's stage (its start; a device event's launch)."""
    op_keys: dict[tuple[str, str], int] = {}
    key_of_head = np.full(len(heads), -1, np.int64)
    for i, (cat, name, _pid, _tid) in enumerate(heads):
        if cat in CPU_OP_CATEGORIES or cat in GPU_OP_CATEGORIES:
            key_of_head[i] = op_keys.setdefault((str(cat), str(name)), len(op_keys))
    if not op_keys or len(gid) == 0:
        return []
    key = key_of_head[gid]
    sel = np.flatnonzero(key >= 0)
    labels = sorted({s.name for s in stages})
    label_ix = {name: i for i, name in enumerate(labels)}
    outside = len(labels)
    stage_of = np.full(len(sel), outside, np.int64)
    if stages:  # the same rule as the GPU breakdown's (gpu.stage_pieces)
        starts, ends, names = stage_pieces(stages)
        lab = np.array([label_ix[name] for name in names])
        at = stage_index(starts, ends, when[sel])
        stage_of[at >= 0] = lab[at[at >= 0]]
    k = len(op_keys)
    flat = stage_of * k + key[sel]
    size = (outside + 1) * k
    calls = np.bincount(flat, minlength=size)
    own_sum = np.bincount(flat, weights=own[sel], minlength=size)
    total = np.bincount(flat, weights=dur[sel], minlength=size)
    names = list(op_keys)
    out = []
    for f in np.flatnonzero(calls).tolist():
        s, o = divmod(f, k)
        cat, name = names[o]
        out.append(
            OpTotal(
                labels[s] if s < outside else None,
                cat,
                name,
                int(calls[f]),
                float(own_sum[f]),
                float(total[f]),
            )
        )
    return out


_HEADER_KEYS = ("profd", "distributedInfo", "baseTimeNanoseconds", "host_name", "profdMerge")


def digest_file(
    path: Path | str,
    *,
    pseudo_stage: str | None = None,
    force_generic: bool = False,
    segment_bytes: int = SEGMENT_BYTES,
) -> FileDigest:
    """Digest one trace. A file that cannot be read comes back with :attr:`FileDigest.error`.

    ``pseudo_stage`` labels the whole activity of a trace that profd did not write (a rollout
    engine's), so its operators still land in the per-stage tables.
    """
    started = time.perf_counter()
    pad_worker_heap()
    p = Path(path)
    digest = FileDigest(path=str(p), file_bytes=p.stat().st_size)
    try:
        stream = TraceStream(p, segment_bytes)
        cols = heads = None
        if not force_generic:
            try:
                cols, heads = scan_fast(stream)
                digest.mode = "fast"
            except LayoutMismatch as exc:
                log.debug("%s: generic parse (%s)", p.name, exc)
        if cols is None:
            stream = TraceStream(p, segment_bytes)
            cols, heads = scan_generic(stream)
            digest.mode = "generic"
        assert heads is not None
        digest.json_bytes = stream.json_bytes
        header = stream.header or stream.quick_header()
        if "profdMerge" in header:
            raise TraceReadError(p, MERGED)
        _fill(digest, header, cols, heads, pseudo_stage)
    except (TraceReadError, OSError, ValueError, KeyError, TypeError) as exc:
        digest.error = (
            exc.reason if isinstance(exc, TraceReadError) else f"{type(exc).__name__}: {exc}"
        )
    digest.seconds = time.perf_counter() - started
    return digest


def _fill(
    digest: FileDigest,
    header: dict[str, Any],
    cols: Columns,
    heads: list[tuple[Any, ...]],
    pseudo_stage: str | None,
) -> None:
    digest.header = {k: header[k] for k in _HEADER_KEYS if k in header}
    base = header.get("baseTimeNanoseconds")
    # on the coordinator's clock: the file's wall clock plus its agent's measured offset
    digest.base_us = (
        float(base) / 1000.0 + clock_offset_us(header) if isinstance(base, int | float) else 0.0
    )
    gid, ts, dur, corr = cols.arrays()
    digest.events = len(ts)
    if len(ts) == 0:
        return
    digest.first_ts = float(ts.min())
    digest.last_end = float((ts + dur).max())
    thread_ids: dict[tuple[Any, Any], int] = {}
    thread_of_head = np.array(
        [thread_ids.setdefault((h[2], h[3]), len(thread_ids)) for h in heads], np.int64
    )
    digest.threads = list(thread_ids)
    thread = thread_of_head[gid]
    _fill_ranges(digest, heads, gid, ts, dur, thread)
    if isinstance(own := header.get("profd"), dict):
        _drop_partial_steps(digest, own)
    steps = step_ranges(digest.ranges)
    scope = own.get("scope") if isinstance(own, dict) else None  # a discrete trace's: its stage
    if isinstance(own, dict):
        stages = select_stages(digest.ranges, scope if isinstance(scope, str) else None)
        digest.stages = [digest.ranges[i] for i in stages]
    elif pseudo_stage and steps:  # torch's ProfilerStep rows: the trace's activity per step
        digest.stages = [Range(pseudo_stage, r.ts, r.dur, r.thread) for _, r in steps]
    elif pseudo_stage:
        span = digest.last_end - digest.first_ts
        digest.stages = [Range(pseudo_stage, digest.first_ts, span, _busiest(thread))]
    attributed = digest.stages
    piece = is_stage_scope(scope) and not steps and own.get("step") in digest.partial_steps
    if piece and not attributed:
        # a discrete stage's piece (a schedule's window, or cut short): not a stage time,
        # but all of it ran in that stage (its operators and device time count there)
        span = digest.last_end - digest.first_ts
        attributed = [Range(scope, digest.first_ts, span, _busiest(thread))]
    device = np.array([h[0] in GPU_OP_CATEGORIES for h in heads], bool)[gid]
    launcher = np.array([str(h[0]).endswith(("_runtime", "_driver")) for h in heads], bool)
    when = launch_times(ts, corr, device, launcher[gid])
    own = self_times(thread, ts, dur)
    digest.ops = _op_totals(heads, gid, when, dur, own, attributed)
    if device.any():
        cls = np.array(
            [kernel_class(str(h[0]), str(h[1])) if h[0] in GPU_OP_CATEGORIES else 0 for h in heads],
            np.int8,
        )
        d = np.flatnonzero(device)
        spans = [(r.ts, r.end) for _, r in steps]
        digest.gpu = file_gpu(ts[d], dur[d], cls[gid[d]], when[d], spans, attributed)


def _drop_partial_steps(digest: FileDigest, own: dict[str, Any]) -> None:
    """Leave out what the file holds of steps only in part, whose times are cut short.

    ``own``: the header's ``profd`` keys. ``steps``: the steps the file holds whole
    (absent before profd wrote it: every step counts). A step range not among them goes,
    with the ranges that began in it (the window ended inside the step). Ranges before the
    first step range go when the window began inside ``began_in_step`` (a timed window
    opened at a stage mark). A discrete trace holds a stage of its ``step`` and no step
    range: not among ``steps`` (cut inside the stage, or one of a schedule's windows of a
    few mini-batches), its stage ranges go and its mini-batches stay (each is whole)."""
    whole = own.get("steps")
    if not isinstance(whole, list):
        return
    steps = step_ranges(digest.ranges)
    partial = {n for n, _ in steps if n not in whole}
    cut = [(r.ts, r.end) for n, r in steps if n not in whole]
    kept = digest.ranges
    began = own.get("began_in_step")
    if isinstance(began, int) and began not in whole:
        partial.add(began)
        first = steps[0][1].ts if steps else float("inf")
        kept = [r for r in kept if r.ts >= first]
    step = own.get("step")
    if not steps and isinstance(step, int) and step not in whole:
        partial.add(step)
        kept = [r for r in kept if marker(r.name) is not None]
    if cut:
        kept = [r for r in kept if not any(a <= r.ts <= b for a, b in cut)]
    digest.ranges = kept
    digest.partial_steps = sorted(partial)


def _fill_ranges(
    digest: FileDigest,
    heads: list[tuple[Any, ...]],
    gid: np.ndarray,
    ts: np.ndarray,
    dur: np.ndarray,
    thread: np.ndarray,
) -> None:
    is_range = np.array([h[0] == RANGE_CATEGORY for h in heads], bool)
    idx = np.flatnonzero(is_range[gid])
    digest.ranges = sorted(
        (
            Range(str(heads[g][1]), t, d, th)
            for g, t, d, th in zip(
                gid[idx].tolist(),
                ts[idx].tolist(),
                dur[idx].tolist(),
                thread[idx].tolist(),
                strict=True,
            )
        ),
        key=lambda r: r.ts,
    )


def _busiest(thread: np.ndarray) -> int:
    return int(Counter(thread.tolist()).most_common(1)[0][0]) if len(thread) else 0
