"""``profd export --hta``: a session's traces as a folder HTA (Holistic Trace Analysis) loads.

HTA (``TraceAnalysis(trace_dir=...)``) takes every ``*.json`` / ``*.gz`` file of one folder as
one rank, reads that rank from the first ``"rank": <n>`` in the file's text (meant to be
``distributedInfo.rank``; a file without one becomes rank 0, and a second file with the same
rank replaces the first), and counts steps by torch's ``ProfilerStep#<n>`` rows. A profd
session folder breaks all three: ``actor`` rank 0 and ``critic`` rank 0 both say rank 0, a
rank has one file per profiled step, and profd marks its steps ``step<n>``. The export
writes, for each (role, rank) — each track of ``profd summarize`` — one file:

* the events of the track's files, copied as text (never parsed into objects or rewritten),
  in time order, one file after the other; files of one track recorded by different
  processes (a restarted worker: another pid or ``baseTimeNanoseconds``) stay apart, each
  its own HTA rank, since their ids and time bases differ;
* a ``ProfilerStep#<n>`` row (category ``user_annotation``, on the thread of the step range,
  as torch writes it) exactly over each of profd's ``step<n>`` ranges, in a file without
  ``ProfilerStep`` rows of its own (a plain torch.profiler trace keeps torch's);
* ``distributedInfo`` first in the file, with ``rank`` first in it: a rank unique in the
  folder (tracks in ``profd summarize``'s order — roles by name, then ranks, then rollout
  replicas, then other files — numbered from 0) and ``world_size`` the number of files;
  the first source file's other header keys follow the events, with ``profdHta`` (the
  original role, rank and source files).

Beside them, ``profd-hta-ranks.jsonl`` maps HTA's rank numbers back (one :class:`HtaRank` per
line; ``.jsonl`` so that HTA does not read it as a trace). The session folder is never
written to. The output folder is built under a temporary name beside it and renamed once
complete; an existing, non-empty folder is refused. Pure: no Ray, torch or HTA import.
"""

from __future__ import annotations

import gzip
import json
import logging
import shutil
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field

from profd.analysis.clocks import clock_offset_us
from profd.analysis.digest import GPU_OP_CATEGORIES, FileDigest
from profd.analysis.jsonscan import TraceStream
from profd.analysis.models import SkippedFile
from profd.analysis.ranges import PROFILER_STEP, RANGE_CATEGORY, step_ranges
from profd.analysis.sources import TrackIdentity, identify, is_trace_name
from profd.analysis.summary import digest_all, track_order
from profd.core.naming import sanitize

__all__ = ["HTA_RANKS_FILE", "HtaExport", "HtaRank", "export_hta"]

log = logging.getLogger(__name__)

#: The rank map written beside the traces (not ``.json``: HTA would load it as a trace).
HTA_RANKS_FILE = "profd-hta-ranks.jsonl"
GZIP_LEVEL = 6  # as the agent writes its traces


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class HtaRank(_Frozen):
    """One file of the export: which profd track HTA's rank number stands for."""

    hta_rank: int = Field(description="distributedInfo.rank in the exported file (HTA's rank).")
    file: str = Field(description="File name inside the export folder.")
    track: str = Field(description="profd's track label, as `profd summarize` prints it.")
    kind: str = Field(description="'rank', 'rollout' or 'file' (a trace profd did not write).")
    role: str | None = Field(description="Role of the track.")
    rank: int | None = Field(description="Rank of the track within its role (its own numbering).")
    replica: int | None = Field(description="Rollout replica (rollout tracks only).")
    sources: list[str] = Field(description="Session files copied into it, in time order.")
    steps: list[int] = Field(description="Steps of those files (profd's, or torch's rows).")
    added_profiler_steps: list[int] = Field(
        description="Steps whose ProfilerStep#<n> row the export added (none where a file "
        "had torch's rows)."
    )
    device_events: bool = Field(description="Whether its files hold kernels / memcpy / memset.")
    clock_offset_us: float = Field(
        description="profd's measured offset to the coordinator's clock (profd.clock.offset_us "
        "of its first file); not applied: timestamps are copied as recorded."
    )


class HtaExport(_Frozen):
    """What ``export_hta`` wrote."""

    source: str = Field(description="The session folder read.")
    output: str = Field(description="The folder written (load it with HTA's TraceAnalysis).")
    world_size: int = Field(description="Number of HTA ranks (files) written.")
    ranks: list[HtaRank] = Field(description="One per file, by HTA rank.")
    skipped: list[SkippedFile] = Field(description="Files of the session not exported, and why.")
    notes: list[str] = Field(description="What HTA will make of some ranks (read before use).")


@dataclass(slots=True)
class _Group:
    """The files that become one HTA rank."""

    ident: TrackIdentity
    digests: list[FileDigest]


