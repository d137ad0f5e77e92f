"""``summarize_dir``: a session's traces → :class:`~profd.analysis.models.SessionSummary`.

Files are digested in parallel (:mod:`.digest`, :mod:`.parallel`); everything below works on
the small digests only. Times of different files are put on one clock: Kineto timestamps
are µs after the trace's ``baseTimeNanoseconds``, so ``base + ts`` is the wall clock every
process on a machine shares.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import median
from typing import Any

from profd.analysis.clocks import ClockHint, hints_for, split_clocks
from profd.analysis.digest import GPU_OP_CATEGORIES, FileDigest, digest_file
from profd.analysis.file_rows import StageAcc, collect_rows
from profd.analysis.gpu import gpu_breakdowns
from profd.analysis.jsonscan import json_size_hint
from profd.analysis.models import (
    AlignedFile,
    FileInfo,
    OpStat,
    ProcessingStats,
    SessionSummary,
    SkipKind,
    SkippedFile,
    StageOps,
    StageStat,
    StageTime,
    StragglerRule,
    TrackInfo,
)
from profd.analysis.parallel import MapStats, map_files, map_files_ray, resolve_workers
from profd.analysis.sources import TrackIdentity, discover, identify
from profd.analysis.stragglers import detect_stragglers
from profd.core.naming import CONTINUOUS_SCOPE

__all__ = ["digest_all", "summarize_digests", "summarize_dir", "summarize_files", "track_order"]


@dataclass(frozen=True, slots=True)
class DigestJob:
    path: str
    pseudo_stage: str | None


def run_job(job: DigestJob) -> FileDigest:
    """Module-level so worker processes and Ray tasks can import it."""
    return digest_file(job.path, pseudo_stage=job.pseudo_stage)


def _pseudo_stage(name: str) -> str:
    """What a trace profd did not write is called in the stage tables."""
    ident = identify(name)
    if ident.kind == "rollout":
        return "rollout"
    if ident.scope and ident.scope != CONTINUOUS_SCOPE:
        return ident.scope
    return "(trace)"


def digest_all(
    files: Sequence[Path | str],
    *,
    workers: int | None = None,
    nodes: Sequence[str | None] | None = None,
    start_method: str | None = None,
) -> tuple[list[FileDigest], MapStats]:
    """Digest every file, locally (processes) or, with ``nodes``, as Ray tasks on those nodes."""
    jobs = [DigestJob(str(f), _pseudo_stage(Path(f).name)) for f in files]
    if nodes is not None:
        return map_files_ray(run_job, jobs, nodes)
    sizes = [json_size_hint(f) for f in files]
    n = resolve_workers(workers, len(jobs), sum(sizes))
    return map_files(run_job, jobs, workers=n, sizes=sizes, start_method=start_method)


def summarize_dir(
    path: Path | str,
    *,
    workers: int | None = None,
    top: int = 10,
    rule: StragglerRule | None = None,
    start_method: str | None = None,
) -> SessionSummary:
    """Summarise every trace (``.json`` / ``.json.gz``) directly inside ``path``."""
    root = Path(path)
    files = discover(root)
    if not files:
        raise ValueError(f"path: no trace files (*.json, *.json.gz) in {root}")
    return summarize_files(
        files, source=str(root), workers=workers, top=top, rule=rule, start_method=start_method
    )


def summarize_files(
    files: Sequence[Path | str],
    *,
    source: str,
    workers: int | None = None,
    nodes: Sequence[str | None] | None = None,
    top: int = 10,
    rule: StragglerRule | None = None,
    start_method: str | None = None,
) -> SessionSummary:
    """Summarise these files. With ``nodes`` (one Ray node id per file, or None), each file is
    read by a Ray task on its node — for traces that stayed on the node that wrote them; the
    trace index has both (``TraceView.path`` and ``TraceView.node_id``)."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top: must be an int >= 1, got {top!r}")
    started = time.perf_counter()
    digests, stats = digest_all(files, workers=workers, nodes=nodes, start_method=start_method)
    return summarize_digests(
        digests, source=source, top=top, rule=rule or StragglerRule(), stats=stats, started=started
    )


def track_order(ident: TrackIdentity) -> tuple[Any, ...]:
    """Ranks by role then rank, then rollout replicas, then unknown files by name."""
    kind = {"rank": 0, "rollout": 1}.get(ident.kind, 2)
    if ident.kind == "rank":
        return (kind, ident.role or "", ident.rank or 0, "")
    if ident.kind == "rollout":
        return (kind, "", ident.replica or 0, ident.rank if ident.rank is not None else -1)
    return (kind, "", 0, ident.key)


