"""One trace file → a compact :class:`FileDigest`: its header, its ``user_annotation`` ranges,
its stages, and operator time per stage (self and total).

This runs once per file, in a worker process, and is what makes ``profd summarize`` fast:

* **Fast path** (Kineto traces, i.e. every torch.profiler / profd / vLLM / SGLang trace): the
  JSON text is scanned with one regular expression per event head (``"ph": "X"`` … ``"dur"``),
  one 512 KiB run at a time; only the ``cat``/``name``/``pid``/``tid`` text of each event is
  kept, interned, and parsed once per distinct value. It checks itself: every ``"ph": "X"``
  is matched, and one whose fields do not follow the expected layout comes back empty, which
  sends the whole file to the generic path. No event is ever silently skipped.
* **Generic path**: the events are parsed with orjson in runs (see :mod:`.jsonscan`), including
  ``B``/``E`` pairs, which Kineto never writes but other tools do.

Self time (an event's duration minus that of the events directly inside it on the same
thread) is computed with numpy, by nesting depth, without a Python loop per event.
"""

from __future__ import annotations

import itertools
import logging
import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import orjson

from profd.analysis.clocks import clock_offset_us
from profd.analysis.gpu import (
    GpuFile,
    file_gpu,
    kernel_class,
    launch_times,
    stage_index,
    stage_pieces,
)
from profd.analysis.jsonscan import SEGMENT_BYTES, TraceReadError, TraceStream
from profd.analysis.ranges import RANGE_CATEGORY, Range, select_stages, step_ranges

__all__ = ["CPU_OP_CATEGORIES", "GPU_OP_CATEGORIES", "FileDigest", "OpTotal", "digest_file"]

log = logging.getLogger(__name__)

#: Host-side events that count as operators (``cuda_runtime`` is where launch overhead shows).
CPU_OP_CATEGORIES = frozenset({"cpu_op", "cuda_runtime", "cuda_driver"})
#: Device-side events that count as operators.
GPU_OP_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})

# torch >= 2.x: one key per line. The head is matched loosely so that every X event is seen
# (and every B / E event, whose missing tail sends the file to the generic path, which pairs
# them); the optional tail is the layout: the four lines after "ph" (cat, name, pid, tid —
# their text is parsed as JSON later and must hold exactly those keys), then ts and dur.
# A value never contains a raw newline in JSON, so "[^\n]*" safely skips one. Quantifiers
# are possessive ("*+": each run stops at a character its class excludes, so nothing is
# lost), which saves the regex engine its backtracking bookkeeping.
# After dur, the "args" of a launch or device event (the categories in _LINKED, marked by
# the empty group "linked") are searched for its "correlation" id: it links a kernel to the
# cuda_runtime call that launched it. The search steps over whole strings (possessively: no
# backtracking) and stops at the first "}" outside one: it never leaves the event. Other
# events' args are not searched (a cpu_op's recorded shapes would cost five times the
# scan). An id anywhere else is not missed silently: a segment's count of the key must
# equal the ids captured (_Columns.add_found), else the file takes the generic path.
_LINKED = (
    rb'"(?:kernel|gpu_mem(?:cpy|set)|cuda_(?:runtime|driver|sync)|privateuse1_(?:runtime|driver))"'
    rb"(?=\s*+,)(?P<linked>)"  # the whole value, then the mark
)
_ARGS_CORRELATION = (
    rb'(?(linked)(?:\s*+,\s*+"args"\s*+:\s*+\{(?:[^"}]++|"(?!correlation")(?:[^"\\]++|\\.)*+")*+'
    rb'"correlation"\s*+:\s*+(\d++))?)'
)
_KINETO = re.compile(
    rb'"ph"\s*+:\s*+"[XBE]"(?:,\n\s*+("cat": (?:' + _LINKED + rb"|)"
    rb"[^\n]*+\n[^\n]*+\n[^\n]*+\n[^\n,]*+),\n\s*+"
    rb'"ts": ([0-9.]++),\n\s*+"dur": ([0-9.]++)' + _ARGS_CORRELATION + rb")?"
)
_STR = rb'"[^"\\]*(?:\\.[^"\\]*)*"'
_NUM = rb"-?[0-9][0-9.eE+\-]*"
# Any whitespace, same key order (older Kineto, compact writers, profd merge output).
_FLEXIBLE = re.compile(
    rb'"ph"\s*:\s*"[XBE]"(?:\s*,\s*("cat"\s*:\s*(?:'
    + _LINKED
    + rb"|"
    + _STR
    + rb')\s*,\s*"name"\s*:\s*'
    + _STR
    + rb'\s*,\s*"pid"\s*:\s*(?:'
    + _STR
    + rb"|-?\d+)"
    + rb'\s*,\s*"tid"\s*:\s*(?:'
    + _STR
    + rb'|-?\d+))\s*,\s*"ts"\s*:\s*('
    + _NUM
    + rb')\s*,\s*"dur"\s*:\s*('
    + _NUM
    + rb")"
    + _ARGS_CORRELATION
    + rb")?"
)
_CORRELATION_KEY = b'"correlation"'
# findall's groups: head text, the "linked" mark, ts, dur, correlation id
_G, _TS, _DUR, _CORR = itemgetter(0), itemgetter(2), itemgetter(3), itemgetter(4)
MERGED = "a merged trace written by `profd merge` (not a rank's trace)"


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
    mode: str = ""
    seconds: float = 0.0
    error: str | None = None


