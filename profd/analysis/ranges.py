"""The ranges profd writes into a trace, and which of them are stages.

The agent records ``step<n>`` around each profiled step, the stage label around each stage,
and ``mini_batch<i>`` / ``micro_batch<j>`` inside update loops — all as ``user_annotation``
ranges. A *stage* is any other ``user_annotation`` range that is not nested inside another
such range on the same thread, on a thread that holds those marks: a ``record_function`` the
user's own model code opens inside a stage stays part of that stage instead of becoming a
stage of its own, and a library's range on a thread of its own (gloo's) is no stage.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["RANGE_CATEGORY", "Range", "marker", "select_stages", "step_ranges"]

RANGE_CATEGORY = "user_annotation"
#: How torch.profiler names its own step rows (``prof.step()``; ``user_annotation`` too).
PROFILER_STEP = "ProfilerStep#"

_MARKERS = (
    ("step", re.compile(r"^step(\d+)$")),
    ("mini_batch", re.compile(r"^mini_batch(\d+)$")),
    ("micro_batch", re.compile(r"^micro_batch(\d+)$")),
    ("step", re.compile(r"^ProfilerStep#(\d+)$")),  # torch's own step rows (prof.step())
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


def select_stages(ranges: Sequence[Range], scope: str | None = None) -> list[int]:
    """Indices of the stage ranges: unmarked ranges not nested in another unmarked one, on
    the threads that hold profd's marks (steps, mini- and micro-batches, or the range named
    by the file's ``scope``: a discrete trace's stage; every thread in a file with none). A
    library's range on a thread of its own is not a stage: torch's ``gloo:all_reduce`` runs
    on gloo's thread while the training thread's stage waits for it (it was counted a stage,
    and took the mini-batches and operators it overlapped)."""
    marked = {r.thread for r in ranges if marker(r.name) is not None or r.name == scope}
    order = sorted(
        (
            i
            for i, r in enumerate(ranges)
            if marker(r.name) is None and (not marked or r.thread in marked)
        ),
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


def step_ranges(ranges: Sequence[Range]) -> list[tuple[int, Range]]:
    """The file's steps as (number, range): profd's ``step<n>`` ranges, or, in a file that has
    none (any torch.profiler trace), torch's ``ProfilerStep#<n>`` rows. Never both: a file
    with profd's steps and torch's rows would otherwise count each step twice."""
    steps = [(m[1], r) for r in ranges if (m := marker(r.name)) and m[0] == "step"]
    own = [(n, r) for n, r in steps if not r.name.startswith(PROFILER_STEP)]
    return own or steps