def summarize_digests(
    digests: Sequence[FileDigest],
    *,
    source: str,
    top: int = 10,
    rule: StragglerRule | None = None,
    stats: MapStats | None = None,
    started: float | None = None,
    hints: Mapping[str, ClockHint] | None = None,
) -> SessionSummary:
    """Build the summary from digests (see :func:`digest_all`). ``hints``: where relative
    files started (default: profd's record beside each file, :func:`.clocks.hints_for`)."""
    rule = rule or StragglerRule()
    if hints is None:
        hints = hints_for(d.path for d in digests if d.error is None)
    ok, skipped, placed = _on_one_clock(digests, hints)
    idents = {
        d.path: _with_step(identify(Path(d.path).name, d.header), hints.get(d.path)) for d in ok
    }
    by_key, file_count = _track_keys(ok, idents)
    ordered = sorted(by_key.values(), key=track_order)
    label = {i.key: i.label for i in ordered}
    starts = [d.base_us + d.first_ts for d in ok if d.first_ts is not None]
    ends = [d.base_us + d.last_end for d in ok if d.last_end is not None]
    t0 = min(starts) if starts else 0.0

    acc, step_rows, gaps, minis = collect_rows(ok, idents, label, t0)
    stage_rows = _stage_rows(acc, by_key, label)
    order = _stage_order(stage_rows)
    pos = {i.label: n for n, i in enumerate(ordered)}
    stage_rows.sort(key=lambda r: (r.step is None, r.step or 0, order[r.stage], pos[r.track]))
    return SessionSummary(
        source=source,
        session_ids=sorted({i.session_id for i in idents.values() if i.session_id}),
        t0_epoch_us=t0 if starts else None,
        span_ms=(max(ends) - t0) / 1000.0 if ends else 0.0,
        steps=sorted({r.step for r in stage_rows if r.step is not None}),
        stages=sorted(order, key=order.__getitem__),
        tracks=[_track_info(i, file_count[i.key]) for i in ordered],
        files=[_file_info(d, label[idents[d.path].key]) for d in ok],
        skipped=skipped,
        aligned=[
            AlignedFile(
                name=Path(p).name,
                offset_ms=(h.start_us - t0) / 1000.0,
                uncertainty_ms=h.uncertainty_us / 1000.0,
                source=h.source,
            )
            for p, h in placed.items()
        ],
        stage_times=stage_rows,
        step_times=sorted(step_rows, key=lambda r: (r.step, pos[r.track])),
        stage_stats=_stage_stats(stage_rows, order),
        mini_batches=minis,
        idle_gaps=sorted(gaps, key=lambda g: (g.step is None, g.step, g.track, g.start_ms)),
        top_ops=_top_ops(ok, top, order),
        gpu=gpu_breakdowns(
            ((label[idents[d.path].key], d.gpu) for d in ok), [i.label for i in ordered], order
        ),
        stragglers=detect_stragglers(stage_rows, rule),
        straggler_rule=rule,
        processing=_processing(digests, stats, started),
    )


def _with_step(ident: TrackIdentity, hint: ClockHint | None) -> TrackIdentity:
    """A rollout engine's trace has no step marks: the step its window was for, when profd
    noted one beside it (a window of one step; a group of several keeps none)."""
    one = hint is not None and len(hint.steps) == 1
    if ident.kind == "rollout" and ident.step is None and one:
        return replace(ident, step=hint.steps[0])  # type: ignore[union-attr]
    return ident


def _on_one_clock(
    digests: Sequence[FileDigest], hints: Mapping[str, ClockHint] | None
) -> tuple[list[FileDigest], list[SkippedFile], Mapping[str, ClockHint]]:
    """The readable digests on one clock (files without a wall clock of their own placed
    by ``hints``), the files skipped (unreadable, or on a clock that cannot be placed), and
    the placed files' hints."""
    ok = [d for d in digests if d.error is None]
    skipped = [
        SkippedFile(name=Path(d.path).name, reason=d.error or "") for d in digests if d.error
    ]
    if hints is None:
        hints = hints_for(d.path for d in ok)
    clocks = split_clocks(
        {d.path: d.base_us + d.first_ts for d in ok if d.first_ts is not None}, hints
    )
    skipped += [
        SkippedFile(name=Path(p).name, reason=why, kind=SkipKind.CLOCK)
        for p, why in clocks.apart.items()
    ]
    ok = [
        replace(d, base_us=d.base_us + clocks.placed[d.path].start_us)
        if d.path in clocks.placed
        else d
        for d in ok
        if d.path not in clocks.apart
    ]
    return ok, skipped, clocks.placed


