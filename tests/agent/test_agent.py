"""The agent against an in-process coordinator, recording real torch.profiler traces."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from profd.agent import ProfilerAgent
from profd.backends import NULL_RANGE
from profd.backends.torch_backend import read_trace
from profd.core.naming import parse_trace_name

from helpers import start_agents, user_ranges, wait_armed, wait_terminal, wait_until

MODEL = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def train_step(agent: ProfilerAgent, step: int, pause: float = 0.0) -> None:
    with agent.step(step):
        with agent.stage("compute_log_prob"), torch.no_grad():
            MODEL(torch.randn(8, 16))
        with agent.stage("update", role="actor", update_loop=True):
            for i in range(2):
                with agent.mini_batch(i):
                    for j in range(2):
                        with agent.micro_batch(j):
                            MODEL(torch.randn(4, 16)).sum().backward()
        if pause:
            time.sleep(pause)


def test_idle_marks_share_one_noop_and_make_no_files(tmp_path: Path) -> None:
    agent = ProfilerAgent("actor", 0, 1, find_link=lambda: None)  # never started: inert
    assert agent.stage("x") is agent.stage("x")  # one timer per label, reused (no allocation)
    assert agent.mini_batch(0) is NULL_RANGE and agent.micro_batch(0) is NULL_RANGE
    assert agent.step(1) is agent.step(2)  # the same object every step
    for s in range(3):
        train_step(agent, s)
    assert agent.current_step == 2 and not agent.recording
    assert agent.close() is True
    assert list(tmp_path.iterdir()) == []


def test_inert_agent_without_a_coordinator_lets_training_finish() -> None:
    lookups = []

    def absent() -> None:
        lookups.append(1)
        return None

    agent = ProfilerAgent("actor", 0, 1, find_link=absent, poll_timeout_s=0.1).start()
    for s in range(5):
        train_step(agent, s)
    assert not agent.connected and agent.current_step == 4
    assert agent.close(timeout=5) is True
    assert lookups  # it kept looking in the background


def test_continuous_session_records_one_trace_per_step_with_contents(local_coordinator) -> None:
    owner = local_coordinator
    # untimed marks: a step's time, if its report came before the POST, would lead the window
    # by the loop's pace (a microsecond step: the most lead steps), not by one step
    agents = start_agents(owner, 2, mark_times=False)
    for a in agents:
        train_step(a, 0)
    view = owner.call("create_session", {"next_steps": 2, "roles": {"actor": {"all_ranks": True}}})
    assert view.steps == [2, 3]  # current step 0, +1 to be reachable, +1 lead
    assert [(t.role, t.rank) for t in view.targets] == [("actor", 0), ("actor", 1)]
    for a in agents:
        wait_armed(a, view.session_id)
    for s in range(1, 5):
        for a in agents:
            train_step(a, s)
    view = wait_terminal(owner, view.session_id)
    assert view.state.value == "done", view.reason
    assert len(view.traces) == 4
    for t in view.traces:
        path = Path(t.path)
        assert path.parent == Path(view.save_dir) and path.is_file()
        parts = parse_trace_name(path.name)
        assert parts is not None and parts.head == ("actor", "train")
        assert parts.step == str(t.steps[0]) and parts.rank == t.rank and parts.world_size == 2
        assert parts.pid == os.getpid()
        trace = read_trace(path)
        names = user_ranges(trace)
        for expected in (
            "compute_log_prob",
            "actor_update",
            "mini_batch0",
            "mini_batch1",
            "micro_batch0",
            "micro_batch1",
            f"step{t.steps[0]}",
        ):
            assert expected in names, (expected, sorted(set(names)))
        assert names.count("mini_batch0") == 1 and names.count("micro_batch1") == 2
        assert not any("ProfilerStep" in e.get("name", "") for e in trace["traceEvents"])
        assert trace["distributedInfo"] == {"rank": t.rank, "world_size": 2}
        meta = trace["profd"]
        assert meta["session_id"] == view.session_id and meta["role"] == "actor"
        assert meta["step"] == t.steps[0] and meta["scope"] == "train"
        ops = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "cpu_op"}
        assert "aten::addmm" in ops  # real operator events, not just our ranges
    for a in agents:
        a.close()


def test_continuous_steps_group_into_one_trace_named_by_the_first(local_coordinator) -> None:
    owner = local_coordinator
    (agent,) = start_agents(owner)
    train_step(agent, 0)
    view = owner.call("create_session", {"steps": [2, 3, 5], "profile_continuous_steps": True})
    assert view.groups == [[2, 3], [5]]
    wait_armed(agent, view.session_id)
    for s in range(1, 7):
        train_step(agent, s)
    view = wait_terminal(owner, view.session_id)
    assert view.state.value == "done", view.reason
    by_first = {t.steps[0]: t for t in view.traces}
    assert sorted(by_first) == [2, 5] and by_first[2].steps == [2, 3]
    names = user_ranges(read_trace(by_first[2].path))
    assert "step2" in names and "step3" in names and "step4" not in names
    assert "_step2_" in by_first[2].file_name
    agent.close()


def test_discrete_mode_writes_one_trace_per_stage(local_coordinator) -> None:
    owner = local_coordinator
    (agent,) = start_agents(owner, role="actor_rollout_ref")
    train_step(agent, 0)
    view = owner.call("create_session", {"steps": [2], "roles": {"actor": {"discrete": True}}})
    assert view.discrete_roles == ["actor"]
    wait_armed(agent, view.session_id)
    for s in range(1, 4):
        train_step(agent, s)
    view = wait_terminal(owner, view.session_id)
    assert view.state.value == "done", view.reason
    scopes = sorted(t.scope for t in view.traces)
    assert scopes == ["actor_update", "compute_log_prob"]
    for t in view.traces:
        parts = parse_trace_name(t.file_name)
        assert parts.head == ("actor-rollout-ref", t.scope.replace("_", "-"))
        names = user_ranges(read_trace(t.path))
        assert t.scope in names
        if t.scope == "actor_update":
            assert "mini_batch1" in names and "micro_batch0" in names
    agent.close()


def test_a_mini_batch_schedules_windows_claim_no_whole_step(local_coordinator) -> None:
    """A schedule's windows hold a few mini-batches of the update stage each: their header
    names no whole step (a summary read a fragment as the whole stage: half its time); the
    plain stage's trace names its step, and the mini-batches keep their stage."""
    from profd.analysis.summary import summarize_dir

    owner = local_coordinator
    (agent,) = start_agents(owner)
    train_step(agent, 0)
    schedule = {"wait": 0, "warmup": 0, "active": 1, "repeat": 0, "skip_first": 0}
    roles = {"actor": {"discrete": True, "tool_config": {"torch": {"schedule": schedule}}}}
    view = owner.call("create_session", {"steps": [1], "roles": roles})
    wait_armed(agent, view.session_id)
    for s in range(1, 3):
        train_step(agent, s)
    view = wait_terminal(owner, view.session_id)
    assert view.state.value == "done", view.reason
    headers = [read_trace(t.path)["profd"] for t in view.traces]
    windows = [h for h in headers if h["scope"] == "actor_update"]  # _mb0, _mb1, the rest
    assert len(windows) >= 2 and all(h["steps"] == [] for h in windows), headers
    (plain,) = [h for h in headers if h["scope"] == "compute_log_prob"]
    assert plain["steps"] == [1]
    summary = summarize_dir(Path(view.traces[0].path).parent)
    assert {r.stage for r in summary.stage_times} == {"compute_log_prob"}
    assert sorted((m.stage, m.index) for m in summary.mini_batches) == [
        ("actor_update", 0), ("actor_update", 1)
    ]  # fmt: skip
    # the windows' operators ran in the update stage (they were "outside stages")
    assert {o.stage for o in summary.top_ops} == {"compute_log_prob", "actor_update"}
    # summarize's stderr: one line for the schedule's windows, not one per window file
    from profd.cli.summary_view import partial_lines

    (line,) = partial_lines(summary.files)
    first = min(t.file_name for t in view.traces if "actor-update" in t.file_name)
    assert line.startswith(f"{first} and {len(windows) - 1} more: a schedule's windows of step 1,")
    agent.close()


