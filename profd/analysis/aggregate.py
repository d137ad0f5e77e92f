"""Session summaries folded over steps: what ``profd summarize`` prints by default.

Pure functions of a :class:`~profd.analysis.models.SessionSummary` (no Ray, no torch): every
result has one row per stage x role (or role, or stage x role x rank), so its size does not
grow with the number of profiled steps. Times are milliseconds.

* :func:`stage_aggregates`: median / p90 / max of a stage's wall time over every (step, rank)
  of a role, and the slowest rank: the one with the largest single time, with how many steps
  it was the slowest of its peers.
* :func:`idle_aggregates`: idle time between stages per role: per (step, rank) sums of the
  gaps, their median / max / total, and the largest single gap.
* :func:`straggler_aggregates`: how often, and by how much, each (stage, role, rank) was late.
* :func:`mini_batch_aggregates`: each mini-batch index per stage x role over steps and ranks.
* :func:`gpu_stage_aggregates`: the GPU time of each stage, summed over the tracks.
* :func:`percentile`, :func:`middle_ellipsis`, :func:`short_names`: the helpers behind them.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import median

from profd.analysis.models import GpuTime, IdleGap, SessionSummary, StageTime

__all__ = [
    "GpuStageAggregate",
    "IdleAggregate",
    "MiniBatchAggregate",
    "StageAggregate",
    "StragglerAggregate",
    "gpu_stage_aggregates",
    "idle_aggregates",
    "middle_ellipsis",
    "mini_batch_aggregates",
    "percentile",
    "short_names",
    "stage_aggregates",
    "steps_text",
    "straggler_aggregates",
]

logger = logging.getLogger(__name__)

ELLIPSIS = "…"


@dataclass(frozen=True)
class StageAggregate:
    """One stage of one role over every step and rank that ran it."""

    stage: str
    role: str | None
    ranks: int  # tracks that ran it
    steps: int  # distinct steps it ran in
    samples: int  # (step, track) wall times the statistics are over
    median_ms: float
    p90_ms: float
    max_ms: float
    slowest_track: str  # the track with the largest single wall time
    slowest_rank: int | None
    slowest_step: int | None  # the step of that largest time
    slowest_in: int  # steps in which that track was the slowest of the role's ranks


@dataclass(frozen=True)
class IdleAggregate:
    """Idle time between stages (gaps inside steps) of one role's tracks."""

    role: str | None
    ranks: int  # tracks of the role with a step or a gap
    steps: int  # distinct steps
    step_median_ms: float | None  # median wall time of a step (None: no step ranges)
    per_step_median_ms: float  # median over (step, track) of the summed gaps
    per_step_max_ms: float
    total_ms: float  # every gap of the role, summed
    largest: IdleGap | None  # the longest single gap


@dataclass(frozen=True)
class StragglerAggregate:
    """How often one rank was late in one stage."""

    stage: str
    role: str | None
    rank: int | None
    track: str
    late_steps: int  # steps it was a straggler in
    #: Of those, steps it ran longer than its peers (the rest: pushed late by an earlier
    #: stage); None when the summary predates causes.
    long_steps: int | None
    steps: int  # steps the stage ran in for that role
    max_late_ms: float
    median_late_ms: float
    worst_step: int | None  # the step of the largest lateness


@dataclass(frozen=True)
class MiniBatchAggregate:
    """Mini-batch ``index`` of one stage and role over steps and tracks."""

    stage: str | None
    role: str | None
    index: int
    samples: int
    median_ms: float
    max_ms: float
    micro_batches: int  # the most micro-batches seen inside it


@dataclass(frozen=True)
class GpuStageAggregate:
    """The GPU time of one stage (None: outside every stage), summed over the tracks."""

    stage: str | None
    tracks: int
    window_ms: float
    idle_ms: float
    compute_ms: float
    non_compute_ms: float
    communication_ms: float
    memory_ms: float
    overlap_pct: float | None  # of the summed communication time; None without any


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between closest ranks (numpy's
    default, ``statistics.quantiles(method="inclusive")``)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be within [0, 1], got {q}")
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _role_of(s: SessionSummary) -> dict[str, str | None]:
    return {t.track: t.role for t in s.tracks}


def _rank_of(s: SessionSummary) -> dict[str, int | None]:
    return {t.track: t.rank for t in s.tracks}


