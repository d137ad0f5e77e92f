"""Live step and stage times: a rolling window per agent and mark (pure logic, no Ray).

Agents send what their marks measured about once a second (``times`` events carrying
:class:`~profd.core.protocol.MarkDurations`). :class:`MarkStats` keeps, per agent (one role
and rank) and per mark — the step, or a stage label — the last :data:`WINDOW` durations: the
last value, the rolling median, and counts since the agent was first heard. Agents that are
gone or closed are dropped (:meth:`MarkStats.forget`, :meth:`MarkStats.retain`).

Stage samples an agent placed in a step (``LabelDurations.spans``) are folded per step as the
summary folds a trace's ranges: the first start, the last end and the summed wall time of
the stage in that step, for the newest :data:`WINDOW` steps (:meth:`MarkStats.spans`:
straggler triggers compare one step's ends across ranks).

For Prometheus the windows become one series per (role, rank, stage). Cardinality is bounded:
each role exports at most :data:`METRICS_MAX_STAGES` stage labels (those most of its ranks
report) besides the step, and each (role, stage) at most :data:`METRICS_MAX_RANKS` ranks —
when more ranks report, the slowest by rolling median (the ones worth looking at);
``GET /api/v1/agents`` still has every rank and label.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from profd.core.protocol import LabelDurations, MarkDurations
from profd.core.views import TimingView

__all__ = [
    "MAX_LABELS",
    "METRICS_MAX_RANKS",
    "METRICS_MAX_STAGES",
    "RECENT",
    "WINDOW",
    "MarkStats",
    "RollingWindow",
    "StepSpan",
    "placed",
]

#: Durations kept per agent and mark for the rolling median.
WINDOW = 256
#: Newest durations shown per mark in ``GET /api/v1/agents`` (the dashboard's chart).
RECENT = 16
#: Stage labels kept per agent (agents time at most 32; a label beyond is dropped here).
MAX_LABELS = 64
#: An agent's newest steps as the coordinator saw them begin (one a report at most, about a
#: second apart), for the pace of its loop (:meth:`MarkStats.step_period`).
PACE_SAMPLES = 16
#: Rank series per (role, stage) in ``/metrics``: the slowest by rolling median.
METRICS_MAX_RANKS = 64
#: Stage labels per role in ``/metrics`` (agents time 32 each; ranks that all name theirs
#: differently would add up): the ones most ranks report.
METRICS_MAX_STAGES = 32


class StepSpan:
    """One stage in one step on one agent: first start, last end (coordinator wall clock,
    seconds), summed wall time and calls."""

    __slots__ = ("calls", "end", "start", "wall")

    def __init__(self, start: float, end: float) -> None:
        self.start = start
        self.end = end
        self.wall = end - start
        self.calls = 1

    def add(self, start: float, end: float) -> None:
        self.start = min(self.start, start)
        self.end = max(self.end, end)
        self.wall += end - start
        self.calls += 1


class RollingWindow:
    """The last ``size`` durations of one mark on one agent, and counts since the first."""

    __slots__ = ("_median", "count", "last", "lost", "size", "spans", "total", "values")

    def __init__(self, size: int = WINDOW) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.last: float | None = None
        self.count = 0  # durations received
        self.total = 0.0  # their sum, in seconds
        self.lost = 0  # durations the agent could not send (its ring overwrote them)
        self._median: float | None = None
        self.size = size
        #: step -> the stage in that step (newest ``size`` steps; stages only)
        self.spans: dict[int, StepSpan] = {}

    def add(self, d: LabelDurations) -> None:
        """Add one report's durations (non-finite or negative ones are skipped)."""
        self.lost += max(0, int(d.lost))
        self._add_spans(d.spans)
        kept = [float(x) for x in d.seconds if math.isfinite(x) and x >= 0]
        if not kept:
            return
        self.values.extend(kept)
        self.count += len(kept)
        self.total += sum(kept)
        self.last = kept[-1]
        self._median = None

    def _add_spans(self, spans: Any) -> None:
        for item in spans or ():
            try:
                step, start, end = item
                start, end = float(start), float(end)
            except (TypeError, ValueError):
                continue
            if (
                isinstance(step, bool) or not isinstance(step, int)
                or not (math.isfinite(start) and math.isfinite(end)) or end < start
            ):  # fmt: skip
                continue
            span = self.spans.get(step)
            if span is None:
                self.spans[step] = StepSpan(start, end)
                if len(self.spans) > self.size:  # the oldest step goes
                    del self.spans[min(self.spans)]
            else:
                span.add(start, end)

    @property
    def median(self) -> float | None:
        """Median of the window (computed once per change)."""
        if self._median is None and self.values:
            self._median = statistics.median(self.values)
        return self._median

    def view(self) -> TimingView:
        return TimingView(
            last_s=_us(self.last or 0.0),
            median_s=_us(self.median or 0.0),
            samples=len(self.values),
            count=self.count,
            lost=self.lost,
            recent_s=[_us(v) for v in list(self.values)[-RECENT:]],
        )