def test_plan_arriving_late_reports_the_missed_step(local_coordinator) -> None:
    owner = local_coordinator
    (agent,) = start_agents(owner)
    train_step(agent, 0)
    train_step(agent, 1)
    # Step 2 is requested while the agent sits at step 1; it then skips straight to step 3.
    view = owner.call("create_session", {"steps": [2, 3]})
    wait_armed(agent, view.session_id)
    for s in (3, 4):
        train_step(agent, s)
    view = wait_terminal(owner, view.session_id)
    assert view.state.value == "partial"
    part = view.targets[0]
    assert part.recorded_steps == [3] and part.missed_steps == [2]
    assert "never entered" in part.reason
    agent.close()


def test_job_ending_before_the_window_closes_cleanly(local_coordinator) -> None:
    owner = local_coordinator
    (agent,) = start_agents(owner)
    train_step(agent, 0)
    view = owner.call("create_session", {"steps": [1, 2, 3], "profile_continuous_steps": True})
    wait_armed(agent, view.session_id)
    train_step(agent, 1)
    train_step(agent, 2)
    assert agent.close(timeout=20)  # the open group (1-3) is flushed, not lost
    view = wait_terminal(owner, view.session_id)
    assert view.state.value == "partial"
    (trace,) = view.traces
    assert trace.steps == [1, 2] and Path(trace.path).is_file()
    assert view.targets[0].missed_steps == [3]
    assert "job ended" in view.targets[0].reason


