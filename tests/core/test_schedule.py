"""Mini-batch schedules (reference §5, §6.2) on real CPU traces, and the overwrite fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from profd.agent import ProfilerAgent
from profd.backends.torch_backend import read_trace
from profd.core.schedule import (
    continuous_schedule,
    discrete_schedule,
    mini_batch_window,
    window_suffix,
)

from helpers import start_agents, user_ranges, wait_armed, wait_terminal

MODEL = torch.nn.Linear(8, 8)


def sched(**kw: int) -> dict[str, int]:
    return {"skip_first": 0, "wait": 0, "warmup": 0, "active": 0, "repeat": 0, **kw}


@pytest.mark.parametrize(
    ("step_num", "schedule", "window"),
    [
        (5, sched(skip_first=1, wait=1, warmup=1, active=2), (3, 4)),
        (9, sched(skip_first=1, wait=1, warmup=1, active=2), (7, 8)),
        (6, sched(skip_first=1, active=1), (5, 5)),
        (8, sched(skip_first=1, wait=1, warmup=1, active=2), (7, 7)),  # cut short
        (0, sched(active=2), (0, 0)),
    ],
)
def test_mini_batch_window_formula(step_num, schedule, window) -> None:
    assert mini_batch_window(step_num, schedule) == window


def test_schedule_resolution_by_mode() -> None:
    assert continuous_schedule(None) is None
    assert continuous_schedule(sched(wait=3)) is None  # active 0: no schedule
    assert continuous_schedule(sched(active=2))["repeat"] == 1  # 0 -> 1 in continuous mode
    assert continuous_schedule(sched(active=2, repeat=3))["repeat"] == 3
    assert discrete_schedule(sched(active=2))["repeat"] == 0  # verbatim: unlimited


def test_window_suffix_never_reuses_a_real_window_name() -> None:
    s = sched(active=2)
    assert window_suffix(2, None, 0, s, True) == "_mb0-1"
    assert window_suffix(4, 2, 1, s, True) == "_mb2-3"
    # torch saves again on stop() with the same step_num: a tail with no mini-batch
    assert window_suffix(4, 4, 2, s, True) == "_part2"
    assert window_suffix(3, None, 0, s, False) == ""  # continuous: first save
    assert window_suffix(5, 3, 1, s, False) == "_part1"
    # warmup 1 / active 1, 3 mini-batches: mb1 is the window; mb2 only warmed up when the
    # loop ended, so the tail torch saves on stop() recorded no mini-batch
    w = sched(warmup=1, active=1)
    assert window_suffix(2, None, 0, w, True) == "_mb1"
    assert window_suffix(3, 2, 1, w, True) == "_part1"


def run_step(agent: ProfilerAgent, step: int, mini_batches: int, log_prob_batches: int = 0) -> None:
    with agent.step(step):
        with agent.stage("compute_log_prob"), torch.no_grad():
            MODEL(torch.randn(4, 8))
            for i in range(log_prob_batches):  # marked, but outside the update loop
                with agent.mini_batch(10 + i):
                    MODEL(torch.randn(4, 8))
        with agent.stage("update", role="actor", update_loop=True):
            for i in range(mini_batches):
                with agent.mini_batch(i):
                    MODEL(torch.randn(4, 8)).sum().backward()
        with agent.stage("compute_values"), torch.no_grad():
            MODEL(torch.randn(4, 8))


def record(owner, request: dict, steps: range, mini_batches: int, log_prob_batches: int = 0):
    (agent,) = start_agents(owner)
    run_step(agent, 0, mini_batches)
    view = owner.call("create_session", request)
    wait_armed(agent, view.session_id)
    for s in steps:
        run_step(agent, s, mini_batches, log_prob_batches)
    view = wait_terminal(owner, view.session_id)
    agent.close()
    return view


def torch_block(discrete: bool, **schedule: int) -> dict:
    return {
        "actor": {
            "discrete": discrete,
            "tool_config": {"torch": {"schedule": sched(**schedule)}},
        }
    }


def test_discrete_schedule_names_windows_by_mini_batch(local_coordinator) -> None:
    view = record(
        local_coordinator,
        {"steps": [1], "roles": torch_block(True, skip_first=1, wait=1, warmup=1, active=2)},
        range(1, 3),
        mini_batches=8,
    )
    assert view.state.value == "done", view.reason
    update = sorted(t.file_name for t in view.traces if t.scope == "actor_update")
    assert [n.split("_")[-1] for n in update] == ["mb3-4.json.gz", "mb7.json.gz"]
    by_suffix = {n.split("_")[-1]: n for n in update}
    path = {t.file_name: t.path for t in view.traces}
    first = user_ranges(read_trace(path[by_suffix["mb3-4.json.gz"]]))
    assert "mini_batch3" in first and "mini_batch4" in first and "mini_batch2" not in first
    tail = user_ranges(read_trace(path[by_suffix["mb7.json.gz"]]))
    assert "mini_batch7" in tail  # the window the loop cut short is flushed, not lost
    # Stages without update_loop record in full, one file each, no schedule suffix.
    others = sorted(t.scope for t in view.traces if t.scope != "actor_update")
    assert others == ["compute_log_prob", "compute_values"]


def test_tail_window_never_overwrites_the_last_real_window(local_coordinator) -> None:
    """Reference §13 item 1: active 2, repeat 0, 4 mini-batches wrote `_mb2-3` twice."""
    view = record(
        local_coordinator,
        {"steps": [1], "roles": torch_block(True, active=2)},
        range(1, 3),
        mini_batches=4,
    )
    assert view.state.value == "done", view.reason
    update = {t.file_name.rsplit("_", 1)[-1]: t for t in view.traces if t.scope == "actor_update"}
    assert sorted(update) == ["mb0-1.json.gz", "mb2-3.json.gz", "part2.json.gz"]
    real = user_ranges(read_trace(update["mb2-3.json.gz"].path))
    assert "mini_batch2" in real and "mini_batch3" in real
    tail = user_ranges(read_trace(update["part2.json.gz"].path))
    assert not any(n.startswith("mini_batch") for n in tail)
    assert len({t.path for t in view.traces}) == len(view.traces)  # nothing overwritten


def test_tail_that_only_warmed_up_is_not_named_as_a_mini_batch(local_coordinator) -> None:
    view = record(
        local_coordinator,
        {"steps": [1], "roles": torch_block(True, warmup=1, active=1)},
        range(1, 3),
        mini_batches=3,
    )
    assert view.state.value == "done", view.reason
    update = {t.file_name.rsplit("_", 1)[-1]: t for t in view.traces if t.scope == "actor_update"}
    assert "mb1.json.gz" in update and "mb2.json.gz" not in update
    assert "mini_batch1" in user_ranges(read_trace(update["mb1.json.gz"].path))
    for suffix, t in update.items():
        if suffix.startswith("part"):
            names = user_ranges(read_trace(t.path))
            assert not any(n.startswith("mini_batch") for n in names)


def test_continuous_schedule_keeps_stages_and_first_active_mini_batches(local_coordinator) -> None:
    view = record(
        local_coordinator,
        {"steps": [1], "roles": torch_block(False, active=1)},
        range(1, 3),
        mini_batches=3,
    )
    assert view.state.value == "done", view.reason
    (trace,) = view.traces
    names = user_ranges(read_trace(trace.path))
    assert "compute_log_prob" in names and "mini_batch0" in names
    assert "mini_batch1" not in names  # repeat 0 -> 1: one window, one active mini-batch
    assert trace.scope == "train" and "_mb" not in trace.file_name


def test_only_update_mini_batches_advance_the_schedule(local_coordinator) -> None:
    """Mini-batches marked in a log-prob stage are ranges, never schedule steps: with active 1
    the window still holds the update loop's first mini-batch."""
    view = record(
        local_coordinator,
        {"steps": [1], "roles": torch_block(False, active=1)},
        range(1, 3),
        mini_batches=3,
        log_prob_batches=3,
    )
    assert view.state.value == "done", view.reason
    (trace,) = view.traces
    names = user_ranges(read_trace(trace.path))
    assert {"mini_batch10", "mini_batch11", "mini_batch12"} <= set(names)
    assert "actor_update" in names and "mini_batch0" in names
    assert "mini_batch1" not in names


