"""``profd diff A B``: what changed between two sessions of one workload.

Pure functions of two :class:`~profd.analysis.models.SessionSummary` (no Ray, no torch). Per
stage x role (and per rank where both sessions have it) the median wall time of the stage
over every (step, rank) sample, in A and in B, its change, and a verdict: *slower* / *faster*
when the change is beyond the noise, else *same*. The noise threshold is the largest of

* ``k`` times the spread of A's samples (scaled median absolute deviation: the baseline's
  own noise; B varying more is part of what changed),
* an absolute floor (ms) and
* a fraction of A's median,

so a stage whose steps vary by 20 % is not called slower for a 5 % change, and one that never
varies is not called slower for a 0.1 ms jitter. Device time (idle, computation, non-compute,
overlap) is compared per step, per role and rank, for the window and per stage
(:mod:`profd.analysis.diff_gpu`). Operators and kernels are compared per stage by self time
and calls (:attr:`SessionSummary.top_ops`: summarise with a generous ``top`` so
that an operator just outside one session's list is not taken for a new one).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from enum import StrEnum
from statistics import median

from pydantic import BaseModel, ConfigDict, Field

from profd.analysis.diff_gpu import GpuChange, gpu_changes
from profd.analysis.models import SessionSummary
from profd.core.peer_rule import MAD_SCALE

__all__ = [
    "DIFF_TOP_OPS",
    "DiffRule",
    "OpChange",
    "SessionDiff",
    "StageChange",
    "Verdict",
    "diff_summaries",
]

#: Operators kept per stage when summarising for a diff: an operator just outside one
#: session's top list would otherwise look new in the other.
DIFF_TOP_OPS = 50


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Verdict(StrEnum):
    SLOWER = "slower"
    FASTER = "faster"
    SAME = "same"
    ONLY_A = "only in A"
    ONLY_B = "only in B"


class DiffRule(_Frozen):
    """When a change is beyond the noise."""

    k: float = Field(3.0, gt=0, description="Multiple of A's spread (scaled MAD).")
    abs_floor_ms: float = Field(1.0, ge=0, description="Never a change below this (ms).")
    rel_floor: float = Field(0.05, ge=0, lt=1, description="Never below this share of A.")


class StageChange(_Frozen):
    """One stage of one role (``rank`` None: every rank) in A and in B."""

    stage: str = Field(description="Stage label.")
    role: str | None = Field(description="Role.")
    rank: int | None = Field(description="Rank; None for the role as a whole.")
    a_ms: float | None = Field(description="Median wall time per step in A (None: not in A).")
    b_ms: float | None = Field(description="Median wall time per step in B (None: not in B).")
    delta_ms: float | None = Field(description="B minus A.")
    delta_pct: float | None = Field(description="B minus A, in percent of A.")
    threshold_ms: float | None = Field(description="The noise threshold the verdict used.")
    samples: tuple[int, int] = Field(description="(step, rank) samples in A and in B.")
    verdict: Verdict = Field(description="slower / faster / same / only in A / only in B.")


class OpChange(_Frozen):
    """One operator or kernel of one stage, by self time, in A and in B."""

    stage: str | None = Field(description="Stage (None: outside every stage).")
    device: str = Field(description="'cpu' or 'gpu'.")
    name: str = Field(description="Operator or kernel.")
    category: str = Field(description="Trace category.")
    a_calls: int = Field(description="Calls in A.")
    b_calls: int = Field(description="Calls in B.")
    a_self_ms: float = Field(description="Self time in A.")
    b_self_ms: float = Field(description="Self time in B.")
    delta_ms: float = Field(description="B minus A (self time).")


class SessionDiff(_Frozen):
    """Session B against session A."""

    a: str = Field(description="Where A's traces came from.")
    b: str = Field(description="Where B's traces came from.")
    rule: DiffRule = Field(description="The noise rule of the verdicts.")
    stages: list[StageChange] = Field(description="Per stage x role, in A's stage order.")
    ranks: list[StageChange] = Field(description="Per stage x role x rank both sessions have.")
    ops: list[OpChange] = Field(description="Operators and kernels that changed most.")
    gpu: list[GpuChange] = Field(
        default_factory=list,
        description="Device time per step per role (and rank both have), for the whole "
        "window and per stage, in A and in B (empty when neither has device events).",
    )


def _spread(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mid = median(values)
    return MAD_SCALE * median(abs(v - mid) for v in values)


def _change(
    key: tuple[str, str | None, int | None],
    a: list[float],
    b: list[float],
    rule: DiffRule,
) -> StageChange:
    stage, role, rank = key
    if not a or not b:
        only = Verdict.ONLY_B if b else Verdict.ONLY_A
        return StageChange(
            stage=stage, role=role, rank=rank, a_ms=median(a) if a else None,
            b_ms=median(b) if b else None, delta_ms=None, delta_pct=None, threshold_ms=None,
            samples=(len(a), len(b)), verdict=only,
        )  # fmt: skip
    a_ms, b_ms = median(a), median(b)
    delta = b_ms - a_ms
    # the baseline's own spread is the noise: B varying more is part of what changed
    threshold = max(rule.k * _spread(a), rule.abs_floor_ms, rule.rel_floor * a_ms)
    verdict = Verdict.SAME
    if abs(delta) > threshold:
        verdict = Verdict.SLOWER if delta > 0 else Verdict.FASTER
    return StageChange(
        stage=stage, role=role, rank=rank, a_ms=a_ms, b_ms=b_ms, delta_ms=delta,
        delta_pct=100.0 * delta / a_ms if a_ms else None, threshold_ms=threshold,
        samples=(len(a), len(b)), verdict=verdict,
    )  # fmt: skip


def _samples(
    s: SessionSummary, per_rank: bool
) -> dict[tuple[str, str | None, int | None], list[float]]:
    out: dict[tuple[str, str | None, int | None], list[float]] = defaultdict(list)
    for r in s.stage_times:
        out[(r.stage, r.role, r.rank if per_rank else None)].append(r.wall_ms)
    return out


def _ordered(keys: Iterable[tuple], a: SessionSummary, b: SessionSummary) -> list[tuple]:
    order = {st: i for i, st in enumerate([*a.stages, *(x for x in b.stages if x not in a.stages)])}
    return sorted(
        keys, key=lambda k: (order.get(k[0], len(order)), k[1] or "", -1 if k[2] is None else k[2])
    )


def _ops(a: SessionSummary, b: SessionSummary, top: int) -> list[OpChange]:
    def table(s: SessionSummary) -> dict[tuple, tuple[str, int, float]]:
        return {
            (g.stage, g.device, o.name): (o.category, o.calls, o.self_ms)
            for g in s.top_ops
            for o in g.ops
        }

    ta, tb = table(a), table(b)
    rows = []
    for key in ta.keys() | tb.keys():
        cat, a_calls, a_ms = ta.get(key, (tb.get(key, ("", 0, 0.0))[0], 0, 0.0))
        _, b_calls, b_ms = tb.get(key, (cat, 0, 0.0))
        stage, device, name = key
        rows.append(
            OpChange(
                stage=stage,
                device=device,
                name=name,
                category=cat,
                a_calls=a_calls,
                b_calls=b_calls,
                a_self_ms=a_ms,
                b_self_ms=b_ms,
                delta_ms=b_ms - a_ms,
            )
        )
    rows.sort(key=lambda r: (-abs(r.delta_ms), r.stage or "", r.name))
    return rows[:top]


def diff_summaries(
    a: SessionSummary, b: SessionSummary, rule: DiffRule | None = None, top: int = 10
) -> SessionDiff:
    """B against A: stages per role and per rank, and the ``top`` operators that changed most."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top: must be an int >= 1, got {top!r}")
    rule = rule or DiffRule()
    result = {}
    for per_rank in (False, True):
        sa, sb = _samples(a, per_rank), _samples(b, per_rank)
        keys = sa.keys() | sb.keys() if not per_rank else sa.keys() & sb.keys()
        result[per_rank] = [
            _change(k, sa.get(k, []), sb.get(k, []), rule) for k in _ordered(keys, a, b)
        ]
    return SessionDiff(
        a=a.source, b=b.source, rule=rule, stages=result[False], ranks=result[True],
        ops=_ops(a, b, top), gpu=gpu_changes(a, b),
    )  # fmt: skip