def test_cancel_keeps_what_was_recorded(local_coordinator) -> None:
    owner = local_coordinator
    (agent,) = start_agents(owner)
    train_step(agent, 0)
    view = owner.call("create_session", {"steps": [1, 2, 3], "profile_continuous_steps": True})
    wait_armed(agent, view.session_id)
    train_step(agent, 1)
    cancelled = owner.call("cancel_session", view.session_id)
    assert cancelled.state.value == "cancelled"
    wait_until(lambda: not agent.plan.windows, 10, what="window withdrawn")
    train_step(agent, 2)
    wait_until(lambda: owner.call("list_traces", view.session_id), 10, what="trace indexed")
    (trace,) = owner.call("list_traces", view.session_id)
    assert trace.steps == [1] and Path(trace.path).is_file()
    agent.close()


def cancel_inside_step(owner: Any, agent: ProfilerAgent, session_id: str, step: int) -> Any:
    """Step ``step``: its first stage, the session cancelled, then a second stage (whose
    mark ends the window, inside the step); the session's one trace."""
    with agent.step(step):
        with agent.stage("compute_log_prob"):
            MODEL(torch.randn(8, 16))
        owner.call("cancel_session", session_id)
        wait_until(lambda: not agent.plan.windows, 10, what="window withdrawn")
        with agent.stage("update"):
            MODEL(torch.randn(8, 16))
    wait_until(lambda: owner.call("list_traces", session_id), 10, what="trace indexed")
    (trace,) = owner.call("list_traces", session_id)
    return trace


def test_a_step_cancelled_midway_is_named_partial_in_the_trace(local_coordinator) -> None:
    """The trace keeps what the cut step recorded, but its header names the steps held whole
    (``profd.steps``), so a summary leaves the cut one out instead of counting it short."""
    from profd.analysis.summary import summarize_dir

    owner = local_coordinator
    (agent,) = start_agents(owner)
    train_step(agent, 0)
    view = owner.call("create_session", {"steps": [1, 2, 3], "profile_continuous_steps": True})
    wait_armed(agent, view.session_id)
    train_step(agent, 1)
    trace = cancel_inside_step(owner, agent, view.session_id, 2)
    assert trace.steps == [1]
    data = read_trace(trace.path)
    assert {"step1", "step2"} <= set(user_ranges(data))  # the cut step's start is still there
    assert data["profd"]["group"] == [1, 2, 3] and data["profd"]["steps"] == [1]
    summary = summarize_dir(Path(trace.path).parent)
    assert [r.step for r in summary.step_times] == [1]
    assert {r.step for r in summary.stage_times} == {1}
    assert summary.files[0].partial_steps == [2]
    from profd.cli.summary_view import partial_lines

    assert partial_lines(summary.files) == [
        f"{trace.file_name}: holds step 2 only in part, left out of step and stage times"
    ]
    from profd.analysis import render_html

    assert "partial steps</th>" in render_html(summary)
    assert "<td>2</td></tr>" in render_html(summary)  # the file's row ends with its cut step
    agent.close()


def test_a_window_cut_in_its_only_step_credits_no_stage(local_coordinator) -> None:
    """A continuous window cancelled inside its first step holds no step whole: its
    operators stay outside stages (not credited to a stage named after its scope)."""
    from profd.analysis.summary import summarize_dir

    owner = local_coordinator
    (agent,) = start_agents(owner)
    train_step(agent, 0)
    view = owner.call("create_session", {"steps": [1, 2]})
    wait_armed(agent, view.session_id)
    trace = cancel_inside_step(owner, agent, view.session_id, 1)
    assert read_trace(trace.path)["profd"]["steps"] == []
    summary = summarize_dir(Path(trace.path).parent)
    assert summary.files[0].partial_steps == [1] and summary.stage_times == []
    assert summary.top_ops and {o.stage for o in summary.top_ops} == {None}
    agent.close()


