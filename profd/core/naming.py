"""Trace file names: verl's stem grammar (reference §6.1), in one place.

::

    stem   := [PREFIX "_"] [SCOPE "_"] ["step" STEP "_"] "rank" R ["-of-" W] ["_" PAR]
              "_pid" PID "_" TS
    file   := stem SUFFIX ".json.gz"
    PAR    := "-"-join of tp<k>, pp<k>, dp<k>, cp<k> (in that order, each only when present)
    SUFFIX := "" | "_mb" A | "_mb" A "-" B | "_part" N

Who relies on what: Perfetto / chrome://tracing only need the ``.json.gz`` extension; people
and ``profd merge`` / ``profd summarize`` read role, step and rank from the stem; HTA reads the
rank from ``distributedInfo`` *inside* the trace, which the agent writes as well, so nothing
downstream has to guess from the name.

No Ray or torch import; pure functions.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

__all__ = [
    "CONTINUOUS_SCOPE",
    "PAR_KEYS",
    "TIMED_SCOPE",
    "StemParts",
    "format_timestamp",
    "is_stage_scope",
    "mb_suffix",
    "parse_trace_name",
    "part_suffix",
    "sanitize",
    "trace_id_for",
    "trace_stem",
]

#: Parallel coordinates that appear in a file name, in this order.
PAR_KEYS = ("tp", "pp", "dp", "cp")
TRACE_EXT = ".json.gz"
#: The scope in a trace's name and header of a continuous window and of a timed one; any
#: other scope is a discrete trace's stage.
CONTINUOUS_SCOPE = "train"
TIMED_SCOPE = "window"


def is_stage_scope(scope: object) -> bool:
    """Whether a trace's ``scope`` names a discrete trace's stage (not a window's own)."""
    return isinstance(scope, str) and bool(scope) and scope not in (CONTINUOUS_SCOPE, TIMED_SCOPE)


_UNSAFE = re.compile(r"[^0-9A-Za-z.=+\-]+")


def sanitize(value: object) -> str:
    """Replace every run of characters outside ``[0-9A-Za-z.=+-]`` by ``-``; strip ``-``."""
    return _UNSAFE.sub("-", str(value)).strip("-")


def format_timestamp(when: datetime) -> str:
    """17 digits: year, month, day, hour, minute, second, milliseconds (local time)."""
    return when.strftime("%Y%m%d%H%M%S") + f"{when.microsecond // 1000:03d}"


def trace_stem(
    *,
    rank: int,
    pid: int,
    when: datetime,
    prefix: str | None = None,
    scope: str | None = None,
    step: int | str | None = None,
    world_size: int | None = None,
    topology: Mapping[str, int] | None = None,
) -> str:
    """Build a stem. Empty prefix / scope are left out; step 0 is kept (``step0``)."""
    fields: list[str] = []
    if prefix:
        fields.append(sanitize(prefix))
    if scope:
        fields.append(sanitize(scope))
    if step is not None:
        fields.append(f"step{sanitize(step)}")
    rank_field = f"rank{int(rank)}"
    if world_size:
        rank_field += f"-of-{int(world_size)}"
    fields.append(rank_field)
    topo = topology or {}
    par = "-".join(f"{k}{int(topo[k])}" for k in PAR_KEYS if k in topo)
    if par:
        fields.append(par)
    fields.append(f"pid{int(pid)}")
    fields.append(format_timestamp(when))
    return "_".join(fields)


def mb_suffix(first: int, last: int) -> str:
    """Suffix of a discrete, scheduled window covering mini-batches ``first..last``."""
    return f"_mb{first}" if first == last else f"_mb{first}-{last}"


def part_suffix(index: int) -> str:
    """Suffix of the ``index``-th extra save of one collection (the first save has none)."""
    return "" if index <= 0 else f"_part{index}"


@dataclass(frozen=True, slots=True)
class StemParts:
    """What can be read back from a file name. ``head`` holds PREFIX and SCOPE, in order."""

    head: tuple[str, ...]
    step: str | None
    rank: int
    world_size: int | None
    parallel: dict[str, int]
    pid: int
    timestamp: str
    suffix: str


_NAME = re.compile(
    r"^(?P<head>(?:[^_]*_){0,2}?)"
    r"(?:step(?P<step>[0-9A-Za-z.=+\-]*)_)?"
    r"rank(?P<rank>\d+)(?:-of-(?P<world>\d+))?"
    r"(?:_(?P<par>(?:tp|pp|dp|cp)\d+(?:-(?:tp|pp|dp|cp)\d+)*))?"
    r"_pid(?P<pid>\d+)_(?P<ts>\d{17})"
    r"(?P<suffix>_mb\d+(?:-\d+)?|_part\d+)?"
    r"(?:\.json\.gz|\.json)?$"
)


def parse_trace_name(name: str) -> StemParts | None:
    """Read a file name built by :func:`trace_stem`; ``None`` when it does not follow it."""
    m = _NAME.match(name)
    if not m:
        return None
    head = tuple(h for h in m.group("head").split("_") if h)
    par: dict[str, int] = {}
    if m.group("par"):
        for item in m.group("par").split("-"):
            par[item[:2]] = int(item[2:])
    return StemParts(
        head=head,
        step=m.group("step"),
        rank=int(m.group("rank")),
        world_size=int(m.group("world")) if m.group("world") else None,
        parallel=par,
        pid=int(m.group("pid")),
        timestamp=m.group("ts"),
        suffix=m.group("suffix") or "",
    )


def trace_id_for(node: str | None, path: str) -> str:
    """Stable id of a file: the same file always gets the same id, on any process."""
    return hashlib.sha1(f"{node or ''}:{path}".encode()).hexdigest()[:16]
