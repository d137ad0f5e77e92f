"""``merge_dir``: every trace of a session → one Chrome / Perfetto trace.

Each (role, rank) — and each rollout replica / global rank, and each unknown file — becomes
one process track (``pid``) named like ``actor_rollout_ref rank 0 (tp0-dp1) @node``; each
file's threads stay threads of that track. Timestamps are moved onto one clock: Kineto
writes ``ts`` relative to the trace's ``baseTimeNanoseconds``, so a file's events are shifted
by the difference between its base and the merged trace's base (the smallest one), which
keeps microsecond precision and lines up events that happened at the same instant.

Filters keep the result openable, applied in this order: ``ranks`` / ``roles`` (whole
tracks), a time window (``start_ms`` / ``end_ms`` after the earliest event; events that
overlap it are kept), ``stages`` (events that start inside a chosen stage range, and those
ranges), then ``max_mb``: the shortest events (instants and flows first) are dropped until the
uncompressed JSON fits. Metadata and profd's own ranges (steps, stages, mini-batches) are
never dropped. What was dropped, by reason and category, is returned and written into the
merged trace under ``profdMerge``.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import os
import shutil
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field

from profd.analysis.clocks import hints_for, placed_text, split_clocks
from profd.analysis.jsonscan import json_size_hint
from profd.analysis.mergeio import FileScan, ScanJob, WriteJob, scan_file, write_file
from profd.analysis.parallel import map_files, resolve_workers
from profd.analysis.ranges import RANGE_CATEGORY
from profd.analysis.sources import TrackIdentity, discover, identify, topology_text
from profd.analysis.summary import track_order

__all__ = ["MergeReport", "MergedTrack", "merge_dir", "merge_files"]

log = logging.getLogger(__name__)

_FRAME_BYTES = 4096  # our own metadata events and the document around the events


class MergedTrack(BaseModel):
    model_config = ConfigDict(frozen=True)

    pid: int = Field(description="Process id of the track in the merged trace.")
    label: str = Field(description="Track name shown by the viewer.")
    files: list[str] = Field(description="Source files on this track.")


class MergeReport(BaseModel):
    """What ``merge_dir`` wrote and what it left out."""

    model_config = ConfigDict(frozen=True)

    output: str = Field(description="The merged trace.")
    tracks: list[MergedTrack] = Field(description="Tracks, in display order.")
    events: int = Field(description="Events written (metadata included).")
    json_bytes: int = Field(description="Size of the merged JSON before compression.")
    file_bytes: int = Field(description="Size of the file written.")
    t0_epoch_us: float | None = Field(description="Earliest event of the inputs (window origin).")
    dropped: dict[str, dict[str, int]] = Field(
        description="Events left out: reason -> "
        "category -> count. Reasons: 'ranks', 'window', 'stages', 'budget'."
    )
    budget_note: str | None = Field(description="What --max-mb dropped, in words.")
    skipped: dict[str, str] = Field(description="Input files not merged -> reason.")
    aligned: dict[str, str] = Field(
        default_factory=dict,
        description="Input files without a wall clock placed by profd's record -> how.",
    )


def merge_dir(
    path: Path | str,
    output: Path | str,
    *,
    stages: Sequence[str] | None = None,
    ranks: Sequence[int] | None = None,
    roles: Sequence[str] | None = None,
    start_ms: float | None = None,
    end_ms: float | None = None,
    max_mb: float | None = None,
    workers: int | None = None,
) -> MergeReport:
    """Merge every trace directly inside ``path`` into ``output`` (see :func:`merge_files`)."""
    out = Path(output).resolve()
    files = [f for f in discover(path) if f.resolve() != out]
    if not files:
        raise ValueError(f"path: no trace files (*.json, *.json.gz) in {path}")
    return merge_files(
        files,
        output,
        stages=stages,
        ranks=ranks,
        roles=roles,
        start_ms=start_ms,
        end_ms=end_ms,
        max_mb=max_mb,
        workers=workers,
    )


def _check(
    stages: Sequence[str] | None,
    ranks: Sequence[int] | None,
    start_ms: float | None,
    end_ms: float | None,
    max_mb: float | None,
    output: Path,
) -> None:
    if not output.name.endswith((".json", ".json.gz")):
        raise ValueError(f"output: must end with .json.gz or .json, got {output.name!r}")
    if ranks is not None and any(
        isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks
    ):
        raise ValueError(f"ranks: must be ints >= 0, got {list(ranks)!r}")
    if stages is not None and (not stages or not all(isinstance(s, str) and s for s in stages)):
        raise ValueError(f"stages: must be non-empty stage labels, got {stages!r}")
    if start_ms is not None and start_ms < 0:
        raise ValueError(f"start_ms: must be >= 0, got {start_ms}")
    if end_ms is not None and end_ms <= (start_ms or 0.0):
        raise ValueError(f"end_ms: must be greater than start_ms ({start_ms or 0.0}), got {end_ms}")
    if max_mb is not None and not max_mb > 0:
        raise ValueError(f"max_mb: must be > 0, got {max_mb}")


def merge_files(
    files: Sequence[Path | str],
    output: Path | str,
    *,
    stages: Sequence[str] | None = None,
    ranks: Sequence[int] | None = None,
    roles: Sequence[str] | None = None,
    start_ms: float | None = None,
    end_ms: float | None = None,
    max_mb: float | None = None,
    workers: int | None = None,
) -> MergeReport:
    """Merge ``files`` into one trace at ``output`` (``.json.gz`` or ``.json``)."""
    out = Path(output)
    _check(stages, ranks, start_ms, end_ms, max_mb, out)
    sizes = [json_size_hint(f) for f in files]
    n = resolve_workers(workers, len(files), sum(sizes))
    scans, _ = map_files(scan_file, [ScanJob(str(f)) for f in files], workers=n, sizes=sizes)
    skipped = {Path(s.path).name: s.error for s in scans if s.error}
    good = [s for s in scans if s.error is None]
    clocks = split_clocks(
        {s.path: s.base_us + float(np.nanmin(s.ts)) for s in good if np.isfinite(s.ts).any()},
        hints_for(s.path for s in good),
    )
    for path, why in clocks.apart.items():
        log.warning("profd merge: %s left out: %s", Path(path).name, why)
        skipped[Path(path).name] = why
    good = [s for s in good if s.path not in clocks.apart]
    aligned = {}
    for s in good:
        if (hint := clocks.placed.get(s.path)) is not None:
            s.base_us += hint.start_us
            aligned[Path(s.path).name] = placed_text(hint)
            log.warning("profd merge: %s %s", Path(s.path).name, aligned[Path(s.path).name])
    if not good:
        why = "; ".join(f"{k}: {v}" for k, v in skipped.items())
        raise ValueError(f"no trace to merge: {why or 'no files'}")
    idents = [identify(Path(s.path).name, s.header) for s in good]
    plan = _Plan(good, idents)
    plan.select(ranks, roles)
    plan.window(start_ms, end_ms)
    plan.stage_filter(stages)
    note = plan.budget(max_mb)
    return _write(plan, out, n, sizes, skipped, note, aligned)


class _Plan:
    """Which events of which files go where."""

    def __init__(self, scans: list[FileScan], idents: list[TrackIdentity]) -> None:
        self.scans = scans
        self.idents = idents
        self.keep = [np.ones(len(s.ts), bool) for s in scans]
        self.selected = [True] * len(scans)
        self.dropped: dict[str, Counter[str]] = defaultdict(Counter)
        starts = [s.base_us + np.nanmin(s.ts) for s in scans if np.isfinite(s.ts).any()]
        self.t0 = float(min(starts)) if starts else None
        keys = sorted({i.key: i for i in idents}.values(), key=track_order)
        self.pid = {i.key: n + 1 for n, i in enumerate(keys)}
        self.track_idents = keys

    def _drop(self, reason: str, f: int, mask: np.ndarray) -> None:
        """Drop the events of file ``f`` where ``mask`` is set (and still kept)."""
        hit = mask & self.keep[f]
        if not hit.any():
            return
        s = self.scans[f]
        for c, count in zip(*np.unique(s.category[hit], return_counts=True), strict=True):
            self.dropped[reason][s.categories[int(c)] or "uncategorised"] += int(count)
        self.keep[f] &= ~hit

    def select(self, ranks: Sequence[int] | None, roles: Sequence[str] | None) -> None:
        if ranks is None and roles is None:
            return
        for f, ident in enumerate(self.idents):
            # dropped "by" the filter that left the track out: its rank first, else its role
            if ranks is not None and ident.rank not in ranks:
                by = "ranks"
            elif roles is not None and ident.role not in roles:
                by = "roles"
            else:
                continue
            self.selected[f] = False
            self._drop(by, f, np.ones(len(self.keep[f]), bool))
        if not any(self.selected):
            have = sorted({(i.role or "?", i.rank) for i in self.idents}, key=str)
            field = "roles" if ranks is None else "ranks"
            raise ValueError(
                f"{field}: no track matches ranks={ranks} roles={roles}; tracks: {have}"
            )

    def window(self, start_ms: float | None, end_ms: float | None) -> None:
        if (start_ms is None and end_ms is None) or self.t0 is None:
            return
        lo = self.t0 + (start_ms or 0.0) * 1000.0
        hi = self.t0 + end_ms * 1000.0 if end_ms is not None else np.inf
        for f, s in enumerate(self.scans):
            t = s.base_us + s.ts
            inside = (t <= hi) & (t + s.dur >= lo)
            self._drop("window", f, ~inside & np.isfinite(t))

    def stage_filter(self, stages: Sequence[str] | None) -> None:
        if stages is None:
            return
        wanted = set(stages)
        found = {name for s in self.scans for name, _, _ in s.ranges}
        if not wanted & found:
            raise ValueError(
                f"stages: none of {sorted(wanted)} found; ranges in these traces: "
                f"{sorted(found)[:30]}"
            )
        for f, s in enumerate(self.scans):
            inside = np.zeros(len(s.ts), bool)
            for name, ts, dur in s.ranges:
                if name in wanted:
                    inside |= (s.ts >= ts) & (s.ts <= ts + dur)
            self._drop("stages", f, ~inside)

    def budget(self, max_mb: float | None) -> str | None:
        if max_mb is None:
            return None
        limit = int(max_mb * 1024 * 1024)
        used = _FRAME_BYTES + sum(
            int(s.size[k].sum()) + s.metadata_bytes
            for s, k, on in zip(self.scans, self.keep, self.selected, strict=True)
            if on
        )
        if used <= limit:
            return None
        files, idx, dur, size = [], [], [], []
        for f, s in enumerate(self.scans):
            range_cat = s.categories.index(RANGE_CATEGORY) if RANGE_CATEGORY in s.categories else -1
            cand = np.flatnonzero(self.keep[f] & (s.category != range_cat))
            files.append(np.full(len(cand), f))
            idx.append(cand)
            dur.append(s.dur[cand])
            size.append(s.size[cand])
        fa, ia, da, sa = (np.concatenate(x) for x in (files, idx, dur, size))
        order = np.lexsort((ia, fa, da))  # shortest first; ties in file order
        need = used - limit
        cum = np.cumsum(sa[order])
        k = min(int(np.searchsorted(cum, need)) + 1, len(order))
        cut = order[:k]
        for f in range(len(self.scans)):
            mask = np.zeros(len(self.keep[f]), bool)
            mask[ia[cut][fa[cut] == f]] = True
            self._drop("budget", f, mask)
        longest = float(da[cut].max()) if k else 0.0
        if k == len(order) and cum[-1] < need:
            return (
                f"dropped all {k} droppable events (up to {longest:.3f} µs long) and the "
                f"trace is still over {max_mb} MB: narrow it with ranks, stages or a window"
            )
        return f"dropped the {k} shortest events (up to {longest:.3f} µs long) to fit {max_mb} MB"

    def labels(self, ident: TrackIdentity) -> str:
        parts = [f"kind={ident.kind}"]
        if ident.role:
            parts.append(f"role={ident.role}")
        if ident.rank is not None:
            parts.append(f"rank={ident.rank}")
        if ident.world_size:
            parts.append(f"world={ident.world_size}")
        if ident.topology:
            parts.append(topology_text(ident.topology))
        if ident.hostname:
            parts.append(f"node={ident.hostname}")
        return " ".join(parts)


def _track_metadata(plan: _Plan, used: set[str]) -> list[bytes]:
    out = []
    for ident in plan.track_idents:
        if ident.key not in used:
            continue
        pid = plan.pid[ident.key]
        for name, args in (
            ("process_name", {"name": ident.label}),
            ("process_sort_index", {"sort_index": pid}),
            ("process_labels", {"labels": plan.labels(ident)}),
        ):
            out.append(orjson.dumps({"ph": "M", "name": name, "pid": pid, "tid": 0, "args": args}))
    return out


def _jobs(plan: _Plan, chosen: list[int], tmp: Path, base_us: float) -> list[WriteJob]:
    return [
        WriteJob(
            path=plan.scans[f].path,
            fragment=str(tmp / f"{f}.part"),
            file_index=f,
            track_pid=plan.pid[plan.idents[f].key],
            main_pid=plan.scans[f].main_pid,
            offset_us=plan.scans[f].base_us - base_us,
            keep=plan.keep[f],
            process_names=plan.scans[f].process_names,
        )
        for f in chosen
    ]


def _header(plan: _Plan, tracks: list[MergedTrack], base_us: float, **note: Any) -> bytes:
    """The keys written before the events; ``profdMerge`` first, so a reader that peeks at
    the start of the file (``profd summarize``) knows this is a merged trace."""
    sources = [{"file": f, "pid": t.pid, "track": t.label} for t in tracks for f in t.files]
    meta = {"version": _version(), "sources": sources, "t0_epoch_us": plan.t0, **note}
    return orjson.dumps(
        {"profdMerge": meta, "displayTimeUnit": "ms", "baseTimeNanoseconds": round(base_us * 1000)}
    )


def _write(
    plan: _Plan,
    out: Path,
    workers: int,
    sizes: list[int],
    skipped: dict[str, str],
    note: str | None,
    aligned: dict[str, str],
) -> MergeReport:
    out.parent.mkdir(parents=True, exist_ok=True)
    chosen = [f for f, on in enumerate(plan.selected) if on and plan.keep[f].any()]
    for f, on in enumerate(plan.selected):
        if on and f not in chosen:  # a track the filters emptied is left out, and said so
            skipped[Path(plan.scans[f].path).name] = "no event left after the filters"
    if not chosen:
        raise ValueError("no event is left after the filters (ranks, roles, stages, window)")
    base_us = min((plan.scans[f].base_us for f in chosen), default=0.0)
    tmp = Path(tempfile.mkdtemp(prefix=".profd-merge-", dir=out.parent))
    try:
        jobs = _jobs(plan, chosen, tmp, base_us)
        results, _ = map_files(write_file, jobs, workers=workers, sizes=[sizes[f] for f in chosen])
        for job, res in zip(jobs, results, strict=True):
            if res.error:
                skipped[Path(job.path).name] = res.error
        ok = [(j, r) for j, r in zip(jobs, results, strict=True) if r.error is None]
        used = {plan.idents[j.file_index].key for j, _ in ok}
        tracks = _tracks(plan, [j for j, _ in ok], used)
        dropped = {r: dict(sorted(c.items())) for r, c in sorted(plan.dropped.items())}
        head = _header(
            plan,
            tracks,
            base_us,
            dropped=dropped,
            budget_note=note,
            skipped=skipped,
            aligned=aligned,
        )
        events, json_bytes = _assemble(out, head, _track_metadata(plan, used), ok)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if note:
        log.info("profd merge: %s", note)
    return MergeReport(
        output=str(out),
        tracks=tracks,
        events=events,
        json_bytes=json_bytes,
        file_bytes=out.stat().st_size,
        t0_epoch_us=plan.t0,
        dropped=dropped,
        budget_note=note,
        skipped=skipped,
        aligned=aligned,
    )


def _tracks(plan: _Plan, written: list[WriteJob], used: set[Any]) -> list[MergedTrack]:
    """The merged tracks in order, each with the files that made it."""
    return [
        MergedTrack(
            pid=plan.pid[i.key],
            label=i.label,
            files=[Path(j.path).name for j in written if plan.idents[j.file_index].key == i.key],
        )
        for i in plan.track_idents
        if i.key in used
    ]


def _assemble(
    out: Path, head: bytes, metadata: list[bytes], parts: list[tuple[WriteJob, Any]]
) -> tuple[int, int]:
    """Write ``{header..., "traceEvents": [metadata, fragments...]}`` atomically."""
    partial = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    total = 0
    events = len(metadata)
    try:
        with _sink(partial, out.name) as sink:
            first = head[:-1] + b',"traceEvents":['
            body = b",".join(metadata)
            sink.write(first + body)
            total += len(first) + len(body)
            wrote_any = bool(metadata)
            for job, res in parts:
                if not res.bytes:
                    continue
                if wrote_any:
                    sink.write(b",")
                    total += 1
                with open(job.fragment, "rb") as frag:
                    shutil.copyfileobj(frag, sink, 1 << 20)
                total += res.bytes
                events += res.events
                wrote_any = True
            sink.write(b"]}")
            total += 2
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return events, total


@contextlib.contextmanager
def _sink(path: Path, name: str) -> Iterator[Any]:
    """Where ``name`` is written (at ``path``, a temporary): gzipped for a ``.gz`` name, its
    header naming ``name`` (``gunzip -N`` restores that, not the temporary's)."""
    with open(path, "wb") as raw:
        if not name.endswith(".gz"):
            yield raw
            return
        # Level 6: about as small as 9 on trace JSON, several times faster.
        with gzip.GzipFile(filename=name, mode="wb", compresslevel=6, fileobj=raw) as gz:
            yield gz


def _version() -> str:
    from profd.core.constants import __version__

    return __version__
