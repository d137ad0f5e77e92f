"""The straggler rule's arithmetic, shared by the summary (``profd.analysis.stragglers``) and
the live straggler triggers (``profd.actors.trigger_book``): one member of a group against
the others (leave-one-out), and why a late member is late.

A member is late when it is above the median of the others by more than the largest of
``k`` times their median absolute deviation (scaled by :data:`MAD_SCALE`, a standard
deviation for normal noise), an absolute floor and a fraction of the group's median wall
time (:func:`late_floor`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from statistics import median

__all__ = ["MAD_SCALE", "Against", "against_all", "against_peers", "late_cause_name", "late_floor"]

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


@dataclass(frozen=True, slots=True)
class Against:
    """:func:`against_peers` for every member of a group, as columns: a fleet's group is
    thousands of ranks, and a tuple per member is that many more objects to collect."""

    late: list[float]
    reference: list[float]
    threshold: list[float]

    def rows(self) -> Iterator[tuple[float, float, float]]:
        """Each member's ``(late, reference, threshold)``, as :func:`against_peers`."""
        return zip(self.late, self.reference, self.threshold, strict=True)


def against_all(values: Sequence[float], floor: float, k: float) -> Against:
    """:func:`against_peers` for every member, the same numbers, in O(n log n) rather than a
    sort of the others per member (a fleet's group is thousands of ranks).

    Leaving one member out of the sorted values shifts the middle by at most one place, so
    the others' median takes at most three values; for each, the deviations are sorted once
    and the member's own deviation is left out the same way."""
    if len(values) < 2:
        raise ValueError("values: a member needs at least one peer")
    ordered = sorted(values)
    medians = _medians_without_one(ordered)
    spreads: dict[float, tuple[list[float], tuple[int, float, float, float]]] = {}
    out = Against([], [], [])
    for v in values:
        ref = _pick(medians, bisect.bisect_left(ordered, v))
        dev = spreads.get(ref)
        if dev is None:  # every member's deviation from this reference, sorted once
            deviations = sorted(abs(p - ref) for p in values)
            dev = spreads[ref] = (deviations, _medians_without_one(deviations))
        spread = _pick(dev[1], bisect.bisect_left(dev[0], abs(v - ref))) * MAD_SCALE
        out.late.append(v - ref)
        out.reference.append(ref)
        out.threshold.append(max(k * spread, floor))
    return out


def _medians_without_one(ordered: Sequence[float]) -> tuple[int, float, float, float]:
    """``statistics.median`` of ``ordered`` (sorted) less its item at rank ``r``, for ``r``
    below, at and above the middle ``h``: ``(h, below, at, above)``."""
    m = len(ordered) - 1  # what is left
    h = m // 2
    if m % 2:
        return h, ordered[h + 1], ordered[h + 1], ordered[h]
    return (
        h,
        (ordered[h] + ordered[h + 1]) / 2,
        (ordered[h - 1] + ordered[h + 1]) / 2,
        (ordered[h - 1] + ordered[h]) / 2,
    )


def _pick(medians: tuple[int, float, float, float], r: int) -> float:
    h, below, at, above = medians
    return above if r > h else at if r == h else below


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
