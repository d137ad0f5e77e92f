"""Where a trace without a wall clock of its own started: profd's record of its window.

A trace whose header has no ``baseTimeNanoseconds`` and whose ``ts`` count from 0 (a tool that
writes relative time) cannot be placed on the session's timeline by itself. When profd brought
such a file into the session directory — a rollout engine's trace, relocated after its window —
it knows when the engine was told to start: the wall-clock times just before and just after the
start call (recorded only for windows that start recording with the call: a token window's
delay starts it later, at a moment profd does not see). That record is kept beside the traces
in a hidden JSON-lines file, one line per file, so the analysis can place the file's ``ts`` 0
at the start call (uncertain by half the call's duration) instead of leaving it off the
timeline.

The file is hidden (``.``-prefixed), so it is never taken for a trace, never uploaded and never
served. Lines are appended with one ``write`` each (``O_APPEND``), so replicas that share a
session directory on a local disk do not interleave; on NFS appends are not atomic, and a line
torn there is logged and left out (that file then stays off the timeline, with its reason).
Pure stdlib; no Ray, no torch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import orjson

__all__ = ["WINDOWS_FILE", "ClockHint", "read_clock_hints", "record_window_files"]

log = logging.getLogger(__name__)

WINDOWS_FILE = ".profd-windows.jsonl"


@dataclass(frozen=True, slots=True)
class ClockHint:
    """A file's ``ts`` 0 on the wall clock (µs since the epoch), give or take ``uncertainty_us``."""

    start_us: float
    uncertainty_us: float
    source: str
    #: The job's steps the window was for (a rollout engine's trace has no step marks of
    #: its own); empty when not recorded.
    steps: tuple[int, ...] = ()


def record_window_files(
    directory: Path | str,
    names: Iterable[str],
    before_s: float,
    after_s: float,
    source: str,
    steps: Iterable[int] = (),
) -> None:
    """Append one line per file of ``names`` (inside ``directory``): its engine was told to
    start between wall-clock ``before_s`` and ``after_s`` (seconds since the epoch), for the
    job's ``steps`` (when known)."""
    if after_s < before_s:
        raise ValueError(f"after_s: must be >= before_s ({before_s}), got {after_s}")
    steps = [int(n) for n in steps]
    lines = b"".join(
        orjson.dumps(
            {
                "file": name,
                "start_before_s": before_s,
                "start_after_s": after_s,
                "source": source,
                **({"steps": steps} if steps else {}),
            }
        )
        + b"\n"
        for name in names
    )
    if not lines:
        return
    fd = os.open(Path(directory) / WINDOWS_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, lines)
    finally:
        os.close(fd)


def read_clock_hints(directory: Path | str) -> dict[str, ClockHint]:
    """File name → its hint, from ``directory``'s record (empty without one). A line that
    cannot be read is logged and left out; the file it names then stays off the timeline,
    with the analysis's own reason."""
    path = Path(directory) / WINDOWS_FILE
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except OSError as exc:
        log.warning("cannot read %s: %s", path, exc)
        return {}
    hints: dict[str, ClockHint] = {}
    bad = 0
    for line in raw.splitlines():
        if not line.strip():
            continue
        try:
            rec = orjson.loads(line)
            before, after = float(rec["start_before_s"]), float(rec["start_after_s"])
            name, source = str(rec["file"]), str(rec.get("source") or "profd window start")
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            bad += 1
            continue
        if after < before:
            bad += 1
            continue
        steps = rec.get("steps")
        ok = isinstance(steps, list) and all(type(n) is int for n in steps)
        hints[name] = ClockHint(
            (before + after) / 2 * 1e6,
            (after - before) / 2 * 1e6,
            source,
            tuple(steps) if ok else (),
        )
    if bad:
        log.warning("%s: %d line(s) could not be read and were left out", path, bad)
    return hints