def test_a_discrete_stage_cancelled_midway_is_named_partial(local_coordinator) -> None:
    """Discrete mode: the first stage's trace is whole; the second's window ends inside the
    stage (the cancel, met at a nested mark), so its header does not claim the step and a
    summary leaves its stage out."""
    from profd.analysis.summary import summarize_dir

    owner = local_coordinator
    (agent,) = start_agents(owner)
    train_step(agent, 0)
    view = owner.call("create_session", {"steps": [1], "roles": {"actor": {"discrete": True}}})
    wait_armed(agent, view.session_id)
    with agent.step(1):
        with agent.stage("compute_log_prob"):
            MODEL(torch.randn(8, 16))
        with agent.stage("update"):
            owner.call("cancel_session", view.session_id)
            wait_until(lambda: not agent.plan.windows, 10, what="window withdrawn")
            with agent.stage("inner"):  # the mark that ends the window, mid-stage
                MODEL(torch.randn(8, 16))
    wait_until(lambda: len(owner.call("list_traces", view.session_id)) == 2, 10, what="traces")
    traces = {t.scope: t for t in owner.call("list_traces", view.session_id)}
    assert traces["compute_log_prob"].steps == [1] and traces["update"].steps == []
    assert read_trace(traces["update"].path)["profd"]["steps"] == []
    summary = summarize_dir(Path(traces["update"].path).parent)
    partial = {f.name: f.partial_steps for f in summary.files}
    assert partial == {traces["compute_log_prob"].file_name: [], traces["update"].file_name: [1]}
    assert {r.stage for r in summary.stage_times} == {"compute_log_prob"}
    agent.close()


def test_unwritable_save_path_is_reported_and_training_goes_on(local_coordinator, tmp_path) -> None:
    owner = local_coordinator
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory should be")
    (agent,) = start_agents(owner)
    train_step(agent, 0)
    view = owner.call("create_session", {"steps": [1], "save_path": str(blocker)})
    wait_armed(agent, view.session_id)
    for s in range(1, 4):
        train_step(agent, s)  # never raises
    view = wait_terminal(owner, view.session_id)
    assert view.state.value == "failed"
    assert "export failed" in view.targets[0].reason
    assert agent.current_step == 3
    agent.close()


def test_user_exceptions_propagate_and_recording_recovers(local_coordinator) -> None:
    owner = local_coordinator
    (agent,) = start_agents(owner)
    train_step(agent, 0)
    view = owner.call("create_session", {"steps": [1, 2]})
    wait_armed(agent, view.session_id)
    with pytest.raises(ZeroDivisionError), agent.step(1), agent.stage("boom"):
        _ = 1 / 0
    train_step(agent, 2)
    view = wait_terminal(owner, view.session_id)
    assert view.state.value == "done", view.reason
    assert "boom" in user_ranges(read_trace(view.traces[0].path))
    agent.close()


def test_agent_registers_when_the_coordinator_comes_up_later(local_coordinator) -> None:
    owner = local_coordinator
    owner.down = True
    agent = ProfilerAgent("critic", 0, 1, find_link=owner.link).start()
    for s in range(3):
        train_step(agent, s)
    assert not agent.connected
    owner.down = False
    wait_until(lambda: agent.connected, 15, what="late registration")
    agents = owner.call("list_agents")
    assert [(a.role, a.current_step) for a in agents] == [("critic", 2)]
    agent.close()


def test_second_session_on_busy_targets_is_refused(local_coordinator) -> None:
    from profd.core.errors import ConflictError

    owner = local_coordinator
    (agent,) = start_agents(owner)
    train_step(agent, 0)
    first = owner.call("create_session", {"steps": [5]})
    with pytest.raises(ConflictError, match=first.session_id):
        owner.call("create_session", {"steps": [6]})
    agent.close()