class _Columns:
    """Per-event columns of one file: head id (into ``heads``), start, duration and
    correlation id (-1: none)."""

    def __init__(self) -> None:
        self.ids: defaultdict[Any, int] = defaultdict(itertools.count().__next__)
        self.gid: list[np.ndarray] = []
        self.ts: list[np.ndarray] = []
        self.dur: list[np.ndarray] = []
        self.corr: list[np.ndarray] = []

    def add(
        self, keys: Iterable[Any], ts: Iterable[Any], dur: Iterable[Any], corr: np.ndarray, n: int
    ) -> None:
        """Append ``n`` events; ``ValueError`` (nothing appended) if a number does not parse."""
        d = np.fromiter(map(float, dur), np.float64, n)
        t = np.fromiter(map(float, ts), np.float64, n)
        self.gid.append(np.fromiter(map(self.ids.__getitem__, keys), np.int64, n))
        self.ts.append(t)
        self.dur.append(d)
        self.corr.append(corr)

    def add_found(self, found: list[tuple[bytes, ...]], correlation_keys: int) -> None:
        """Append the regex matches of one segment; ``ValueError`` (nothing appended) if a
        number does not parse or the segment holds a correlation id no match captured."""
        n = len(found)
        corr = np.full(n, -1, np.int64)
        if correlation_keys:  # none in the text: none captured either (CPU-only traces)
            raw = np.array(list(map(_CORR, found)))  # bytes, b"" where there is none
            has = raw != b""
            if int(has.sum()) != correlation_keys:
                raise ValueError("a correlation id outside the expected place")
            corr[has] = raw[has].astype(np.int64)
        self.add(map(_G, found), map(_TS, found), map(_DUR, found), corr, n)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if not self.gid:
            empty = np.zeros(0)
            return np.zeros(0, np.int64), empty, empty, np.zeros(0, np.int64)
        return (
            np.concatenate(self.gid),
            np.concatenate(self.ts),
            np.concatenate(self.dur),
            np.concatenate(self.corr),
        )


class _LayoutMismatch(Exception):
    pass


def _scan_fast(stream: TraceStream) -> tuple[_Columns, list[tuple[Any, ...]]]:
    cols = _Columns()
    pattern = _KINETO
    for seg in stream.raw_segments():
        if b'"profdMerge"' in stream.prefix:  # written first by profd merge: skip it early
            raise TraceReadError(stream.path, MERGED)
        if not stream.prefix.lstrip()[:1] == b"{" or b'"schemaVersion"' not in stream.prefix:
            raise _LayoutMismatch("not a Kineto trace")
        found = pattern.findall(seg)
        if not found:
            continue
        keys = bytes(seg).count(_CORRELATION_KEY)  # a copy, but a fast search
        try:  # an event whose tail did not match has empty fields: float(b"") fails
            cols.add_found(found, keys)
            continue
        except ValueError:
            if pattern is _FLEXIBLE:
                raise _LayoutMismatch("an event does not follow the expected key order") from None
        pattern = _FLEXIBLE
        found = pattern.findall(seg)
        try:
            cols.add_found(found, keys)
        except ValueError:
            raise _LayoutMismatch("an event does not follow the expected key order") from None
    heads: list[tuple[Any, ...]] = []
    for text in cols.ids:  # once per distinct (cat, name, pid, tid) text
        try:
            h = orjson.loads(b"{" + text + b"}")
            heads.append((h["cat"], h["name"], h["pid"], h["tid"]))
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise _LayoutMismatch(f"unexpected event fields: {bytes(text[:200])!r}") from None
    return cols, heads