def _orders(s: SessionSummary) -> tuple[dict[str, int], dict[str, int], dict[str | None, int]]:
    """Display orders: stages as found, tracks as listed, roles by their first track."""
    stages = {name: i for i, name in enumerate(s.stages)}
    tracks = {t.track: i for i, t in enumerate(s.tracks)}
    roles: dict[str | None, int] = {}
    for t in s.tracks:
        roles.setdefault(t.role, len(roles))
    return stages, tracks, roles


def stage_aggregates(s: SessionSummary) -> list[StageAggregate]:
    """One row per (stage, role), in stage order, then role order."""
    stage_order, track_order, role_order = _orders(s)
    groups: dict[tuple[str, str | None], list[StageTime]] = defaultdict(list)
    for r in s.stage_times:
        groups[(r.stage, r.role)].append(r)
    out = [
        _stage_aggregate(stage, role, rows, track_order) for (stage, role), rows in groups.items()
    ]
    out.sort(
        key=lambda a: (
            stage_order.get(a.stage, len(stage_order)),
            role_order.get(a.role, len(role_order)),
        )
    )
    return out


def _stage_aggregate(
    stage: str, role: str | None, rows: list[StageTime], track_order: dict[str, int]
) -> StageAggregate:
    # Ties go to the track listed first, then the earlier step: the same answer every time.
    def heavier(r: StageTime) -> tuple[float, int, int]:
        return (r.wall_ms, -track_order.get(r.track, len(track_order)), -(r.step or 0))

    worst = max(rows, key=heavier)
    by_step: dict[int | None, list[StageTime]] = defaultdict(list)
    for r in rows:
        by_step[r.step].append(r)
    slowest_in = sum(
        1 for members in by_step.values() if max(members, key=heavier).track == worst.track
    )
    walls = [r.wall_ms for r in rows]
    return StageAggregate(
        stage=stage,
        role=role,
        ranks=len({r.track for r in rows}),
        steps=len(by_step),
        samples=len(rows),
        median_ms=median(walls),
        p90_ms=percentile(walls, 0.9),
        max_ms=worst.wall_ms,
        slowest_track=worst.track,
        slowest_rank=worst.rank,
        slowest_step=worst.step,
        slowest_in=slowest_in,
    )


def idle_aggregates(s: SessionSummary) -> list[IdleAggregate]:
    """One row per role: the gaps of every (step, track) of the role, summed per (step,
    track); a (step, track) with a step range and no gap counts as zero idle time."""
    role_of = _role_of(s)
    _, _, role_order = _orders(s)
    per: dict[str | None, dict[tuple[int | None, str], float]] = defaultdict(dict)
    for st in s.step_times:
        per[role_of.get(st.track)].setdefault((st.step, st.track), 0.0)
    gaps: dict[str | None, list[IdleGap]] = defaultdict(list)
    for g in s.idle_gaps:
        role = role_of.get(g.track)
        gaps[role].append(g)
        cell = per[role]
        cell[(g.step, g.track)] = cell.get((g.step, g.track), 0.0) + g.gap_ms
    step_walls: dict[str | None, list[float]] = defaultdict(list)
    for st in s.step_times:
        step_walls[role_of.get(st.track)].append(st.wall_ms)
    out = []
    for role, cells in per.items():
        sums = list(cells.values())
        walls = step_walls.get(role)
        out.append(
            IdleAggregate(
                role=role,
                ranks=len({track for _, track in cells}),
                steps=len({step for step, _ in cells}),
                step_median_ms=median(walls) if walls else None,
                per_step_median_ms=median(sums),
                per_step_max_ms=max(sums),
                total_ms=sum(sums),
                largest=max(gaps[role], key=lambda g: g.gap_ms) if gaps.get(role) else None,
            )
        )
    out.sort(key=lambda a: role_order.get(a.role, len(role_order)))
    return out


def straggler_aggregates(s: SessionSummary) -> list[StragglerAggregate]:
    """One row per late (stage, role, track): most often late first, then latest."""
    steps_of: dict[tuple[str, str | None], set[int | None]] = defaultdict(set)
    for st in s.stage_stats:
        steps_of[(st.stage, st.role)].add(st.step)
    groups: dict[tuple[str, str | None, str], list] = defaultdict(list)
    for x in s.stragglers:
        groups[(x.stage, x.role, x.track)].append(x)
    out = []
    for (stage, role, track), late in groups.items():
        worst = max(late, key=lambda x: x.late_ms)
        out.append(
            StragglerAggregate(
                stage=stage,
                role=role,
                rank=worst.rank,
                track=track,
                late_steps=len({x.step for x in late}),
                long_steps=None
                if any(x.cause is None for x in late)
                else len({x.step for x in late if x.cause.long}),
                steps=len(steps_of.get((stage, role), set())) or len({x.step for x in late}),
                max_late_ms=worst.late_ms,
                median_late_ms=median(x.late_ms for x in late),
                worst_step=worst.step,
            )
        )
    out.sort(key=lambda a: (-a.late_steps, -a.max_late_ms, a.stage, a.track))
    return out