def _track_keys(
    digests: Sequence[FileDigest], idents: dict[str, TrackIdentity]
) -> tuple[dict[str, TrackIdentity], dict[str, int]]:
    """One identity per track key (the first file's), and how many files each track has."""
    by_key: dict[str, TrackIdentity] = {}
    count: dict[str, int] = defaultdict(int)
    for d in digests:
        ident = idents[d.path]
        by_key.setdefault(ident.key, ident)
        count[ident.key] += 1
    return by_key, count


def _processing(
    digests: Sequence[FileDigest], stats: MapStats | None, started: float | None
) -> ProcessingStats:
    wall = time.perf_counter() - started if started is not None else sum(d.seconds for d in digests)
    return ProcessingStats(
        files=len(digests),
        json_bytes=sum(d.json_bytes for d in digests),
        wall_s=wall,
        mode=stats.mode if stats else "serial",
        workers=stats.workers if stats else 1,
        start_method=stats.start_method if stats else None,
        worker_memory_mb=stats.worker_memory_mb if stats else None,
    )


def _stage_rows(
    acc: StageAcc, by_key: dict[str, TrackIdentity], label: dict[str, str]
) -> list[StageTime]:
    rows = []
    for (key, step, stage), (start, end, wall, calls) in acc.rows.items():
        ident = by_key[key]
        rows.append(
            StageTime(
                step=step,
                stage=stage,
                track=label[key],
                role=ident.role,
                rank=ident.rank,
                start_ms=start,
                end_ms=end,
                wall_ms=wall,
                calls=int(calls),
            )
        )
    return rows


def _stage_order(rows: Sequence[StageTime]) -> dict[str, int]:
    first: dict[str, float] = {}
    for r in rows:
        first[r.stage] = min(first.get(r.stage, r.start_ms), r.start_ms)
    return {s: i for i, s in enumerate(sorted(first, key=lambda s: (first[s], s)))}


def _stage_stats(rows: Sequence[StageTime], order: dict[str, int]) -> list[StageStat]:
    groups: dict[tuple[str | None, int | None, str], list[StageTime]] = defaultdict(list)
    for r in rows:
        groups[(r.role, r.step, r.stage)].append(r)
    out = []
    for (role, step, stage), members in groups.items():
        walls = [m.wall_ms for m in members]
        ends = [m.end_ms for m in members]
        last = max(members, key=lambda m: m.end_ms)
        out.append(
            StageStat(
                step=step,
                stage=stage,
                role=role,
                ranks=len(members),
                wall_min_ms=min(walls),
                wall_median_ms=median(walls),
                wall_max_ms=max(walls),
                end_spread_ms=max(ends) - min(ends),
                slowest=last.track,
            )
        )
    out.sort(key=lambda s: (s.step is None, s.step or 0, order.get(s.stage, 0), s.role or ""))
    return out


def _top_ops(digests: Sequence[FileDigest], top: int, order: dict[str, int]) -> list[StageOps]:
    totals: dict[tuple[str | None, str], dict[tuple[str, str], list[float]]] = defaultdict(dict)
    for d in digests:
        for op in d.ops:
            device = "gpu" if op.category in GPU_OP_CATEGORIES else "cpu"
            slot = totals[(op.stage, device)].setdefault((op.category, op.name), [0, 0.0, 0.0])
            slot[0] += op.calls
            slot[1] += op.self_us
            slot[2] += op.total_us
    out = []
    for (stage, device), ops in totals.items():
        whole = sum(v[1] for v in ops.values())
        best = sorted(ops.items(), key=lambda kv: -kv[1][1])[:top]
        out.append(
            StageOps(
                stage=stage,
                device=device,
                self_ms=whole / 1000.0,
                ops=[
                    OpStat(
                        name=name,
                        category=cat,
                        calls=int(v[0]),
                        self_ms=v[1] / 1000.0,
                        total_ms=v[2] / 1000.0,
                        share=(v[1] / whole) if whole > 0 else 0.0,
                    )
                    for (cat, name), v in best
                ],
            )
        )
    out.sort(key=lambda s: (s.stage is None, order.get(s.stage or "", 0), s.device))
    return out


def _track_info(i: TrackIdentity, files: int) -> TrackInfo:
    return TrackInfo(
        track=i.label,
        key=i.key,
        kind=i.kind,
        role=i.role,
        rank=i.rank,
        world_size=i.world_size,
        topology=dict(i.topology),
        hostname=i.hostname,
        node_id=i.node_id,
        replica=i.replica,
        from_metadata=i.from_metadata,
        files=files,
    )


def _file_info(d: FileDigest, track: str) -> FileInfo:
    return FileInfo(
        name=Path(d.path).name,
        track=track,
        file_bytes=d.file_bytes,
        json_bytes=d.json_bytes,
        events=d.events,
        parse=d.mode,
        seconds=round(d.seconds, 4),
        partial_steps=d.partial_steps,
    )