def test_colocated_roles_share_one_collection_named_by_the_combined_role(
    local_coordinator,
) -> None:
    import profd

    owner = local_coordinator
    actor = profd.attach("actor", 0, 2, find_link=owner.link)
    ref = profd.attach("ref", 0, find_link=owner.link)
    assert profd.attach("ref", 0) is ref and profd.attach("actor", 0) is actor
    with pytest.raises(ValueError, match="rank: this process is already attached"):
        profd.attach("critic", 1)
    wait_until(
        lambda: [a.role for a in owner.call("list_agents")] == ["actor_ref"], 15, what="re-reg"
    )
    with actor.step(0):
        pass
    view = owner.call("create_session", {"steps": [1], "roles": {"ref": {}}})
    assert [(t.role, t.role_block) for t in view.targets] == [("actor_ref", "ref")]
    wait_armed(actor, view.session_id)
    for s in (1, 2):
        with actor.step(s):
            with actor.stage("compute_log_prob"):
                MODEL(torch.randn(2, 16))
            with ref.stage("compute_log_prob"):
                MODEL(torch.randn(2, 16))
    view = wait_terminal(owner, view.session_id)
    assert view.state.value == "done", view.reason
    (trace,) = view.traces
    assert trace.file_name.startswith("actor-ref_train_step1_rank0-of-2_")
    names = user_ranges(read_trace(trace.path))
    # every label names the role that marked it, the first role's too
    assert "actor_compute_log_prob" in names and "ref_compute_log_prob" in names
    assert "compute_log_prob" not in names
    ref.close()
    assert not actor.connected or actor._closed


@pytest.mark.parametrize("discrete", [False, True])
def test_profiler_fault_mid_update_ends_the_window_not_the_loop(
    monkeypatch, local_coordinator, discrete: bool
) -> None:
    """torch raising inside a mini-batch step: the window is given up once (never stopped
    twice, which crashes Kineto), reported, and the loop runs on unprofiled."""
    from profd.backends import torch_backend

    real_step, calls = torch_backend._TorchCollection.step, []

    def step_once_broken(self) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("kineto said no")
        real_step(self)

    monkeypatch.setattr(torch_backend._TorchCollection, "step", step_once_broken)
    owner = local_coordinator
    (agent,) = start_agents(owner)
    train_step(agent, 0)
    view = owner.call("create_session", {"steps": [1], "roles": {"*": {"discrete": discrete}}})
    wait_armed(agent, view.session_id)
    for s in (1, 2, 3):
        with agent.step(s):
            with agent.stage("update_actor", update_loop=True):
                for i in range(2):
                    with agent.mini_batch(i):
                        torch.ones(8).sum()
            with agent.stage("update_critic"):
                torch.ones(8).sum()
    view = wait_terminal(owner, view.session_id)
    # what ran before the fault is kept; the part says why it is not complete
    assert view.state.value == "partial"
    assert "kineto said no" in view.targets[0].reason
    assert agent.current_step == 3 and not agent.recording
    # a later session on the same agent records normally
    again = owner.call("create_session", {"steps": [5]})
    wait_armed(agent, again.session_id)
    for s in (4, 5, 6):
        train_step(agent, s)
    again = wait_terminal(owner, again.session_id)
    assert again.state.value == "done", again.reason
    assert "actor_update" in user_ranges(read_trace(again.traces[0].path))
    agent.close()


def test_next_steps_start_where_every_target_can_still_reach(local_coordinator) -> None:
    """Targets at different steps: the window starts after the most advanced one, so the
    laggard records the same steps later instead of the leader missing them."""
    owner = local_coordinator
    behind, ahead = start_agents(owner, 2)
    for s in range(3):
        train_step(behind, s)
    for s in range(8):
        train_step(ahead, s)
    view = owner.call("create_session", {"next_steps": 2, "roles": {"actor": {"all_ranks": True}}})
    first = view.steps[0]
    assert first >= 8 and view.steps == [first, first + 1]
    wait_armed(behind, view.session_id)
    wait_armed(ahead, view.session_id)
    for s in range(3, first + 3):
        train_step(behind, s)
    for s in range(8, first + 3):
        train_step(ahead, s)
    view = wait_terminal(owner, view.session_id)
    assert view.state.value == "done", view.reason
    assert sorted((t.rank, tuple(t.steps)) for t in view.traces) == [
        (0, (first,)),
        (0, (first + 1,)),
        (1, (first,)),
        (1, (first + 1,)),
    ]
    for a in (behind, ahead):
        a.close()