def mini_batch_aggregates(s: SessionSummary) -> list[MiniBatchAggregate]:
    """One row per (stage, role, mini-batch index), in stage, role and index order."""
    role_of = _role_of(s)
    stage_order, _, role_order = _orders(s)
    groups: dict[tuple[str | None, str | None, int], list] = defaultdict(list)
    for m in s.mini_batches:
        groups[(m.stage, role_of.get(m.track), m.index)].append(m)
    out = [
        MiniBatchAggregate(
            stage=stage,
            role=role,
            index=index,
            samples=len(ms),
            median_ms=median(m.wall_ms for m in ms),
            max_ms=max(m.wall_ms for m in ms),
            micro_batches=max(m.micro_batches for m in ms),
        )
        for (stage, role, index), ms in groups.items()
    ]
    out.sort(
        key=lambda a: (
            stage_order.get(a.stage or "", len(stage_order)),
            role_order.get(a.role, len(role_order)),
            a.index,
        )
    )
    return out


def gpu_stage_aggregates(s: SessionSummary) -> list[GpuStageAggregate]:
    """Each stage's GPU time over every track (stages as found, then outside every stage)."""
    rows: dict[str | None, list[GpuTime]] = defaultdict(list)
    for g in s.gpu:
        for r in g.stages:
            rows[r.stage].append(r)
    stages, _, _ = _orders(s)
    out = []
    for stage in sorted(rows, key=lambda n: (n is None, stages.get(n or "", 0), n or "")):
        xs = rows[stage]
        comm = sum(x.communication_ms for x in xs)
        # each track's overlap, in ms, back from its percentage
        overlap = sum((x.comm_comp_overlap_pct or 0.0) * x.communication_ms / 100 for x in xs)
        out.append(
            GpuStageAggregate(
                stage=stage,
                tracks=len(xs),
                window_ms=sum(x.window_ms for x in xs),
                idle_ms=sum(x.idle_ms for x in xs),
                compute_ms=sum(x.compute_ms for x in xs),
                non_compute_ms=sum(x.non_compute_ms for x in xs),
                communication_ms=comm,
                memory_ms=sum(x.memory_ms for x in xs),
                overlap_pct=100 * overlap / comm if comm > 0 else None,
            )
        )
    return out


def steps_text(steps: Sequence[int]) -> str:
    """``[1, 2, 3]`` as ``1-3 (3)``, ``[1, 5, 9]`` as ``1..9 (3)``: as long at 1000 steps."""
    if not steps:
        return "-"
    xs = sorted(set(steps))
    if len(xs) == 1:
        return str(xs[0])
    contiguous = xs[-1] - xs[0] + 1 == len(xs)
    return f"{xs[0]}{'-' if contiguous else '..'}{xs[-1]} ({len(xs)})"


def middle_ellipsis(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters by replacing its middle with ``…``."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if len(text) <= width:
        return text
    if width == 1:
        return ELLIPSIS
    head = width // 2
    tail = width - 1 - head
    return text[:head] + ELLIPSIS + (text[-tail:] if tail else "")


def short_names(names: Iterable[str], width: int) -> dict[str, str]:
    """Full name -> a distinct display name of at most ``width`` characters: names that fit
    are kept, longer ones get a middle ellipsis; ones that would then collide carry their
    position (``~1``, ``~2``, ...) to stay distinct."""
    unique = list(dict.fromkeys(names))
    out = {n: middle_ellipsis(n, width) for n in unique}
    seen: dict[str, list[str]] = defaultdict(list)
    for n, short in out.items():
        seen[short].append(n)
    for i, n in enumerate(unique, start=1):
        if len(seen[out[n]]) > 1 and out[n] != n:
            tag = f"~{i}"
            out[n] = middle_ellipsis(n, max(1, width - len(tag))) + tag
    if len(set(out.values())) < len(out):  # pathological: plain position keys
        logger.debug("short names still collide at width %d; using keys", width)
        out = {n: f"#{i}" for i, n in enumerate(unique, start=1)}
    return out