def export_hta(
    session: Path | str,
    out_dir: Path | str,
    *,
    steps: Collection[int] | None = None,
    workers: int | None = None,
) -> HtaExport:
    """Write ``session``'s traces into ``out_dir`` (new, or empty) in HTA's layout.

    ``steps``: only the files that hold one of these steps (a folder per step is what makes
    HTA's idle time per rank equal profd's, see ``docs/hta-export.md``).
    """
    started = time.perf_counter()
    root, out = Path(session), Path(out_dir)
    traces, skipped = _inventory(root)
    _check_output(out, root)
    digests, _ = digest_all(traces, workers=workers)
    groups, more_skipped = _plan(digests, steps)
    skipped += more_skipped
    if not groups:
        wanted = f" with step {', '.join(map(str, sorted(steps)))}" if steps else ""
        raise ValueError(f"session: no readable trace file{wanted} in {root}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir()
    try:
        ranks = _write_all(groups, tmp)
        with open(tmp / HTA_RANKS_FILE, "w", encoding="utf-8") as f:
            f.writelines(r.model_dump_json() + "\n" for r in ranks)
        if out.exists():
            out.rmdir()  # empty (checked above): rename replaces nothing
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    took = time.perf_counter() - started
    log.info("HTA export: %d rank(s) from %s written to %s in %.1f s", len(ranks), root, out, took)
    return HtaExport(
        source=str(root),
        output=str(out),
        world_size=len(ranks),
        ranks=ranks,
        skipped=sorted(skipped, key=lambda s: s.name),
        notes=_notes(ranks),
    )


def _inventory(root: Path) -> tuple[list[Path], list[SkippedFile]]:
    """The session's trace files, and its other visible entries (skipped, with the reason).
    Hidden files are profd's own records (``.profd-windows.jsonl``, temporaries)."""
    if not root.is_dir():
        raise ValueError(f"session: {root} is not a directory")
    traces: list[Path] = []
    skipped: list[SkippedFile] = []
    for p in sorted(root.iterdir()):
        if p.name.startswith("."):
            continue
        if p.is_file() and is_trace_name(p.name):
            traces.append(p)
        elif p.is_dir():
            skipped.append(SkippedFile(name=p.name, reason="a folder, not a Chrome trace"))
        elif p.suffix == ".pickle":
            skipped.append(SkippedFile(name=p.name, reason="a memory snapshot, not a trace"))
        else:
            skipped.append(SkippedFile(name=p.name, reason="not a .json / .json.gz trace"))
    if not traces:
        raise ValueError(f"session: no trace files (*.json, *.json.gz) in {root}")
    return traces, skipped


def _check_output(out: Path, session: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir: {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"out_dir: {out} exists and is not empty (choose a new folder)")
    if out.resolve() == session.resolve():
        raise ValueError("out_dir: must not be the session folder (it is never written to)")


def _file_steps(d: FileDigest) -> list[int]:
    return sorted({n for n, _ in step_ranges(d.ranges)})


def _plan(
    digests: Sequence[FileDigest], steps: Collection[int] | None
) -> tuple[list[_Group], list[SkippedFile]]:
    """Group the readable files into HTA ranks, in track order, then by start."""
    skipped: list[SkippedFile] = []
    groups: dict[tuple[Any, ...], _Group] = {}
    for d in digests:
        name = Path(d.path).name
        if d.error is not None:
            skipped.append(SkippedFile(name=name, reason=d.error))
            continue
        if d.events == 0:
            skipped.append(SkippedFile(name=name, reason="no events (HTA cannot load it)"))
            continue
        if steps is not None and not set(_file_steps(d)) & set(steps):
            continue  # not asked for: left out, not skipped
        ident = identify(name, d.header)
        meta = d.header.get("profd") if isinstance(d.header.get("profd"), dict) else {}
        key = (ident.key, meta.get("pid"), d.header.get("baseTimeNanoseconds"))
        groups.setdefault(key, _Group(ident, [])).digests.append(d)
    for g in groups.values():
        g.digests.sort(key=_start)
    ordered = sorted(groups.values(), key=lambda g: (track_order(g.ident), _start(g.digests[0])))
    return ordered, skipped


def _start(d: FileDigest) -> float:
    return d.base_us + (d.first_ts or 0.0)


def _write_all(groups: Sequence[_Group], into: Path) -> list[HtaRank]:
    width = len(str(len(groups) - 1))
    seen: dict[str, int] = {}
    ranks = []
    for hta_rank, g in enumerate(groups):
        slug = _slug(g.ident)
        seen[slug] = seen.get(slug, 0) + 1
        if seen[slug] > 1:  # the same track from another process
            slug += f"_proc{seen[slug]}"
        name = f"rank{hta_rank:0{width}d}_{slug}.json.gz"
        ranks.append(_write_rank(g, hta_rank, len(groups), into / name))
    return ranks


def _slug(ident: TrackIdentity) -> str:
    if ident.kind == "rank":
        return f"{sanitize(ident.role)}-rank{ident.rank}" if ident.role else f"rank{ident.rank}"
    if ident.kind == "rollout":
        glob = f"-globalrank{ident.rank}" if ident.rank is not None else ""
        return f"rollout-replica{ident.replica}{glob}"
    name = ident.key.split(":", 1)[1]
    return sanitize(name.removesuffix(".gz").removesuffix(".json")) or "trace"


def _profiler_steps(d: FileDigest) -> list[tuple[int, bytes]]:
    """``ProfilerStep#<n>`` rows over profd's step ranges; none in a file that has torch's."""
    if any(r.name.startswith(PROFILER_STEP) for r in d.ranges):
        return []
    rows = []
    for n, r in step_ranges(d.ranges):
        pid, tid = d.threads[r.thread]
        event = {"ph": "X", "cat": RANGE_CATEGORY, "name": f"{PROFILER_STEP}{n}"}
        event |= {"pid": pid, "tid": tid, "ts": r.ts, "dur": r.dur}
        event["args"] = {"profd": f"added by profd export over {r.name}"}
        rows.append((n, b"  " + json.dumps(event).encode()))
    return rows


def _write_rank(g: _Group, hta_rank: int, world_size: int, path: Path) -> HtaRank:
    first = g.digests[0]
    dist = first.header.get("distributedInfo")
    dist = (
        {k: v for k, v in dist.items() if k not in ("rank", "world_size")}
        if isinstance(dist, dict)
        else {}
    )
    # rank first in the file: HTA takes the first '"rank": <n>' of the text as the rank
    dist = {"rank": hta_rank, **dist, "world_size": world_size}
    added = [(n, row) for d in g.digests for n, row in _profiler_steps(d)]
    steps = sorted({n for d in g.digests for n in _file_steps(d)})
    info = HtaRank(
        hta_rank=hta_rank,
        file=path.name,
        track=g.ident.label,
        kind=g.ident.kind,
        role=g.ident.role,
        rank=g.ident.rank,
        replica=g.ident.replica,
        sources=[Path(d.path).name for d in g.digests],
        steps=steps,
        added_profiler_steps=sorted({n for n, _ in added}),
        device_events=any(o.category in GPU_OP_CATEGORIES for d in g.digests for o in d.ops),
        clock_offset_us=clock_offset_us(first.header),
    )
    with gzip.GzipFile(path, "wb", compresslevel=GZIP_LEVEL, mtime=0) as f:
        f.write(b'{\n  "distributedInfo": ' + json.dumps(dist).encode() + b",\n")
        f.write(b'  "traceEvents": [\n')
        header = _copy_events(g.digests, [row for _, row in added], f)
        f.write(b"\n  ]")
        header.pop("distributedInfo", None)
        header["profdHta"] = info.model_dump(include={"role", "rank", "track", "sources"})
        for key, value in header.items():
            f.write(b",\n  " + json.dumps(key).encode() + b": " + json.dumps(value).encode())
        f.write(b"\n}\n")
    return info


def _copy_events(
    digests: Sequence[FileDigest], extra: Sequence[bytes], out: IO[bytes]
) -> dict[str, Any]:
    """Copy the event text of each file, then ``extra``, as one array body; return the first
    file's header (every top-level key but ``traceEvents``)."""
    header: dict[str, Any] | None = None
    wrote = False
    for d in digests:
        stream = TraceStream(d.path)
        started = False
        for seg in stream.raw_segments():
            text = bytes(seg)
            if not started:  # the text before a file's first event
                text = text.lstrip()
                if not text:
                    continue
                if wrote:
                    out.write(b",\n")
                started = True
            out.write(text)
        wrote = wrote or started
        if header is None:
            header = dict(stream.header)
    for row in extra:
        out.write(b",\n" + row if wrote else row)
        wrote = True
    return header or {}


def _notes(ranks: Sequence[HtaRank]) -> list[str]:
    """What HTA 0.5 will do with these ranks that a reader would not expect."""
    names = {n for r in ranks for n in r.steps}
    notes = []
    if len(names) >= 2:
        notes.append(
            "load with TraceAnalysis(trace_dir=..., include_last_profiler_step=True): profd's "
            "steps are complete, and without it HTA drops each rank's last step (every kernel "
            "of a rank with one step)"
        )
    for r in ranks:
        label = f"HTA rank {r.hta_rank} ({r.track})"
        if not r.steps and len(names) >= 2:
            notes.append(
                f"{label}: no steps, so HTA keeps none of its kernels while other ranks have "
                "ProfilerStep rows; leave it out with --steps"
            )
        if not r.device_events:
            notes.append(f"{label}: no device events (HTA's temporal breakdown raises on it)")
        if len(r.sources) > 1:
            notes.append(
                f"{label}: {len(r.sources)} files in one rank; HTA's window runs from its first "
                "kernel to its last, so time between the files counts as idle (export one step "
                "with --steps for profd's idle figures)"
            )
    return notes
