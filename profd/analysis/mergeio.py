"""The two per-file passes of ``profd merge``, run in worker processes.

* :func:`scan_file` reads a trace once and returns, per event (in file order), its start,
  duration, category and serialized size — a few bytes per event — plus the file's thread
  names and ranges. The parent decides from these what to keep.
* :func:`write_file` reads it again and writes the kept events, moved onto their track, to
  a fragment file the parent concatenates.

Both see the events in the same order (``jsonscan.TraceStream.event_lists``), so an event's
index is the same in both passes.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from profd.analysis.clocks import clock_offset_us
from profd.analysis.jsonscan import TraceReadError, TraceStream
from profd.analysis.ranges import RANGE_CATEGORY

__all__ = ["FileScan", "ScanJob", "WriteJob", "WriteResult", "scan_file", "write_file"]

#: Bytes added to each event's size estimate: pid / tid / ts / flow ids are rewritten and
#: may grow by a few digits.
SIZE_MARGIN = 16
#: Synthetic thread ids (for device streams and Kineto's string "threads") live here: above
#: any OS thread id, and below 2**31 so every viewer reads them as plain integers.
SYNTH_TID_BASE = 1_000_000_000
FLOW_PHASES = frozenset({"s", "t", "f", "b", "e", "n", "S", "T", "F"})
_OWN_METADATA = frozenset({"process_name", "process_labels", "process_sort_index"})


@dataclass(frozen=True, slots=True)
class ScanJob:
    path: str


@dataclass(slots=True)
class FileScan:
    path: str
    header: dict[str, Any] = field(default_factory=dict)
    base_us: float = 0.0
    main_pid: Any = None
    process_names: dict[str, str] = field(default_factory=dict)  # repr(pid) -> name
    ranges: list[tuple[str, float, float]] = field(default_factory=list)  # user_annotation
    ts: np.ndarray = field(default_factory=lambda: np.zeros(0))
    dur: np.ndarray = field(default_factory=lambda: np.zeros(0))
    size: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    category: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    categories: list[str] = field(default_factory=list)
    metadata_bytes: int = 0
    error: str | None = None


def scan_file(job: ScanJob) -> FileScan:
    out = FileScan(path=job.path)
    try:
        stream = TraceStream(job.path)
        ts: list[float] = []
        dur: list[float] = []
        size: list[int] = []
        cat: list[int] = []
        cats: dict[str, int] = {}
        pid_count: dict[Any, int] = {}
        for events in stream.event_lists():
            for e in events:
                if not isinstance(e, dict):
                    continue
                if e.get("ph") == "M":
                    _scan_metadata(e, out)
                    continue
                c = str(e.get("cat", ""))
                t = e.get("ts")
                ts.append(float(t) if isinstance(t, int | float) else np.nan)
                d = e.get("dur")
                dur.append(float(d) if isinstance(d, int | float) else 0.0)
                size.append(len(orjson.dumps(e)) + SIZE_MARGIN)
                cat.append(cats.setdefault(c, len(cats)))
                if c == RANGE_CATEGORY and e.get("ph") == "X":
                    out.ranges.append((str(e.get("name", "")), ts[-1], dur[-1]))
                if c in ("cpu_op", RANGE_CATEGORY):
                    pid_count[e.get("pid")] = pid_count.get(e.get("pid"), 0) + 1
        header = stream.header or stream.quick_header()
        if "profdMerge" in header:
            raise TraceReadError(job.path, "a merged trace written by `profd merge`")
        out.header = {
            k: header[k] for k in ("profd", "distributedInfo", "host_name") if k in header
        }
        base = header.get("baseTimeNanoseconds")
        # on the coordinator's clock: the file's wall clock plus its agent's measured offset
        wall = isinstance(base, int | float)
        out.base_us = float(base) / 1000.0 + clock_offset_us(header) if wall else 0.0
        meta = header.get("profd") if isinstance(header.get("profd"), dict) else {}
        out.main_pid = meta.get("pid") or (max(pid_count, key=pid_count.get) if pid_count else None)
        out.ts = np.array(ts, np.float64)
        out.dur = np.array(dur, np.float64)
        out.size = np.array(size, np.int64)
        out.category = np.array(cat, np.int32)
        out.categories = list(cats)
    except (TraceReadError, OSError, ValueError, TypeError) as exc:
        out.error = (
            exc.reason if isinstance(exc, TraceReadError) else f"{type(exc).__name__}: {exc}"
        )
    return out


def _scan_metadata(e: dict[str, Any], out: FileScan) -> None:
    if e.get("name") == "process_name":
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        out.process_names[repr(e.get("pid"))] = str(args.get("name", ""))
    elif e.get("name") in ("thread_name", "thread_sort_index"):
        out.metadata_bytes += len(orjson.dumps(e)) + SIZE_MARGIN


@dataclass(frozen=True, slots=True)
class WriteJob:
    path: str
    fragment: str
    file_index: int
    track_pid: int
    main_pid: Any
    offset_us: float
    keep: np.ndarray  # one bool per non-metadata event, in file order
    process_names: dict[str, str]


@dataclass(frozen=True, slots=True)
class WriteResult:
    events: int
    bytes: int
    error: str | None = None


class _Mover:
    """Puts one file's events onto its track: pid, thread ids, clock and flow ids."""

    def __init__(self, job: WriteJob) -> None:
        self.job = job
        self.tids: dict[tuple[str, str], int] = {}
        self.named: set[int] = set()

    def tid(self, pid: Any, tid: Any) -> tuple[int, bool]:
        if pid == self.job.main_pid and isinstance(tid, int) and not isinstance(tid, bool):
            return tid, False
        key = (repr(pid), repr(tid))
        new = self.tids.get(key)
        if new is None:
            new = SYNTH_TID_BASE + zlib.crc32(repr(key).encode()) % SYNTH_TID_BASE
            self.tids[key] = new
        return new, True

    def thread_label(self, pid: Any, tid: Any, name: str | None) -> str:
        proc = self.job.process_names.get(repr(pid)) or (str(pid) if pid not in ("", None) else "")
        thread = name or (str(tid) if tid not in ("", None) else "")
        return " / ".join(x for x in (proc, thread) if x) or "(trace)"

    def name_event(self, tid: int, label: str) -> bytes:
        self.named.add(tid)
        return orjson.dumps(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": self.job.track_pid,
                "tid": tid,
                "args": {"name": label},
            }
        )

    def move(self, e: dict[str, Any], out: list[bytes]) -> None:
        job = self.job
        orig_pid, orig_tid = e.get("pid"), e.get("tid")
        new_tid, synthetic = self.tid(orig_pid, orig_tid)
        e["pid"] = job.track_pid
        e["tid"] = new_tid
        if job.offset_us and isinstance(e.get("ts"), int | float):
            e["ts"] = e["ts"] + job.offset_us
        ph = e.get("ph")
        if ph in FLOW_PHASES and "id" in e:
            ident = e["id"]
            if isinstance(ident, int) and not isinstance(ident, bool):
                e["id"] = (job.file_index << 32) | (ident & 0xFFFFFFFF)
            else:
                e["id"] = f"{job.file_index}:{ident}"
        if ph in ("i", "I") and e.get("s") == "g":
            e["s"] = "p"  # a global instant of one rank would cover every track
        if synthetic and new_tid not in self.named:
            out.append(self.name_event(new_tid, self.thread_label(orig_pid, orig_tid, None)))
        out.append(orjson.dumps(e))

    def metadata(self, e: dict[str, Any], out: list[bytes]) -> None:
        name = e.get("name")
        if name in _OWN_METADATA or name not in ("thread_name", "thread_sort_index"):
            return
        new_tid, synthetic = self.tid(e.get("pid"), e.get("tid"))
        if name == "thread_name" and synthetic:
            args = e.get("args") if isinstance(e.get("args"), dict) else {}
            label = self.thread_label(e.get("pid"), e.get("tid"), args.get("name"))
            out.append(self.name_event(new_tid, label))
            return
        e["pid"], e["tid"] = self.job.track_pid, new_tid
        if name == "thread_name":
            self.named.add(new_tid)
        out.append(orjson.dumps(e))


def write_file(job: WriteJob) -> WriteResult:
    mover = _Mover(job)
    written = 0
    size = 0
    index = 0
    keep = job.keep
    try:
        with open(job.fragment, "wb") as frag:
            for events in TraceStream(job.path).event_lists():
                out: list[bytes] = []
                for e in events:
                    if not isinstance(e, dict):
                        continue
                    if e.get("ph") == "M":
                        mover.metadata(e, out)
                        continue
                    if keep[index]:
                        mover.move(e, out)
                    index += 1
                if out:
                    chunk = b",".join(out)
                    frag.write(b"," + chunk if size else chunk)
                    size += len(chunk) + (1 if size else 0)
                    written += len(out)
    except (TraceReadError, OSError, ValueError, IndexError) as exc:
        Path(job.fragment).unlink(missing_ok=True)
        reason = exc.reason if isinstance(exc, TraceReadError) else f"{type(exc).__name__}: {exc}"
        return WriteResult(0, 0, reason)
    return WriteResult(written, size)
