"""Step grouping and mini-batch schedules (reference §5, §6.2, §7). Pure functions."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["group_steps"]


def group_steps(steps: Iterable[int], continuous: bool) -> tuple[tuple[int, ...], ...]:
    """Split profiled steps into collections.

    With ``continuous`` a run of consecutive steps shares one collection (named by its first
    step); otherwise every step is its own collection. ``[1, 2, 5]`` →
    ``((1, 2), (5,))`` or ``((1,), (2,), (5,))``.
    """
    ordered = sorted(set(steps))
    if not continuous:
        return tuple((s,) for s in ordered)
    groups: list[list[int]] = []
    for s in ordered:
        if groups and s == groups[-1][-1] + 1:
            groups[-1].append(s)
        else:
            groups.append([s])
    return tuple(tuple(g) for g in groups)