def test_continuous_skip_drops_what_came_before_the_window(local_coordinator) -> None:
    view = record(
        local_coordinator,
        {"steps": [1], "roles": torch_block(False, skip_first=1, active=1)},
        range(1, 3),
        mini_batches=3,
    )
    (trace,) = view.traces
    names = user_ranges(read_trace(trace.path))
    assert "mini_batch1" in names
    assert "compute_log_prob" not in names and "mini_batch0" not in names


def test_schedule_in_a_step_group_spans_the_group(local_coordinator) -> None:
    view = record(
        local_coordinator,
        {
            "steps": [1, 2],
            "profile_continuous_steps": True,
            "roles": torch_block(False, active=3),
        },
        range(1, 4),
        mini_batches=2,
    )
    assert view.state.value == "done", view.reason
    (trace,) = view.traces
    names = user_ranges(read_trace(trace.path))
    # three active mini-batches counted across the group: both of step 1, the first of step 2
    assert names.count("mini_batch0") == 2 and names.count("mini_batch1") == 1
    assert view.targets[0].recorded_steps == [1, 2]


def test_schedule_that_saves_nothing_is_reported_missed(local_coordinator) -> None:
    view = record(
        local_coordinator,
        {"steps": [1], "roles": torch_block(False, skip_first=10, active=1)},
        range(1, 3),
        mini_batches=2,
    )
    assert view.state.value == "failed"
    assert view.traces == []
    assert "schedule saved no window" in view.targets[0].reason
    assert not any(Path(view.save_dir).glob("*.json.gz"))