def _capped_stages(groups: dict[tuple[str, str | None], list[Any]]) -> dict[Any, list[Any]]:
    """At most :data:`METRICS_MAX_STAGES` stage labels per role: those most ranks report."""
    by_role: dict[str, list[tuple[int, str]]] = {}
    for (role, stage), ranks in groups.items():
        if stage is not None:
            by_role.setdefault(role, []).append((-len(ranks), stage))
    dropped = set()
    for role, stages in by_role.items():
        if len(stages) > METRICS_MAX_STAGES:
            dropped.update((role, stage) for _, stage in sorted(stages)[METRICS_MAX_STAGES:])
    return {k: v for k, v in groups.items() if k not in dropped}


def _group_order(kv: tuple[tuple[str, str | None], Any]) -> tuple[str, str]:
    (role, stage), _ = kv
    return role, stage or ""


def _us(seconds: float) -> float:
    """Seconds to the microsecond: what a clock read per mark can tell apart, in JSON."""
    return round(seconds, 6)


@dataclass
class _AgentTimes:
    step: RollingWindow | None = None
    stages: dict[str, RollingWindow] = field(default_factory=dict)
    dropped_labels: int = 0
    #: (coordinator time, step) when a report first showed each of its newest steps
    pace: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=PACE_SAMPLES))

    def note_step(self, step: int, at: float) -> None:
        if self.pace and step < self.pace[-1][1]:
            self.pace.clear()  # the job started over (a restart): a new pace
        if not self.pace or step > self.pace[-1][1]:
            self.pace.append((at, step))

    def period(self) -> float | None:
        """Median seconds per step between the reports that showed new steps (two gaps at
        least: one could be a pause)."""
        rates = [
            (t1 - t0) / (s1 - s0)
            for (t0, s0), (t1, s1) in zip(self.pace, list(self.pace)[1:], strict=False)
            if t1 > t0
        ]
        return statistics.median(rates) if len(rates) >= 2 else None


def placed(times: MarkDurations, step_at: Callable[[float], int | None]) -> MarkDurations:
    """``times`` with its unplaced stage spans (step ``None``: a worker following its
    driver) placed by ``step_at`` (the driver's step that began last before the sample
    did); those it cannot place are left out. ``times`` itself when none is unplaced."""
    if not any(sp[0] is None for d in times.stages for sp in d.spans):
        return times
    stages = []
    for d in times.stages:
        if any(sp[0] is None for sp in d.spans):
            spans = []
            for step, start, end in d.spans:
                step = step_at(start) if step is None else step
                if step is not None:
                    spans.append((step, start, end))
            d = replace(d, spans=tuple(spans))
        stages.append(d)
    return replace(times, stages=tuple(stages))