def test_group_joined_late_is_named_by_its_first_recorded_step(local_coordinator) -> None:
    owner = local_coordinator
    (agent,) = start_agents(owner)
    train_step(agent, 0)
    train_step(agent, 1)  # step 1 has begun (and ended) before the plan arrives
    view = owner.call("create_session", {"steps": [1, 2, 3], "profile_continuous_steps": True})
    wait_armed(agent, view.session_id)
    for s in (2, 3, 4):
        train_step(agent, s)
    view = wait_terminal(owner, view.session_id)
    (trace,) = view.traces
    assert trace.steps == [2, 3]
    assert parse_trace_name(trace.file_name).step == "2"  # not step1: it holds no step 1
    assert view.targets[0].missed_steps == [1]
    agent.close()


def test_an_agent_between_two_links_at_close_still_says_how_its_window_ended(
    local_coordinator,
) -> None:
    """The job ends while its agent moves to another link (its node's relay came back): close
    waits for it to register again and sends its last events, instead of dropping them (the
    session then waited on an agent that was gone)."""
    import threading

    from profd.agent.channel import LinkMoved

    owner = local_coordinator
    gate = threading.Event()
    gate.set()
    moving = threading.Event()

    class Moving:
        """The coordinator, until told the relay is back: then its poll says so."""

        def __init__(self) -> None:
            self._link = owner.link()

        def __getattr__(self, name: str) -> Any:
            return getattr(self._link, name)

        def poll(self, agent_id: str, version: int, step: int | None, timeout: float) -> Any:
            if moving.is_set():
                moving.clear()
                raise LinkMoved("the node's relay is back")
            return self._link.poll(agent_id, version, step, min(timeout, 0.2))

    def find() -> Any:
        gate.wait(30)  # the new link takes a moment (a relay's ping, its socket)
        return Moving()

    agent = ProfilerAgent("actor", 0, 1, find_link=find).start()
    wait_until(lambda: agent.connected, 10, what="registered")
    train_step(agent, 0)
    view = owner.call("create_session", {"steps": [5]})
    wait_armed(agent, view.session_id)
    gate.clear()
    moving.set()
    wait_until(lambda: not agent.connected, 10, 0.01, what="between two links")
    threading.Timer(0.5, gate.set).start()
    assert agent.close(timeout=20)
    view = wait_terminal(owner, view.session_id)
    assert view.state.value in ("missed", "failed"), view.reason
    assert "job ended" in view.targets[0].reason, view.targets[0].reason


def test_an_agent_that_finds_no_coordinator_says_so_once(caplog) -> None:
    """A job whose ray.init() found no cluster runs on a Ray of its own: its agents never
    find profd's coordinator, and say why (once), instead of staying silently inert."""
    import logging

    from profd.agent.channel import Channel
    from profd.core.protocol import AgentInfo

    looked: list[float] = []

    def nowhere() -> None:
        looked.append(time.monotonic())
        return None

    info = AgentInfo("actor-0-x", "actor", 0, 1, {}, "h", os.getpid())
    channel = Channel(
        info, nowhere, lambda: None, lambda plan: None, retry_s=(0.01, 0.02), absent_warn_s=0.2
    )
    with caplog.at_level(logging.WARNING, logger="profd.agent.channel"):
        channel.start()
        try:
            wait_until(lambda: len(looked) >= 30, 10, 0.01, what="30 lookups")
        finally:
            channel.stop()
    said = [m for r in caplog.records if "found no profd coordinator" in (m := r.getMessage())]
    assert len(said) == 1, said  # once, however often it looked
    assert "actor-0-x" in said[0] and "`profd up`" in said[0] and "RAY_ADDRESS" in said[0]
    assert "(Ray cluster " in said[0]  # which one it looked in (none, in this test process)
    assert not channel.connected


