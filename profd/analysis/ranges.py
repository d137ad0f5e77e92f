"""The ranges profd writes into a trace, and which of them are stages.

The agent records ``step<n>`` around each profiled step, the stage label around each stage,
and ``mini_batch<i>`` / ``micro_batch<j>`` inside update loops — all as ``user_annotation``
ranges. A *stage* is any other ``user_annotation`` range that is not nested inside another
such range on the same thread: a ``record_function`` the user's own model code opens inside a
stage stays part of that stage instead of becoming a stage of its own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["RANGE_CATEGORY", "Range", "marker", "select_stages"]

RANGE_CATEGORY = "user_annotation"

_MARKERS = (
    ("step", re.compile(r"^step(\d+)$")),
    ("mini_batch", re.compile(r"^mini_batch(\d+)$")),
    ("micro_batch", re.compile(r"^micro_batch(\d+)$")),
    ("step", re.compile(r"^ProfilerStep#(\d+)$")),  # torch's own step rows, if a user enabled them
)


class Range(NamedTuple):
    """A ``user_annotation`` range of one file: times in µs on the file's own clock."""

    name: str
    ts: float
    dur: float
    thread: int  # index into the file's thread list

    @property
    def end(self) -> float:
        return self.ts + self.dur


def marker(name: str) -> tuple[str, int] | None:
    """``("step", 3)`` for ``step3``; ``("mini_batch", 0)``; ``None`` for a stage label."""
    for kind, pattern in _MARKERS:
        m = pattern.match(name)
        if m:
            return kind, int(m.group(1))
    return None


def select_stages(ranges: Sequence[Range]) -> list[int]:
    """Indices of the stage ranges: unmarked ranges not nested in another unmarked one."""
    order = sorted(
        (i for i, r in enumerate(ranges) if marker(r.name) is None),
        key=lambda i: (ranges[i].thread, ranges[i].ts, -ranges[i].dur),
    )
    top_end: dict[int, float] = {}
    chosen: list[int] = []
    for i in order:
        r = ranges[i]
        if r.ts >= top_end.get(r.thread, float("-inf")):
            chosen.append(i)
            top_end[r.thread] = r.end
    return sorted(chosen, key=lambda i: ranges[i].ts)
