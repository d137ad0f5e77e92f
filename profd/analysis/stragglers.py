"""Straggler ranks: a stage that ends late against the same stage on the peer ranks.

For each (role, step, stage) and each rank, the reference is the median end time of the
*other* ranks (leave-one-out, so the late rank does not pull the reference towards itself,
and two ranks can still be compared). The rank is late when it ends after that median by
more than the largest of:

* ``k`` times the peers' median absolute deviation (scaled by 1.4826 to match a standard
  deviation for normal noise) — noisy groups need more to stand out;
* an absolute floor (milliseconds) — ignores scheduler jitter when peers agree perfectly;
* a fraction of the median wall time of the stage — a few ms do not matter in a minute.

A late end has a cause (:class:`LateCause`): the stage *started* late (an earlier stage of the
step ran late and pushed it; its own duration is normal), or it *ran long*, or both. Each
part is judged by the same rule, applied to the starts and to the wall times of the group:
a stage that merely inherited a delay must not be blamed for being slow.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

from profd.analysis.models import LateCause, StageTime, Straggler, StragglerRule
from profd.core.peer_rule import against_all, against_peers, late_cause_name, late_floor

__all__ = ["Lateness", "detect_stragglers", "late_cause", "late_outliers"]


class Lateness(NamedTuple):
    index: int
    late: float
    reference: float
    threshold: float


def _against_peers(values: Sequence[float], i: int, floor: float, k: float) -> Lateness:
    """How far ``values[i]`` is above the median of the others, and the bar it must pass."""
    return Lateness(i, *against_peers(values, i, floor, k))


def _floor(walls: Sequence[float], rule: StragglerRule) -> float:
    return late_floor(walls, rule.abs_floor_ms, rule.rel_floor)


def late_outliers(
    ends: Sequence[float], walls: Sequence[float], rule: StragglerRule
) -> list[Lateness]:
    """Which of ``ends`` are late against the others (see the module docstring)."""
    if len(ends) < 2:
        return []
    floor = _floor(walls, rule)
    hits = (Lateness(i, *h) for i, h in enumerate(against_all(ends, floor, rule.k).rows()))
    return [h for h in hits if h.late > h.threshold]


def late_cause(
    starts: Sequence[float], walls: Sequence[float], i: int, rule: StragglerRule
) -> tuple[Lateness, Lateness, LateCause]:
    """Why member ``i`` (already late by its end) is late: its start against the peers'
    starts, its wall time against theirs, and the verdict. When neither part passes the rule
    on its own (the delay is split between them), the larger part is named."""
    floor = _floor(walls, rule)
    start = _against_peers(starts, i, floor, rule.k)
    wall = _against_peers(walls, i, floor, rule.k)
    cause = LateCause(late_cause_name(start.late, start.threshold, wall.late, wall.threshold))
    return start, wall, cause


def detect_stragglers(rows: Sequence[StageTime], rule: StragglerRule) -> list[Straggler]:
    """Late ranks over every (role, step, stage) group of ``rows``, latest first."""
    groups: dict[tuple[str | None, int | None, str], list[StageTime]] = defaultdict(list)
    for r in rows:
        groups[(r.role, r.step, r.stage)].append(r)
    found: list[Straggler] = []
    for (role, step, stage), members in groups.items():
        ends = [m.end_ms for m in members]
        walls = [m.wall_ms for m in members]
        starts = [m.start_ms for m in members]
        for hit in late_outliers(ends, walls, rule):
            m = members[hit.index]
            start, wall, cause = late_cause(starts, walls, hit.index, rule)
            found.append(
                Straggler(
                    step=step,
                    stage=stage,
                    role=role,
                    rank=m.rank,
                    track=m.track,
                    end_ms=m.end_ms,
                    peer_median_end_ms=hit.reference,
                    late_ms=hit.late,
                    threshold_ms=hit.threshold,
                    wall_ms=m.wall_ms,
                    peer_median_wall_ms=wall.reference,
                    start_ms=m.start_ms,
                    peer_median_start_ms=start.reference,
                    start_late_ms=start.late,
                    extra_wall_ms=wall.late,
                    cause=cause,
                )
            )
    found.sort(key=lambda s: -s.late_ms)
    return found
