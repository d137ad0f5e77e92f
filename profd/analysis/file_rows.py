"""What each trace file adds to a summary, on the session's shared clock: stage rows, step
times with their idle gaps, and mini-batches (:func:`collect_rows`)."""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Mapping, Sequence

from profd.analysis.digest import FileDigest
from profd.analysis.models import IdleGap, MiniBatchTime, StepTime
from profd.analysis.ranges import Range, marker, step_ranges
from profd.analysis.sources import TrackIdentity
from profd.core.naming import is_stage_scope

__all__ = ["FileView", "StageAcc", "collect_rows"]

_EPS_MS = 1e-3


class StageAcc:
    """Stage rows being accumulated: (track key, step, stage) -> [start, end, wall, calls]."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, int | None, str], list[float]] = {}

    def add(self, key: tuple[str, int | None, str], start: float, end: float) -> None:
        row = self.rows.get(key)
        if row is None:
            self.rows[key] = [start, end, end - start, 1]
        else:
            row[0], row[1] = min(row[0], start), max(row[1], end)
            row[2] += end - start
            row[3] += 1


class FileView:
    """One digest on the shared clock."""

    def __init__(self, d: FileDigest, ident: TrackIdentity, t0: float) -> None:
        self.d = d
        self.ident = ident
        self.offset = d.base_us - t0
        self.steps = step_ranges(d.ranges)

    def ms(self, ts: float) -> float:
        return (self.offset + ts) / 1000.0

    def step_at(self, ts: float) -> int | None:
        # the latest step that started: torch's ProfilerStep rows share their boundaries
        inside = [(r.ts, n) for n, r in self.steps if r.ts <= ts <= r.end]
        if inside:
            return max(inside)[1]
        return None if self.steps else self.ident.step

    def stage_at(self, ts: float) -> Range | None:
        inside = [s for s in self.d.stages if s.ts <= ts <= s.end]
        return min(inside, key=lambda s: s.dur) if inside else None


def collect_rows(
    digests: Sequence[FileDigest],
    idents: Mapping[str, TrackIdentity],
    label: Mapping[str, str],
    t0: float,
) -> tuple[StageAcc, list[StepTime], list[IdleGap], list[MiniBatchTime]]:
    """Every file's stage spans (accumulated), step times, idle gaps and mini-batches;
    ``label``: each track key's name in the summary, ``t0``: the shared clock's zero."""
    acc = StageAcc()
    step_rows: list[StepTime] = []
    gaps: list[IdleGap] = []
    minis: list[MiniBatchTime] = []
    for d in digests:
        v = FileView(d, idents[d.path], t0)
        _collect_stages(v, acc)
        _collect_steps(v, label[v.ident.key], step_rows, gaps)
        _collect_minis(v, label[v.ident.key], minis)
    return acc, step_rows, gaps, minis


def _collect_stages(v: FileView, acc: StageAcc) -> None:
    for s in v.d.stages:
        acc.add((v.ident.key, v.step_at(s.ts), s.name), v.ms(s.ts), v.ms(s.end))


def _collect_steps(v: FileView, track: str, out: list[StepTime], gaps: list[IdleGap]) -> None:
    stages = sorted(v.d.stages, key=lambda s: s.ts)
    by_step: dict[int | None, list[Range]] = defaultdict(list)
    for s in stages:
        by_step[v.step_at(s.ts)].append(s)
    for n, r in v.steps:
        inside = [(max(s.ts, r.ts), min(s.end, r.end)) for s in by_step.get(n, [])]
        covered = _union([(a, b) for a, b in inside if b > a])
        out.append(
            StepTime(
                step=n,
                track=track,
                start_ms=v.ms(r.ts),
                wall_ms=r.dur / 1000.0,
                stages_ms=covered / 1000.0,
                idle_ms=max(0.0, r.dur - covered) / 1000.0,
            )
        )
    ranges = {n: r for n, r in v.steps}
    for n, members in by_step.items():
        _gaps_of(v, track, n, members, ranges.get(n) if n is not None else None, gaps)


def _gaps_of(
    v: FileView, track: str, step: int | None, stages: list[Range], rng: Range | None, out: list
) -> None:
    edges: list[tuple[str, float, float]] = []  # (label, start, end) in µs
    if rng is not None:
        edges.append(("(step start)", rng.ts, rng.ts))
    edges += [(s.name, s.ts, s.end) for s in stages]
    if rng is not None:
        edges.append(("(step end)", rng.end, rng.end))
    reach = None
    after = None
    for name, start, end in edges:
        if reach is not None and start - reach > _EPS_MS * 1000:
            out.append(
                IdleGap(
                    step=step,
                    track=track,
                    after=after or "",
                    before=name,
                    start_ms=v.ms(reach),
                    gap_ms=(start - reach) / 1000.0,
                )
            )
        if reach is None or end >= reach:
            reach, after = end, name


def _union(spans: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= reach:
            continue
        total += b - max(a, reach)
        reach = b
    return total


def _collect_minis(v: FileView, track: str, out: list[MiniBatchTime]) -> None:
    micro = sorted(r.ts for r in v.d.ranges if (m := marker(r.name)) and m[0] == "micro_batch")
    for r in v.d.ranges:
        m = marker(r.name)
        if not m or m[0] != "mini_batch":
            continue
        stage = v.stage_at(r.ts)
        # a discrete trace's window of a few mini-batches (a schedule's) holds mini-batches
        # of its stage, whose range began before the window: its stage is the file's
        discrete = not v.steps and is_stage_scope(v.ident.scope)
        name = stage.name if stage else (v.ident.scope if discrete else None)
        inner = bisect.bisect_right(micro, r.end) - bisect.bisect_left(micro, r.ts)
        out.append(
            MiniBatchTime(
                step=v.step_at(r.ts),
                stage=name,
                track=track,
                index=m[1],
                start_ms=v.ms(r.ts),
                wall_ms=r.dur / 1000.0,
                micro_batches=inner,
            )
        )
