"""A straggler trigger's judgement of one step: each rank's stage end against the other
ranks' by the summary's straggler rule (``profd.analysis.stragglers``), kept per step.

Pure logic (no Ray); :class:`~profd.actors.trigger_book.TriggerBook` keeps the verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from profd.core.peer_rule import against_all, late_cause_name, late_floor

__all__ = [
    "KEPT_VERDICTS",
    "RULE",
    "Lateness",
    "StepVerdict",
    "StragglerRule",
    "judge_new_steps",
    "judge_step",
]

#: Steps judged per straggler trigger (the newest; ``for_steps`` is at most 16).
KEPT_VERDICTS = 64


@dataclass(frozen=True, slots=True)
class StragglerRule:
    """The summary's straggler rule (``profd.analysis.models.StragglerRule``'s defaults, in
    seconds): late by more than ``max(k x MAD x 1.4826, abs_floor_s, rel_floor x median
    wall time)``."""

    k: float = 3.0
    abs_floor_s: float = 0.005
    rel_floor: float = 0.05


RULE = StragglerRule()


@dataclass(frozen=True, slots=True)
class Lateness:
    """One rank's stage in one step against the other ranks' (seconds)."""

    late: float  # its end minus the peers' median end
    reference: float  # the peers' median end
    threshold: float  # the bar ``late`` must pass
    end: float
    start_late: float  # its start minus the peers' median start
    extra_wall: float  # its wall time minus the peers' median wall time
    start_threshold: float
    wall_threshold: float

    @property
    def is_late(self) -> bool:
        return self.late > self.threshold

    @property
    def cause(self) -> str:
        """As ``profd.analysis.models.LateCause``: late start, long duration, or both."""
        return late_cause_name(
            self.start_late, self.start_threshold, self.extra_wall, self.wall_threshold
        )


@dataclass(frozen=True, slots=True)
class StepVerdict:
    """One step of a straggler trigger's stage, judged across the role's ranks: the ranks
    late by the rule, and the healthy peer (the rank not late whose end is closest to the
    others' median end). Only these are kept: a fleet's step is thousands of ranks."""

    late: dict[int, Lateness]
    peer: int | None
    members: int


def judge_step(
    ranks: list[int],
    starts: list[float],
    ends: list[float],
    walls: list[float],
    rule: StragglerRule = RULE,
) -> StepVerdict:
    """Each rank of one (role, step, stage) group against the others (at least two), by the
    summary's rule (``profd.analysis.stragglers.late_outliers`` / ``late_cause``). Starts and
    wall times only explain why a rank is late: they are judged when one is."""
    floor = late_floor(walls, rule.abs_floor_s, rule.rel_floor)
    by_end = against_all(ends, floor, rule.k)
    late_at = [i for i, (d, _, thr) in enumerate(by_end.rows()) if d > thr]
    late: dict[int, Lateness] = {}
    if late_at:
        by_start, by_wall = against_all(starts, floor, rule.k), against_all(walls, floor, rule.k)
        for i in late_at:
            late[ranks[i]] = Lateness(
                by_end.late[i], by_end.reference[i], by_end.threshold[i], ends[i],
                by_start.late[i], by_wall.late[i], by_start.threshold[i], by_wall.threshold[i],
            )  # fmt: skip
    healthy = min(  # the rank not late closest to the others' median end
        ((abs(d), r) for r, (d, _, thr) in zip(ranks, by_end.rows(), strict=True) if d <= thr),
        default=None,
    )
    return StepVerdict(late, None if healthy is None else healthy[1], len(ranks))


def judge_new_steps(
    verdicts: dict[int, StepVerdict], new: list[int], per_rank: dict[int, dict[int, Any]]
) -> list[int]:
    """Judge each step of ``new`` (sorted) that every rank of ``per_rank`` (rank -> step ->
    its span) has reported and is not in ``verdicts`` yet, keeping the newest
    :data:`KEPT_VERDICTS`; the steps judged, oldest first. A step below the newest judged is
    a new run (a job resumed from a checkpoint): the verdicts start afresh."""
    judged = []
    for s in new:
        if verdicts and s < max(verdicts):  # the job went back (a resume): a new run
            verdicts.clear()
            judged.clear()
        if s in verdicts or any(s not in steps for steps in per_rank.values()):
            continue
        ranks = sorted(per_rank)
        got = [per_rank[r][s] for r in ranks]
        verdicts[s] = judge_step(
            ranks, [g.start for g in got], [g.end for g in got], [g.wall for g in got]
        )
        judged.append(s)
    while len(verdicts) > KEPT_VERDICTS:
        del verdicts[next(iter(verdicts))]  # the oldest judged
    return [s for s in judged if s in verdicts]