class MarkStats:
    """Rolling windows of every agent's step and stage times (owned by the coordinator)."""

    def __init__(self, window: int = WINDOW) -> None:
        self._window = window
        self._agents: dict[str, _AgentTimes] = {}

    def __len__(self) -> int:
        return len(self._agents)

    def add(
        self, agent_id: str, times: MarkDurations, step: int | None = None, at: float | None = None
    ) -> None:
        """One ``times`` event of ``agent_id``; ``step``: its current step then, seen at
        ``at`` (the coordinator's clock)."""
        a = self._agents.get(agent_id)
        if a is None:
            a = self._agents[agent_id] = _AgentTimes()
        if step is not None and at is not None:
            a.note_step(step, at)
        if times.step is not None:
            if a.step is None:
                a.step = RollingWindow(self._window)
            a.step.add(times.step)
        for d in times.stages:
            w = a.stages.get(d.label)
            if w is None:
                if len(a.stages) >= MAX_LABELS:
                    a.dropped_labels += 1
                    continue
                w = a.stages[d.label] = RollingWindow(self._window)
            w.add(d)

    def forget(self, agent_id: str) -> None:
        """The agent closed (or is gone): its windows go."""
        self._agents.pop(agent_id, None)

    def retain(self, keep: Callable[[str], bool]) -> None:
        """Drop the windows of every agent ``keep`` refuses (lost, closed, forgotten)."""
        for agent_id in [a for a in self._agents if not keep(a)]:
            del self._agents[agent_id]

    def step_median(self, agent_id: str) -> float | None:
        """The agent's rolling median step time, when it marks steps."""
        a = self._agents.get(agent_id)
        return None if a is None or a.step is None else a.step.median

    def step_period(self, agent_id: str) -> float | None:
        """Seconds from one of the agent's steps to the next: the pace its reports show,
        when it is slower than the step mark's own median (a loop that does more between
        its steps than inside them, or sleeps), else that median; None before either."""
        a = self._agents.get(agent_id)
        if a is None:
            return None
        median = a.step.median if a.step is not None else None
        pace = a.period()
        if pace is None:
            return median
        return max(pace, median or 0.0)

    def step_age(self, agent_id: str, now: float) -> float | None:
        """Seconds since the agent's reports first showed the step it is at (how long its
        loop has stood there, to a report's interval); None before any."""
        a = self._agents.get(agent_id)
        if a is None or not a.pace:
            return None
        return max(0.0, now - a.pace[-1][0])

    def recent(self, agent_id: str, mark: str | None, n: int) -> list[float]:
        """The newest ``n`` durations of one agent's step (``mark`` None) or stage."""
        a = self._agents.get(agent_id)
        w = None if a is None else (a.step if mark is None else a.stages.get(mark))
        if w is None:
            return []
        values = w.values
        return list(values)[-n:] if n < len(values) else list(values)

    def window(self, agent_id: str, mark: str | None) -> Sequence[float]:
        """One agent's step (``mark`` None) or stage durations, newest last, read only: the
        window itself, not a copy (empty when there is none)."""
        a = self._agents.get(agent_id)
        w = None if a is None else (a.step if mark is None else a.stages.get(mark))
        return () if w is None else w.values

    def marks(self, agent_id: str) -> tuple[bool, list[str]]:
        """Whether the agent has timed its step, and the stages it has timed."""
        a = self._agents.get(agent_id)
        if a is None:
            return False, []
        return bool(a.step is not None and a.step.count), [
            k for k, w in a.stages.items() if w.count
        ]

    def times_stage(self, agent_id: str, stage: str) -> bool:
        """Whether the agent has timed ``stage`` at all (its spans may not have come yet)."""
        a = self._agents.get(agent_id)
        w = None if a is None else a.stages.get(stage)
        return w is not None and w.count > 0

    def spans(self, agent_id: str, stage: str) -> dict[int, StepSpan]:
        """One agent's stage ``stage`` per step (newest :data:`WINDOW` steps); read only."""
        a = self._agents.get(agent_id)
        w = None if a is None else a.stages.get(stage)
        return {} if w is None else w.spans

    def views(self, agent_id: str) -> tuple[TimingView | None, dict[str, TimingView]]:
        """(step, stages by label) of one agent, for its ``AgentView``."""
        a = self._agents.get(agent_id)
        if a is None:
            return None, {}
        step = a.step.view() if a.step is not None and a.step.count else None
        stages = {k: w.view() for k, w in sorted(a.stages.items()) if w.count}
        return step, stages

    def metric_rows(
        self, who: Callable[[str], tuple[str, int] | None]
    ) -> dict[str, list[list[Any]]]:
        """Rows for ``/metrics``: ``step`` rows ``[role, rank, last, median, count, sum]``
        and ``stage`` rows ``[role, rank, stage, last, median, count, sum]``, at most
        :data:`METRICS_MAX_RANKS` ranks per (role, stage). ``who``: an agent's (role, rank),
        ``None`` to leave it out."""
        groups: dict[tuple[str, str | None], list[tuple[int, RollingWindow]]] = {}
        for agent_id, a in self._agents.items():
            ident = who(agent_id)
            if ident is None:
                continue
            role, rank = ident
            pairs: Iterable[tuple[str | None, RollingWindow | None]] = [
                (None, a.step),
                *a.stages.items(),
            ]
            for stage, w in pairs:
                if w is not None and w.count:
                    groups.setdefault((role, stage), []).append((rank, w))
        groups = _capped_stages(groups)
        out: dict[str, list[list[Any]]] = {"step": [], "stage": []}
        for (role, stage), ranks in sorted(groups.items(), key=_group_order):
            if len(ranks) > METRICS_MAX_RANKS:
                ranks = sorted(ranks, key=lambda rw: -(rw[1].median or 0.0))[:METRICS_MAX_RANKS]
            for rank, w in sorted(ranks, key=lambda rw: rw[0]):
                values = [w.last, w.median, w.count, w.total]
                if stage is None:
                    out["step"].append([role, rank, *values])
                else:
                    out["stage"].append([role, rank, stage, *values])
        return out
