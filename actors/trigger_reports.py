"""What a trigger pass reads: the agents' ``times`` reports it judges, and the role-wide views
(history, spans) it reads once per pass.

Pure logic (no Ray). A pass holds a fleet's reports for up to
:data:`~profd.actors.triggers.OBSERVE_COALESCE_S` (and then through its own work): the
reports themselves (dataclasses, nested tuples) held that long reach the collector's oldest
generation and make it run, about once a second at 10,000 ranks, for 0.1-0.2 s each time.
So a pass holds each report as one flat tuple of numbers and names (:func:`report`), which
the collector stops tracking at its first look (it untracks nested tuples one level per
collection, and never a tuple subclass).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from profd.core.protocol import MarkDurations

__all__ = [
    "AGENT",
    "RANK",
    "ROLE",
    "STAGES",
    "STEP",
    "STEP_NEW",
    "History",
    "Report",
    "RoleSpans",
    "Spans",
    "has_durations",
    "report",
    "span_steps",
    "stages",
]

#: One ``times`` report as a pass holds it, flat: ``(agent_id, role, rank, step, has step
#: durations, *stages)``, each stage ``label, has durations, n, step_1 .. step_n`` (the steps
#: its spans were placed in). ``step``: the step the agent marked last when it sent it.
Report = tuple[Any, ...]
AGENT, ROLE, RANK, STEP, STEP_NEW, STAGES = range(6)


def report(
    agent_id: str, role: str, rank: int, times: MarkDurations, step: int | None = None
) -> Report:
    out: list[Any] = [agent_id, role, rank, step]
    out.append(times.step is not None and bool(times.step.seconds))
    for d in times.stages:
        out += (d.label, bool(d.seconds), len(d.spans), *(s[0] for s in d.spans))
    return tuple(out)


def stages(r: Report) -> Iterator[tuple[str, bool, Sequence[int]]]:
    """Each stage of ``r``: ``(label, has durations, the steps of its spans)``."""
    i = STAGES
    while i < len(r):
        n = r[i + 2]
        yield r[i], r[i + 1], r[i + 3 : i + 3 + n]
        i += 3 + n


def has_durations(r: Report, mark: str | None) -> bool:
    """Whether the step (``mark`` None) or stage ``mark`` has new durations in ``r``."""
    if mark is None:
        return bool(r[STEP_NEW])
    return any(label == mark and new for label, new, _ in stages(r))


def span_steps(r: Report, stage: str) -> Iterator[int]:
    """The steps that spans of ``stage`` in ``r`` were placed in."""
    for label, _, steps in stages(r):
        if label == stage:
            yield from steps


#: (role, mark, n) -> each rank's durations, newest last (its newest n are the tail), per
#: rank of the role that reports it; read only.
History = Callable[[str, str | None, int], dict[int, Sequence[float]]]


@dataclass(frozen=True, slots=True)
class RoleSpans:
    """A role's alive ranks that report a stage: each rank's agent, and its stage per step
    (``start``, ``end``, ``wall`` in seconds; see ``profd.actors.mark_stats.StepSpan``).
    Two maps, not a pair per rank: a pass over a fleet reads it once."""

    agents: dict[int, str]
    steps: dict[int, dict[int, Any]]


#: (role, stage) -> the role's spans of that stage.
Spans = Callable[[str, str], RoleSpans]
