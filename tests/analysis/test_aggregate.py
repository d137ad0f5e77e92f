"""The fold of a session summary over steps (``profd.analysis.aggregate``), on a summary
built by hand so every number is known."""

from __future__ import annotations

import statistics
import sys
from typing import Any

import pytest

from profd.analysis.aggregate import (
    idle_aggregates,
    middle_ellipsis,
    mini_batch_aggregates,
    percentile,
    short_names,
    stage_aggregates,
    steps_text,
    straggler_aggregates,
)
from profd.analysis.models import (
    IdleGap,
    LateCause,
    MiniBatchTime,
    ProcessingStats,
    SessionSummary,
    StageStat,
    StageTime,
    StepTime,
    Straggler,
    StragglerRule,
    TrackInfo,
)

A0, A1, C0 = "actor rank 0 @h", "actor rank 1 @h", "critic rank 0 @h"
ROLE = {A0: ("actor", 0), A1: ("actor", 1), C0: ("critic", 0)}


def track(label: str) -> TrackInfo:
    role, rank = ROLE[label]
    return TrackInfo(
        track=label, key=f"rank:{role}:{rank}", kind="rank", role=role, rank=rank,
        world_size=None, topology={}, hostname="h", node_id=None, replica=None,
        from_metadata=True, files=1,
    )  # fmt: skip


def stage(step: int | None, name: str, label: str, wall: float) -> StageTime:
    role, rank = ROLE[label]
    return StageTime(
        step=step, stage=name, track=label, role=role, rank=rank,
        start_ms=0.0, end_ms=wall, wall_ms=wall, calls=1,
    )  # fmt: skip


def stat(step: int, name: str, role: str) -> StageStat:
    return StageStat(
        step=step, stage=name, role=role, ranks=2, wall_min_ms=0, wall_median_ms=0,
        wall_max_ms=0, end_spread_ms=0, slowest=A0,
    )  # fmt: skip


def late(step: int, label: str, late_ms: float, cause: LateCause | None = None) -> Straggler:
    role, rank = ROLE[label]
    return Straggler(
        step=step, stage="gen", role=role, rank=rank, track=label, end_ms=0,
        peer_median_end_ms=0, late_ms=late_ms, threshold_ms=5, wall_ms=0,
        peer_median_wall_ms=0, cause=cause,
    )  # fmt: skip


def gap(step: int | None, label: str, ms: float) -> IdleGap:
    return IdleGap(step=step, track=label, after="a", before="b", start_ms=0.0, gap_ms=ms)


def mini(step: int, label: str, index: int, wall: float, micro: int) -> MiniBatchTime:
    return MiniBatchTime(
        step=step, stage="upd", track=label, index=index, start_ms=0, wall_ms=wall,
        micro_batches=micro,
    )  # fmt: skip


def summary(**fields: Any) -> SessionSummary:
    base: dict[str, Any] = dict(
        source="hand", session_ids=[], t0_epoch_us=0.0, span_ms=1.0, steps=[1, 2, 3],
        stages=["gen", "upd"], tracks=[track(A0), track(A1), track(C0)], files=[],
        skipped=[], stage_times=[], step_times=[], stage_stats=[], mini_batches=[],
        idle_gaps=[], top_ops=[], stragglers=[], straggler_rule=StragglerRule(),
        processing=ProcessingStats(
            files=0, json_bytes=0, wall_s=0, mode="serial", workers=1, start_method=None,
            worker_memory_mb=None,
        ),
    )  # fmt: skip
    base.update(fields)
    return SessionSummary(**base)


GEN = [
    stage(1, "gen", A0, 10), stage(2, "gen", A0, 40), stage(3, "gen", A0, 30),
    stage(1, "gen", A1, 15), stage(2, "gen", A1, 25), stage(3, "gen", A1, 100),
    stage(1, "gen", C0, 5),
    stage(1, "upd", A0, 7),
]  # fmt: skip


def test_stage_aggregates_fold_steps_and_ranks_per_stage_and_role() -> None:
    rows = stage_aggregates(summary(stage_times=list(reversed(GEN))))
    assert [(a.stage, a.role) for a in rows] == [
        ("gen", "actor"),
        ("gen", "critic"),
        ("upd", "actor"),
    ]  # stage order of the summary, then role order, whatever the input order
    actor = rows[0]
    # walls 10 15 25 30 40 100: median (25+30)/2, p90 at rank 4.5 = 40 + (100-40)/2
    assert (actor.median_ms, actor.p90_ms, actor.max_ms) == (27.5, 70.0, 100.0)
    assert (actor.ranks, actor.steps, actor.samples) == (2, 3, 6)
    # rank 1 holds the largest time (step 3) and is the slowest in steps 1 and 3, not 2
    assert (actor.slowest_rank, actor.slowest_track, actor.slowest_step) == (1, A1, 3)
    assert actor.slowest_in == 2
    critic = rows[1]
    assert (critic.median_ms, critic.p90_ms, critic.max_ms, critic.slowest_in) == (5, 5, 5, 1)
    assert (critic.ranks, critic.steps, critic.slowest_rank) == (1, 1, 0)


def test_stage_aggregates_break_ties_by_track_order() -> None:
    tied = [stage(1, "gen", A1, 9), stage(1, "gen", A0, 9), stage(2, "gen", A0, 9)]
    (row,) = stage_aggregates(summary(stage_times=tied))
    assert (row.slowest_rank, row.slowest_step, row.slowest_in) == (0, 1, 2)


