"""The straggler rule's arithmetic, shared by the summary (``profd.analysis.stragglers``) and
the live straggler triggers (``profd.actors.trigger_book``): one member of a group against
the others (leave-one-out), and why a late member is late.

A member is late when it is above the median of the others by more than the largest of
``k`` times their median absolute deviation (scaled by :data:`MAD_SCALE`, a standard
deviation for normal noise), an absolute floor and a fraction of the group's median wall
time (:func:`late_floor`).
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median

__all__ = ["MAD_SCALE", "against_peers", "late_cause_name", "late_floor"]

MAD_SCALE = 1.4826


def against_peers(
    values: Sequence[float], i: int, floor: float, k: float
) -> tuple[float, float, float]:
    """``(late, reference, threshold)``: how far ``values[i]`` is above the median of the
    others, that median, and the bar it must pass."""
    peers = [v for j, v in enumerate(values) if j != i]
    ref = median(peers)
    spread = median(abs(p - ref) for p in peers) * MAD_SCALE
    return values[i] - ref, ref, max(k * spread, floor)


def late_floor(walls: Sequence[float], abs_floor: float, rel_floor: float) -> float:
    """The least lateness that counts: the absolute floor or a share of the median wall."""
    return max(abs_floor, rel_floor * median(walls))


def late_cause_name(start_late: float, start_bar: float, extra_wall: float, wall_bar: float) -> str:
    """Why a late member is late (``profd.analysis.models.LateCause``'s values): its start
    and its wall time, each judged by the rule; when neither passes on its own (the delay is
    split between them), the larger part is named."""
    late_start, long = start_late > start_bar, extra_wall > wall_bar
    if late_start and long:
        return "late start and long duration"
    if late_start or long:
        return "late start" if late_start else "long duration"
    return "late start" if start_late > extra_wall else "long duration"
