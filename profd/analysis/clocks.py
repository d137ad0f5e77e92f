"""Whether a session's trace files share one clock.

Every trace profd writes, and every real engine trace, places its events on the wall clock
(``ts`` µs after the header's ``baseTimeNanoseconds``). A file without that header and with
small ``ts`` values runs on a clock of its own (µs since its own start); mixed with the others
it would put its events decades away on the timeline. When profd recorded when such a file's
recording started (:mod:`profd.core.clock_hints`: a rollout engine's window), its ``ts`` 0 is
placed there, with the uncertainty of that record; otherwise the file is kept apart, with the
reason, rather than merged or summarised on a wrong clock. Pure: no Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from profd.core.clock_hints import ClockHint, read_clock_hints

__all__ = [
    "EPOCH_FLOOR_US",
    "FAR_APART_US",
    "ClockHint",
    "Clocks",
    "clock_offset_us",
    "hints_for",
    "placed_text",
    "split_clocks",
]

#: 2001-09-09 in µs since the epoch: a wall-clock start is above it, a relative one far below.
EPOCH_FLOOR_US = 1e15
#: Files of one session recorded more than a day apart from the rest are not on its clock.
FAR_APART_US = 86_400e6


def clock_offset_us(header: Mapping[str, object]) -> float:
    """µs to add to a file's wall clock to put it on the coordinator's: the offset its agent
    measured when it wrote the file (``profd.clock.offset_us``); 0 without one."""
    meta = header.get("profd")
    clock = meta.get("clock") if isinstance(meta, dict) else None
    value = clock.get("offset_us") if isinstance(clock, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value)


def placed_text(hint: ClockHint) -> str:
    """How a relative file was placed, for warnings and reports."""
    return (
        f"has no wall clock of its own: its ts 0 was placed at the {hint.source} "
        f"(± {hint.uncertainty_us / 1000:.1f} ms)"
    )


def hints_for(paths: Iterable[str | Path]) -> dict[str, ClockHint]:
    """Path (as given) → the hint profd recorded beside it, read from each file's directory
    (a directory on another node has none here)."""
    by_dir: dict[Path, dict[str, ClockHint]] = {}
    found: dict[str, ClockHint] = {}
    for p in paths:
        path = Path(p)
        if path.parent not in by_dir:
            by_dir[path.parent] = read_clock_hints(path.parent)
        hint = by_dir[path.parent].get(path.name)
        if hint is not None:
            found[str(p)] = hint
    return found


@dataclass(frozen=True, slots=True)
class Clocks:
    """Which files stay on the shared timeline, and why the others do not."""

    together: tuple[str, ...]
    apart: Mapping[str, str]
    #: Relative files placed on the wall clock by a hint: add ``start_us`` to their ``ts``.
    placed: Mapping[str, ClockHint] = field(default_factory=dict)


def split_clocks(
    starts: Mapping[str, float], hints: Mapping[str, ClockHint] | None = None
) -> Clocks:
    """Split files (path → first event on its own base, µs) by clock. A relative file with a
    hint (by the same path, see :func:`hints_for`) is placed on the wall clock. With at least
    one file on the wall clock, the other relative files and files a day or more from the
    median start are apart; with none, every file is relative and they stay together (one
    clock of their own)."""
    hints = hints or {}
    placed = {
        n: h for n, t in starts.items() if t < EPOCH_FLOOR_US and (h := hints.get(n)) is not None
    }
    starts = {n: t + placed[n].start_us if n in placed else t for n, t in starts.items()}
    wall = {n: t for n, t in starts.items() if t >= EPOCH_FLOOR_US}
    if not wall:
        return Clocks(tuple(starts), {})
    ordered = sorted(wall.values())
    median = ordered[len(ordered) // 2]
    apart: dict[str, str] = {}
    for name, t in starts.items():
        if t < EPOCH_FLOOR_US:
            apart[name] = (
                "its events are not on the wall clock (no baseTimeNanoseconds, ts from 0) and "
                "profd has no record of when it started: not aligned with the other traces; "
                "open it on its own"
            )
        elif abs(t - median) > FAR_APART_US:
            days = abs(t - median) / 86_400e6
            apart[name] = f"recorded {days:.0f} day(s) away from the other traces: not aligned"
    placed = {n: h for n, h in placed.items() if n not in apart}
    return Clocks(tuple(n for n in starts if n not in apart), apart, placed)
