"""Straggler ranks: a stage that ends late against the same stage on the peer ranks.

For each (role, step, stage) and each rank, the reference is the median end time of the
*other* ranks (leave-one-out, so the late rank does not pull the reference towards itself,
and two ranks can still be compared). The rank is late when it ends after that median by
more than the largest of:

* ``k`` times the peers' median absolute deviation (scaled by 1.4826 to match a standard
  deviation for normal noise) — noisy groups need more to stand out;
* an absolute floor (milliseconds) — ignores scheduler jitter when peers agree perfectly;
* a fraction of the median wall time of the stage — a few ms do not matter in a minute.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from statistics import median
from typing import NamedTuple

from profd.analysis.models import StageTime, Straggler, StragglerRule

__all__ = ["Lateness", "detect_stragglers", "late_outliers"]

MAD_SCALE = 1.4826


class Lateness(NamedTuple):
    index: int
    late: float
    reference: float
    threshold: float


def late_outliers(
    ends: Sequence[float], walls: Sequence[float], rule: StragglerRule
) -> list[Lateness]:
    """Which of ``ends`` are late against the others (see the module docstring)."""
    if len(ends) < 2:
        return []
    floor = max(rule.abs_floor_ms, rule.rel_floor * median(walls))
    out = []
    for i, end in enumerate(ends):
        peers = [e for j, e in enumerate(ends) if j != i]
        ref = median(peers)
        spread = median(abs(p - ref) for p in peers) * MAD_SCALE
        threshold = max(rule.k * spread, floor)
        late = end - ref
        if late > threshold:
            out.append(Lateness(i, late, ref, threshold))
    return out


def detect_stragglers(rows: Sequence[StageTime], rule: StragglerRule) -> list[Straggler]:
    """Late ranks over every (role, step, stage) group of ``rows``, latest first."""
    groups: dict[tuple[str | None, int | None, str], list[StageTime]] = defaultdict(list)
    for r in rows:
        groups[(r.role, r.step, r.stage)].append(r)
    found: list[Straggler] = []
    for (role, step, stage), members in groups.items():
        ends = [m.end_ms for m in members]
        walls = [m.wall_ms for m in members]
        for hit in late_outliers(ends, walls, rule):
            m = members[hit.index]
            peers = [w for j, w in enumerate(walls) if j != hit.index]
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
                    peer_median_wall_ms=median(peers),
                )
            )
    found.sort(key=lambda s: -s.late_ms)
    return found