def test_the_fold_has_one_row_per_stage_and_role_however_many_steps() -> None:
    def rows(steps: int) -> int:
        times = [stage(n, "gen", t, n + 1.0) for n in range(steps) for t in (A0, A1, C0)]
        return len(stage_aggregates(summary(stage_times=times)))

    assert rows(2) == rows(50) == 2


def test_idle_aggregates_sum_gaps_per_step_and_rank() -> None:
    steps = [
        StepTime(step=n, track=t, start_ms=0, wall_ms=w, stages_ms=0, idle_ms=0)
        for n, t, w in ((1, A0, 100), (2, A0, 110), (1, A1, 120), (2, A1, 130))
    ]
    gaps = [gap(1, A0, 3), gap(1, A0, 2), gap(1, A1, 6), gap(1, A1, 4), gap(2, A1, 1)]
    gaps.append(gap(None, C0, 7))
    actor, critic = idle_aggregates(summary(step_times=steps, idle_gaps=gaps))
    # per (step, rank): A0 5 and 0 (step 2 had no gap), A1 10 and 1
    assert actor.role == "actor" and (actor.ranks, actor.steps) == (2, 2)
    assert (actor.per_step_median_ms, actor.per_step_max_ms, actor.total_ms) == (3.0, 10, 16)
    assert actor.step_median_ms == 115.0
    assert actor.largest == gaps[2]
    assert critic.role == "critic" and critic.step_median_ms is None
    assert (critic.per_step_median_ms, critic.total_ms, critic.largest) == (7, 7, gaps[-1])
    assert idle_aggregates(summary()) == []


def test_straggler_aggregates_count_late_steps_per_rank() -> None:
    stats = [stat(n, "gen", "actor") for n in (1, 2, 3)]
    lates = [late(1, A1, 20), late(2, A0, 30), late(3, A1, 8)]
    rows = straggler_aggregates(summary(stage_stats=stats, stragglers=lates))
    assert [(a.rank, a.late_steps, a.steps) for a in rows] == [(1, 2, 3), (0, 1, 3)]
    r1 = rows[0]
    assert (r1.max_late_ms, r1.median_late_ms, r1.worst_step, r1.track) == (20, 14, 1, A1)
    assert r1.long_steps is None  # a summary saved before causes: not counted, not guessed


def test_straggler_aggregates_count_the_steps_a_rank_ran_long() -> None:
    stats = [stat(n, "gen", "actor") for n in (1, 2, 3)]
    lates = [late(1, A1, 20, LateCause.LONG_DURATION), late(2, A1, 9, LateCause.LATE_START)]
    lates.append(late(3, A1, 8, LateCause.BOTH))
    (row,) = straggler_aggregates(summary(stage_stats=stats, stragglers=lates))
    assert (row.late_steps, row.long_steps) == (3, 2)  # the late start alone is not "long"


def test_mini_batch_aggregates_per_stage_role_and_index() -> None:
    minis = [mini(1, A0, 0, 2, 2), mini(1, A1, 0, 4, 3), mini(2, A0, 0, 9, 2)]
    minis += [mini(1, A0, 1, 5, 1), mini(1, C0, 0, 6, 0)]
    rows = mini_batch_aggregates(summary(mini_batches=minis))
    assert [(a.role, a.index, a.samples) for a in rows] == [
        ("actor", 0, 3),
        ("actor", 1, 1),
        ("critic", 0, 1),
    ]
    assert (rows[0].median_ms, rows[0].max_ms, rows[0].micro_batches) == (4, 9, 3)


@pytest.mark.parametrize("n", [2, 3, 7, 10])
def test_percentile_matches_the_inclusive_quantiles(n: int) -> None:
    xs = [float(x * x) for x in range(n)]
    deciles = statistics.quantiles(xs, n=10, method="inclusive")
    assert percentile(xs, 0.9) == pytest.approx(deciles[8])
    assert percentile(xs, 0.5) == pytest.approx(statistics.median(xs))
    assert (percentile(xs, 0), percentile(xs, 1)) == (min(xs), max(xs))
    assert percentile([4.0], 0.9) == 4.0
    with pytest.raises(ValueError):
        percentile([], 0.5)


def test_middle_ellipsis_and_short_names() -> None:
    assert middle_ellipsis("compute_log_prob", 16) == "compute_log_prob"
    assert middle_ellipsis("generate_sequences", 9) == "gene…nces"
    assert middle_ellipsis("abc", 1) == "…"
    names = short_names(["update_actor", "stage_one_is_long", "stage_two_is_long"], 12)
    assert names["update_actor"] == "update_actor"
    assert names["stage_one_is_long"] != names["stage_two_is_long"]
    assert all(len(v) <= 12 for v in names.values())
    twins = short_names(["abc_x_def", "abc_y_def", "ok"], 7)
    assert twins == {"abc_x_def": "ab…ef~1", "abc_y_def": "ab…ef~2", "ok": "ok"}


def test_steps_text_stays_short() -> None:
    assert steps_text([]) == "-"
    assert steps_text([4]) == "4"
    assert steps_text(list(range(1, 1001))) == "1-1000 (1000)"
    assert steps_text([9, 1, 5]) == "1..9 (3)"


def test_the_module_imports_neither_ray_nor_torch() -> None:
    import subprocess

    code = (
        "import sys, profd.analysis.aggregate; print('ray' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
