"""The GPU side of ``profd diff``: each role's (and rank's) device time per profiled step, in A
and in B, for the whole window and per stage.

:attr:`SessionSummary.gpu` holds totals over a track's profiled steps, and two sessions rarely
profile the same number of steps, so figures are compared *per step*: a track's totals divided
by its profiled steps (its :attr:`SessionSummary.step_times` rows; one when it has none). A
role's figure is the mean over its ranks' steps (totals of every rank over their steps);
its overlap share is weighted by communication time. These rows carry no verdict: the
verdicts are on stage wall times, whose per-step samples give the noise; the device totals
give no spread to call noise by.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from profd.analysis.models import GpuTime, SessionSummary

__all__ = ["GpuChange", "GpuPerStep", "GpuScope", "gpu_changes"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GpuScope(StrEnum):
    WINDOW = "window"  # every device event inside the profiled steps
    STAGE = "stage"  # the events launched in one stage (and its idle time)


class GpuPerStep(_Frozen):
    """Device time per profiled step (ms), HTA's definitions (docs/gpu-breakdown.md)."""

    steps: int = Field(description="Track-steps the figures average over (steps x ranks).")
    window_ms: float = Field(description="Window per step.")
    idle_ms: float = Field(description="Idle time per step.")
    compute_ms: float = Field(description="Computation time per step.")
    non_compute_ms: float = Field(description="Communication or memory time not overlapped.")
    communication_ms: float = Field(description="Communication time per step.")
    memory_ms: float = Field(description="Memcpy / memset time per step.")
    comm_comp_overlap_pct: float | None = Field(
        description="Share of communication time overlapped by computation; None without any."
    )


class GpuChange(_Frozen):
    """One role (``rank`` None) or rank, for its whole window or one stage, in A and in B."""

    scope: GpuScope = Field(description="'window' (every device event) or 'stage'.")
    stage: str | None = Field(description="Stage label ('stage' scope; None: outside stages).")
    role: str | None = Field(description="Role.")
    rank: int | None = Field(description="Rank; None for the role as a whole.")
    a: GpuPerStep | None = Field(description="Per step in A (None: no device time in A).")
    b: GpuPerStep | None = Field(description="Per step in B (None: no device time in B).")
    idle_delta_ms: float | None = Field(description="Idle per step, B minus A.")
    compute_delta_ms: float | None = Field(description="Computation per step, B minus A.")
    non_compute_delta_ms: float | None = Field(description="Non-compute per step, B minus A.")
    overlap_delta_pp: float | None = Field(description="Overlap share, B minus A (points).")


_Key = tuple[GpuScope, str | None, str | None, int | None]  # scope, stage, role, rank
_FIELDS = ("window_ms", "idle_ms", "compute_ms", "non_compute_ms", "communication_ms", "memory_ms")


class _Sum:
    """Totals of several tracks' device time, and the track-steps they cover."""

    def __init__(self) -> None:
        self.steps = 0
        self.ms = dict.fromkeys(_FIELDS, 0.0)
        self.overlap_ms = 0.0

    def add(self, g: GpuTime, steps: int) -> None:
        self.steps += steps
        for f in _FIELDS:
            self.ms[f] += getattr(g, f)
        if g.comm_comp_overlap_pct is not None:
            self.overlap_ms += g.communication_ms * g.comm_comp_overlap_pct / 100.0

    def per_step(self) -> GpuPerStep:
        comm = self.ms["communication_ms"]
        return GpuPerStep(
            steps=self.steps,
            **{f: v / self.steps for f, v in self.ms.items()},
            comm_comp_overlap_pct=100.0 * self.overlap_ms / comm if comm > 0 else None,
        )


def _per_step(s: SessionSummary) -> dict[_Key, GpuPerStep]:
    steps = Counter(t.track for t in s.step_times)
    who = {t.track: (t.role, t.rank) for t in s.tracks}
    sums: dict[_Key, _Sum] = defaultdict(_Sum)
    for g in s.gpu:
        role, rank = who.get(g.track, (None, None))
        n = steps.get(g.track) or 1
        for r in (None,) if rank is None else (None, rank):
            sums[(GpuScope.WINDOW, None, role, r)].add(g, n)
            for st in g.stages:
                sums[(GpuScope.STAGE, st.stage, role, r)].add(st, n)
    return {k: v.per_step() for k, v in sums.items()}


def _delta(a: GpuPerStep | None, b: GpuPerStep | None, field: str) -> float | None:
    if a is None or b is None:
        return None
    va, vb = getattr(a, field), getattr(b, field)
    return None if va is None or vb is None else vb - va


def gpu_changes(a: SessionSummary, b: SessionSummary) -> list[GpuChange]:
    """Per role and per rank both sessions have, the window then each stage (A's order)."""
    pa, pb = _per_step(a), _per_step(b)
    keys = {k for k in pa.keys() | pb.keys() if k[3] is None} | (pa.keys() & pb.keys())
    order = {st: i for i, st in enumerate([*a.stages, *(x for x in b.stages if x not in a.stages)])}

    def sort_key(k: _Key) -> tuple:
        scope, stage, role, rank = k
        place = -1 if scope is GpuScope.WINDOW else order.get(stage, len(order))
        return (role or "", -1 if rank is None else rank, place, stage or "")

    return [_change(k, pa.get(k), pb.get(k)) for k in sorted(keys, key=sort_key)]


def _change(k: _Key, a: GpuPerStep | None, b: GpuPerStep | None) -> GpuChange:
    return GpuChange(
        scope=k[0], stage=k[1], role=k[2], rank=k[3], a=a, b=b,
        idle_delta_ms=_delta(a, b, "idle_ms"), compute_delta_ms=_delta(a, b, "compute_ms"),
        non_compute_delta_ms=_delta(a, b, "non_compute_ms"),
        overlap_delta_pp=_delta(a, b, "comm_comp_overlap_pct"),
    )  # fmt: skip