def _scan_generic(stream: TraceStream) -> tuple[_Columns, list[tuple[Any, ...]]]:
    cols = _Columns()
    open_b: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for events in stream.event_lists():
        keys: list[tuple[Any, ...]] = []
        ts: list[float] = []
        dur: list[float] = []
        corr: list[int] = []
        for e in events:
            if not isinstance(e, dict):
                continue
            ph = e.get("ph")
            if ph == "X":
                keys.append((e.get("cat", ""), e.get("name", ""), e.get("pid"), e.get("tid")))
                ts.append(e.get("ts", 0.0))
                dur.append(e.get("dur", 0.0))
                corr.append(_correlation(e))
            elif ph == "B":
                open_b[(e.get("pid"), e.get("tid"))].append(e)
            elif ph == "E":
                stack = open_b.get((e.get("pid"), e.get("tid")))
                if stack:
                    b = stack.pop()
                    keys.append((b.get("cat", ""), b.get("name", ""), b.get("pid"), b.get("tid")))
                    ts.append(b.get("ts", 0.0))
                    dur.append(float(e.get("ts", 0.0)) - float(b.get("ts", 0.0)))
                    corr.append(_correlation(b))
        if keys:
            cols.add(keys, ts, dur, np.array(corr, np.int64), len(keys))
    return cols, list(cols.ids)


def _correlation(event: dict[str, Any]) -> int:
    """An event's ``args.correlation`` (a launch's or a device event's), -1 without one."""
    args = event.get("args")
    value = args.get("correlation") if isinstance(args, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else -1


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
        by_depth = np.argsort(depth, kind="stable")
        counts = np.bincount(depth)
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
    p = Path(path)
    digest = FileDigest(path=str(p), file_bytes=p.stat().st_size)
    try:
        stream = TraceStream(p, segment_bytes)
        cols = heads = None
        if not force_generic:
            try:
                cols, heads = _scan_fast(stream)
                digest.mode = "fast"
            except _LayoutMismatch as exc:
                log.debug("%s: generic parse (%s)", p.name, exc)
        if cols is None:
            stream = TraceStream(p, segment_bytes)
            cols, heads = _scan_generic(stream)
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
    cols: _Columns,
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
    steps = step_ranges(digest.ranges)
    if isinstance(header.get("profd"), dict):
        digest.stages = [digest.ranges[i] for i in select_stages(digest.ranges)]
    elif pseudo_stage and steps:  # torch's ProfilerStep rows: the trace's activity per step
        digest.stages = [Range(pseudo_stage, r.ts, r.dur, r.thread) for _, r in steps]
    elif pseudo_stage:
        span = digest.last_end - digest.first_ts
        digest.stages = [Range(pseudo_stage, digest.first_ts, span, _busiest(thread))]
    device = np.array([h[0] in GPU_OP_CATEGORIES for h in heads], bool)[gid]
    launcher = np.array([str(h[0]).endswith(("_runtime", "_driver")) for h in heads], bool)
    when = launch_times(ts, corr, device, launcher[gid])
    own = self_times(thread, ts, dur)
    digest.ops = _op_totals(heads, gid, when, dur, own, digest.stages)
    if device.any():
        cls = np.array(
            [kernel_class(str(h[0]), str(h[1])) if h[0] in GPU_OP_CATEGORIES else 0 for h in heads],
            np.int8,
        )
        d = np.flatnonzero(device)
        spans = [(r.ts, r.end) for _, r in steps]
        digest.gpu = file_gpu(ts[d], dur[d], cls[gid[d]], when[d], spans, digest.stages)


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
