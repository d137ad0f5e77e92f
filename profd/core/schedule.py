"""Step grouping and mini-batch schedules (reference §5, §6.2, §7). Pure functions."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from profd.core.naming import mb_suffix, part_suffix

__all__ = [
    "SCHEDULE_KEYS",
    "continuous_schedule",
    "discrete_schedule",
    "group_steps",
    "mini_batch_window",
    "window_suffix",
]

SCHEDULE_KEYS = ("skip_first", "wait", "warmup", "active", "repeat")


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


def continuous_schedule(schedule: Mapping[str, int] | None) -> dict[str, int] | None:
    """Schedule of a continuous collection (reference §5.2): ``None`` records the whole
    window; otherwise the values as configured, except ``repeat`` 0 becomes 1."""
    if not schedule or int(schedule.get("active", 0)) <= 0:
        return None
    out = {k: int(schedule.get(k, 0)) for k in SCHEDULE_KEYS}
    out["repeat"] = out["repeat"] or 1
    return out


def discrete_schedule(schedule: Mapping[str, int] | None) -> dict[str, int] | None:
    """Schedule of a discrete update stage: the configured values verbatim (0 = unlimited)."""
    if not schedule or int(schedule.get("active", 0)) <= 0:
        return None
    return {k: int(schedule.get(k, 0)) for k in SCHEDULE_KEYS}


def mini_batch_window(step_num: int, schedule: Mapping[str, int]) -> tuple[int, int]:
    """Mini-batches ``(first, last)`` held by a window torch saves at ``step_num`` (§6.2).

    ``step()`` runs once after each mini-batch, so ``step_num`` is one past the last
    mini-batch that ran; a window cut short by the end of the loop reports fewer mini-batches.
    """
    first, last = _active_span(step_num, schedule)
    return min(first, last), last


def _active_span(step_num: int, schedule: Mapping[str, int]) -> tuple[int, int]:
    """The first active mini-batch of the cycle holding the last mini-batch that ran, and
    that last one; ``first > last`` when the loop ended before the cycle became active."""
    skip, wait, warmup = schedule["skip_first"], schedule["wait"], schedule["warmup"]
    active = max(schedule["active"] or 1, 1)
    last = max(step_num - 1, 0)
    cycle_len = wait + warmup + active
    cycle = max(last - skip, 0) // cycle_len if cycle_len else 0
    return skip + cycle * cycle_len + wait + warmup, last


def window_suffix(
    step_num: int,
    previous_step_num: int | None,
    save_index: int,
    schedule: Mapping[str, int] | None,
    name_mini_batches: bool,
) -> str:
    """Suffix of one saved window.

    Discrete update stages with a schedule name windows by their mini-batches (``_mb3-4``).
    A window that recorded no mini-batch — no mini-batch ran since the previous save (the
    tail torch saves when a loop ends exactly at a window boundary), or the loop ended while
    the cycle was still warming up — gets a ``_part<N>`` name instead, so it can never
    replace or impersonate the real window of those mini-batches (reference §13 item 1).
    Other windows are ``""`` for the first save and ``_part<N>`` after.
    """
    ran_mini_batches = step_num > (previous_step_num if previous_step_num is not None else 0)
    if name_mini_batches and schedule is not None and ran_mini_batches:
        first, last = _active_span(step_num, schedule)
        if first <= last:
            return mb_suffix(first, last)
    return part_suffix(save_index)