WARM_UP_SCRIPT = """
import sys, time
from pathlib import Path
import torch
from profd.actors.coordinator import ProfileCoordinator
from profd.agent import ProfilerAgent
from profd.core.settings import CoordinatorSettings
from profd.testing.coordinator import InProcessCoordinator

root = Path(sys.argv[1])
settings = CoordinatorSettings(save_root=str(root / "p"), base_dir=str(root), poll_timeout_s=1.0)
owner = InProcessCoordinator(ProfileCoordinator(settings))
agent = ProfilerAgent("actor", 0, 1, find_link=owner.link, poll_timeout_s=1.0).start()
with agent.step(1):
    pass
before = "torch._inductor" in sys.modules
view = owner.call("create_session", {"tool": sys.argv[2], "steps": [50]})
deadline = time.monotonic() + 60
while not agent.plan.windows and time.monotonic() < deadline:
    time.sleep(0.05)
if sys.argv[2] != "torch":  # no warm-up to wait for: give a wrong one time to show
    deadline = time.monotonic() + 2
while not hasattr(sys.modules.get("torch._inductor.config"), "triton"):
    if time.monotonic() > deadline:
        break
    time.sleep(0.05)  # this thread marks nothing and imports nothing meanwhile
config = sys.modules.get("torch._inductor.config")
print(before, bool(agent.plan.windows), hasattr(config, "triton"))  # imported in full
agent.close()
owner.close()
"""


@pytest.mark.parametrize("tool", ["torch", "py_spy"])
def test_a_planned_torch_window_warms_the_profiler_up_off_the_training_thread(
    tmp_path: Path, tool: str
) -> None:
    """torch.profiler's first start imports inductor and dynamo (1.2-2 s on the training
    thread, measured by bench/first_window.py): a torch window, once planned, has them
    imported on a thread of profd's while the training thread does nothing; another tool's
    window does not."""
    import subprocess
    import sys

    script = tmp_path / "warm.py"
    script.write_text(WARM_UP_SCRIPT)
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path), tool],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    before, planned, after = r.stdout.split()
    assert (before, planned) == ("False", "True"), r.stdout
    assert after == ("True" if tool == "torch" else "False"), r.stdout


def test_a_forked_child_neither_owns_nor_waits_on_its_parents_agent(local_coordinator) -> None:
    """A DataLoader worker or helper forked from an attached worker: exiting took 10 s and
    more (its atexit closed the parent's agent, waiting on a reporter thread the child does
    not have); now the child has no agent, and closing the inherited object returns at once.
    The parent's agent goes on as before."""
    import importlib

    import profd

    attach_mod = importlib.import_module("profd.agent.attach")  # the module, not the function
    agent = profd.attach("actor", 0, 1, find_link=local_coordinator.link)
    wait_until(lambda: agent.connected, 10, what="registered")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running pytest's atexit
        try:
            started = time.monotonic()
            attach_mod._close_at_exit()
            agent.close(timeout=30)
            took = time.monotonic() - started
            os.write(write, json.dumps([took, len(attach_mod.attached_agents())]).encode())
        except BaseException as exc:
            os.write(write, repr(exc).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read) as f:
            said = f.read()
        os.waitpid(pid, 0)
        took, attached = json.loads(said) if said.startswith("[") else (said, -1)
        assert attached == 0 and took < 1.0, said
        assert agent.connected and not agent._closed  # the parent's agent is untouched
    finally:
        agent.close()


def test_attach_survives_a_bad_environment(monkeypatch, caplog) -> None:
    """A malformed RANK / WORLD_SIZE / PROFD_RELAY_RETRY_S in the job's environment, or a
    start that fails, is named in the log and never raised into the job; the agent starts
    inert rather than half-attached."""
    import logging

    import profd
    from profd.agent import ProfilerAgent
    from profd.agent.relay_link import RELAY_RETRY_S, _retry_s_from_env

    monkeypatch.setenv("RANK", "")
    monkeypatch.setenv("WORLD_SIZE", "eight")
    caplog.set_level(logging.WARNING, logger="profd")
    agent = profd.attach("actor", find_link=lambda: None)
    assert (agent.info.rank, agent.info.world_size) == (0, None)
    assert "WORLD_SIZE='eight' is not an int >= 0" in caplog.text
    agent.close()
    for raw in ("10s", "0", "nan", "-1"):
        monkeypatch.setenv("PROFD_RELAY_RETRY_S", raw)
        assert _retry_s_from_env() == RELAY_RETRY_S
    assert "PROFD_RELAY_RETRY_S='10s'" in caplog.text
    monkeypatch.setenv("PROFD_RELAY_RETRY_S", "2.5")
    assert _retry_s_from_env() == 2.5

    from profd.agent import agent as agent_mod

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no thread today")

    monkeypatch.setattr(agent_mod, "Channel", broken)
    inert = ProfilerAgent("actor", 0, 1, find_link=lambda: None).start()
    assert "could not start and stays inert" in caplog.text and not inert.connected
    with inert.step(1), inert.stage("update"):
        pass
    inert.close()
