"""The coordinator's rolling windows of step and stage times (pure logic, no Ray)."""

from __future__ import annotations

import math

from profd.actors.mark_stats import (
    MAX_LABELS,
    METRICS_MAX_RANKS,
    METRICS_MAX_STAGES,
    WINDOW,
    MarkStats,
    RollingWindow,
)
from profd.core.protocol import LabelDurations, MarkDurations


def step(*seconds: float, lost: int = 0) -> MarkDurations:
    return MarkDurations(step=LabelDurations("step", seconds, lost=lost))


def stages(**by_label: tuple[float, ...]) -> MarkDurations:
    return MarkDurations(step=None, stages=tuple(LabelDurations(k, v) for k, v in by_label.items()))


def test_a_window_keeps_the_last_durations_with_their_median_and_counts() -> None:
    w = RollingWindow()
    w.add(LabelDurations("step", tuple(float(i) for i in range(WINDOW + 44)), lost=3))
    w.add(LabelDurations("step", (math.nan, -1.0, math.inf, 5.0)))
    assert len(w.values) == WINDOW and w.values[-1] == 5.0 and w.values[0] == 45.0
    assert w.last == 5.0 and w.lost == 3
    assert w.count == WINDOW + 45 and w.total == sum(range(WINDOW + 44)) + 5.0
    assert w.median == 171.5  # of 5 and 45..299: (171 + 172) / 2
    view = w.view()
    assert view.samples == WINDOW and view.count == WINDOW + 45 and view.last_s == 5.0
    assert len(view.recent_s) == 16 and view.recent_s[-1] == 5.0


def test_views_hold_an_agents_step_and_stages_until_it_is_dropped() -> None:
    ms = MarkStats()
    ms.add("a", step(0.5, 0.7, 0.6))
    ms.add("a", stages(load=(0.2, 0.4), update=(0.1,)))
    ms.add("b", stages(generate=(0.3,)))
    s, st = ms.views("a")
    assert (s.last_s, s.median_s, s.count, s.samples) == (0.6, 0.6, 3, 3)
    assert sorted(st) == ["load", "update"] and st["load"].median_s == 0.3
    assert ms.views("b")[0] is None and list(ms.views("b")[1]) == ["generate"]
    ms.forget("a")
    assert ms.views("a") == (None, {})
    ms.retain(lambda agent_id: agent_id != "b")
    assert len(ms) == 0


def test_metric_rows_cap_ranks_per_role_and_stage_at_the_slowest() -> None:
    ms = MarkStats()
    n = METRICS_MAX_RANKS + 6
    for rank in range(n):
        ms.add(f"a{rank}", step(0.01 * (rank + 1)))
        ms.add(f"a{rank}", stages(load=(0.001,)))
    ms.add("c0", stages(generate=(0.5,)))
    who = {f"a{r}": ("actor", r) for r in range(n)} | {"c0": ("worker", 0)}
    rows = ms.metric_rows(who.get)
    steps = [r for r in rows["step"] if r[0] == "actor"]
    assert len(steps) == METRICS_MAX_RANKS
    assert [r[1] for r in steps] == list(range(6, n))  # the slowest ranks, by rank
    role, rank, last, median, count, total = steps[-1]
    assert (role, rank, count) == ("actor", n - 1, 1) and last == median == total
    assert len([r for r in rows["stage"] if r[2] == "load"]) == METRICS_MAX_RANKS
    assert ["worker", 0, "generate", 0.5, 0.5, 1, 0.5] in rows["stage"]
    assert ms.metric_rows(lambda agent_id: None) == {"step": [], "stage": []}


def test_an_agent_keeps_at_most_max_labels_stages() -> None:
    ms = MarkStats()
    ms.add("a", stages(**{f"s{i}": (0.1,) for i in range(MAX_LABELS + 3)}))
    assert len(ms.views("a")[1]) == MAX_LABELS


def test_metric_rows_keep_the_stage_labels_most_ranks_report() -> None:
    ms = MarkStats()
    for rank in range(3):  # every rank: "shared"; each rank its own labels besides
        labels = {"shared": (0.1,)} | {f"r{rank}_{i}": (0.1,) for i in range(METRICS_MAX_STAGES)}
        ms.add(f"a{rank}", stages(**labels))
    rows = ms.metric_rows(lambda agent_id: ("actor", int(agent_id[1:])))
    kept = {r[2] for r in rows["stage"]}
    assert len(kept) == METRICS_MAX_STAGES and "shared" in kept
    assert [r[1] for r in rows["stage"] if r[2] == "shared"] == [0, 1, 2]
