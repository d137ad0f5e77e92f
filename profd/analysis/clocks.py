"""Whether a session's trace files share one clock.

Every trace profd writes, and every real engine trace, places its events on the wall clock
(``ts`` µs after the header's ``baseTimeNanoseconds``). A file without that header and with
small ``ts`` values runs on a clock of its own (µs since its own start); mixed with the others
it would put its events decades away on the timeline. Such files are kept apart, with the
reason, rather than merged or summarised on a wrong clock. Pure: no Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["EPOCH_FLOOR_US", "FAR_APART_US", "Clocks", "split_clocks"]

#: 2001-09-09 in µs since the epoch: a wall-clock start is above it, a relative one far below.
EPOCH_FLOOR_US = 1e15
#: Files of one session recorded more than a day apart from the rest are not on its clock.
FAR_APART_US = 86_400e6


@dataclass(frozen=True, slots=True)
class Clocks:
    """Which files stay on the shared timeline, and why the others do not."""

    together: tuple[str, ...]
    apart: Mapping[str, str]


def split_clocks(starts: Mapping[str, float]) -> Clocks:
    """Split files (name → first event on its own base, µs) by clock. With at least one file
    on the wall clock, relative files and files a day or more from the median start are
    apart; with none, every file is relative and they stay together (one clock of their own)."""
    wall = {n: t for n, t in starts.items() if t >= EPOCH_FLOOR_US}
    if not wall:
        return Clocks(tuple(starts), {})
    ordered = sorted(wall.values())
    median = ordered[len(ordered) // 2]
    apart: dict[str, str] = {}
    for name, t in starts.items():
        if t < EPOCH_FLOOR_US:
            apart[name] = (
                "its events are not on the wall clock (no baseTimeNanoseconds, ts from 0): "
                "not aligned with the other traces; open it on its own"
            )
        elif abs(t - median) > FAR_APART_US:
            days = abs(t - median) / 86_400e6
            apart[name] = f"recorded {days:.0f} day(s) away from the other traces: not aligned"
    return Clocks(tuple(n for n in starts if n not in apart), apart)
