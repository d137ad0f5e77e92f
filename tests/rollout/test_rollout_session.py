"""Rollout replicas in sessions: registration, targeting by global GPU rank, lifecycle
ordering against training, timed windows and engine failures — fake vLLM servers over real
HTTP, real training agents, an in-process coordinator and a single-controller driver."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from rollout_helpers import sglang_pair, vllm_pair

from profd.core.errors import ConflictError
from profd.driver.controller import Controller
from profd.rollout.service import RolloutService

from helpers import start_agents, wait_terminal, wait_until


class Job:
    """An actor (training) and two tp=2 rollout replicas driven by one controller. (One
    training agent: torch allows one profiler per process, and these agents share the test's.)"""

    def __init__(self, owner: Any, tmp_path: Path, colocated: bool, stack: ExitStack) -> None:
        self.owner = owner
        self.actors = start_agents(owner, 1, role="actor")
        self.fakes, self.replicas = [], []
        for r in range(2):
            fake, agent = vllm_pair(tmp_path, replica=r, tp=2)
            stack.enter_context(fake)
            self.fakes.append(fake)
            svc = RolloutService(
                agent, replicas=2, colocated=colocated, find_link=owner.link, poll_timeout_s=1.0
            ).start()
            self.replicas.append(svc)
        wait_until(lambda: all(s.connected for s in self.replicas), 10, what="replicas")
        self.ctl = Controller(lambda: owner, timeout_s=10, rollout_timeout_s=60)
        self.stop_seen_before_training: list[bool] = []

    def step(self, n: int, mark_rollout: bool) -> None:
        with self.ctl.step(n):
            if mark_rollout:
                with self.ctl.rollout():
                    for f in self.fakes:
                        f.advance(2)
            else:
                for f in self.fakes:
                    f.advance(2)
            stops = sum(
                1 for f in self.fakes for _, path, _ in f.requests if path == "/stop_profile"
            )
            self.stop_seen_before_training.append(stops)
            for a in self.actors:
                with a.stage("update_actor"):
                    torch.ones(8).sum()

    def close(self) -> None:
        for a in self.actors:
            a.close(timeout=10)
        for s in self.replicas:
            s.close(timeout=30)


@pytest.fixture
def job_factory(local_coordinator, tmp_path):
    with ExitStack() as stack:
        jobs: list[Job] = []

        def make(colocated: bool = False) -> Job:
            job = Job(local_coordinator, tmp_path, colocated, stack)
            jobs.append(job)
            return job

        yield make
        for j in jobs:
            j.close()


def test_replicas_register_with_their_global_rank_range(job_factory) -> None:
    job = job_factory()
    agents = {(a.role, a.rank): a for a in job.owner.call("list_agents")}
    r1 = agents[("rollout", 1)]
    assert r1.world_size == 2
    assert r1.replica is not None and r1.replica.world_size == 2
    assert (r1.replica.global_rank_start, r1.replica.global_rank_stop) == (2, 4)
    assert r1.capabilities["torch"] is None and r1.capabilities["py_spy"] is not None
    # no driver has announced a step yet: a step session on replicas says what they need
    view = job.owner.call("create_session", {"steps": [9], "roles": {"rollout": {"ranks": [0]}}})
    assert any("profd.controller().step(n)" in w for w in view.warnings)
    job.owner.call("cancel_session", view.session_id)
    assert r1.labels["engine_kind"] == "vllm" and r1.labels["endpoint"] == job.fakes[1].url
    assert r1.labels["trace_dir"] == job.replicas[1].agent.describe().trace_dir != ""


def test_global_ranks_select_replicas_and_only_requested_ranks_come_up(job_factory) -> None:
    job = job_factory(colocated=False)
    job.step(1, mark_rollout=False)
    view = job.owner.call(
        "create_session",
        {
            "next_steps": 1,
            "roles": {"actor": {"all_ranks": True}, "rollout": {"ranks": [0, 3, 9]}},
        },
    )
    assert view.steps == [3]
    assert sorted((t.role, t.rank) for t in view.targets) == [
        ("actor", 0),
        ("rollout", 0),
        ("rollout", 1),
    ]
    (ignored,) = view.ignored
    assert ignored.rank == 9 and "only 2 replica(s)" in ignored.reason
    for n in (2, 3, 4):
        job.step(n, mark_rollout=False)
    view = wait_terminal(job.owner, view.session_id, timeout=30)
    assert view.state.value == "done", view.reason
    rollout = sorted(t.file_name for t in view.traces if t.role == "rollout")
    assert [n.split("_")[0] for n in rollout] == [
        "rollout-replica0-globalrank0",
        "rollout-replica1-globalrank3",
    ]
    session_dir = Path(view.save_dir)
    # tp peers (global ranks 1 and 2) stay in the replicas' sub-directories, not dropped
    assert any("rank1." in p.name for p in (session_dir / "rollout-replica0").iterdir())
    assert any("rank0." in p.name for p in (session_dir / "rollout-replica1").iterdir())
    assert [t.rank for t in view.traces if t.role == "actor"] == [0]


def test_colocated_replica_stops_before_training_stages(job_factory) -> None:
    job = job_factory(colocated=True)
    job.step(1, mark_rollout=True)
    view = job.owner.call(
        "create_session",
        {
            "next_steps": 1,
            "roles": {"actor": {"all_ranks": True}, "rollout": {"all_ranks": True}},
        },
    )
    for n in (2, 3, 4):
        job.step(n, mark_rollout=True)
    view = wait_terminal(job.owner, view.session_id, timeout=30)
    assert view.state.value == "done", view.reason
    # step 3 is the window: both engines had stopped before the training stages of step 3 ran
    assert job.stop_seen_before_training[2] == 2
    assert len([t for t in view.traces if t.role == "rollout"]) == 4  # all ranks of 2 replicas


def test_colocated_replica_without_rollout_marks_reports_why(job_factory) -> None:
    job = job_factory(colocated=True)
    job.step(1, mark_rollout=False)
    view = job.owner.call(
        "create_session",
        {
            "next_steps": 1,
            "roles": {"actor": {"all_ranks": True}, "rollout": {"all_ranks": True}},
        },
    )
    for n in (2, 3, 4):
        job.step(n, mark_rollout=False)
    view = wait_terminal(job.owner, view.session_id, timeout=30)
    assert view.state.value == "partial"
    parts = {(p.role, p.rank): p for p in view.targets}
    assert parts[("actor", 0)].state.value == "done"
    for r in (0, 1):
        assert parts[("rollout", r)].state.value == "missed"
        assert "controller().rollout()" in parts[("rollout", r)].reason
    assert not any("/start_profile" in p for f in job.fakes for _, p, _ in f.requests)


def test_timed_rollout_only_session(job_factory) -> None:
    job = job_factory()
    view = job.owner.call(
        "create_session", {"duration_s": 0.5, "roles": {"rollout": {"all_ranks": True}}}
    )
    assert sorted(t.role for t in view.targets) == ["rollout", "rollout"]
    wait_until(
        lambda: all(any(p == "/start_profile" for _, p, _ in f.requests) for f in job.fakes),
        10,
        what="engines started",
    )
    for f in job.fakes:
        f.advance(3)
    view = wait_terminal(job.owner, view.session_id, timeout=30)
    assert view.state.value == "done", view.reason
    assert len(view.traces) == 4 and {t.scope for t in view.traces} == {"rollout"}


def test_engine_down_makes_only_its_part_partial(job_factory) -> None:
    job = job_factory()
    job.step(1, mark_rollout=False)
    view = job.owner.call(
        "create_session",
        {
            "next_steps": 1,
            "roles": {"actor": {"all_ranks": True}, "rollout": {"all_ranks": True}},
        },
    )
    job.fakes[1].kill()  # replica 1's endpoint goes away
    for n in (2, 3, 4):
        job.step(n, mark_rollout=False)  # training is unaffected
    view = wait_terminal(job.owner, view.session_id, timeout=30)
    assert view.state.value == "partial"
    parts = {(p.role, p.rank): p for p in view.targets}
    assert parts[("rollout", 0)].state.value == "done"
    bad = parts[("rollout", 1)]
    assert bad.state.value in ("failed", "missed") and "start failed" in bad.reason
    assert parts[("actor", 0)].state.value == "done"


def test_engine_warnings_reach_the_session(local_coordinator, tmp_path) -> None:
    """Options an engine cannot honour are a warning in the session, not only in a log."""
    env = {"SGLANG_PROFILE_WITH_STACK": "false"}  # the server was launched without stacks
    fake, agent = sglang_pair(tmp_path, replica=0, tp=1, server_env=env)
    with fake:
        svc = RolloutService(
            agent, replicas=1, find_link=local_coordinator.link, poll_timeout_s=1.0
        ).start()
        try:
            wait_until(lambda: svc.connected, 10, what="replica registered")
            view = local_coordinator.call(
                "create_session",
                {
                    "duration_s": 0.3,
                    "roles": {
                        "rollout": {
                            "all_ranks": True,
                            "tool_config": {"torch": {"contents": ["cpu", "stack"]}},
                        }
                    },
                },
            )
            wait_until(lambda: fake.requests, 10, what="engine started")
            fake.advance(2)
            view = wait_terminal(local_coordinator, view.session_id, timeout=30)
        finally:
            svc.close(timeout=30)
    assert view.state.value == "done", view.reason
    assert any(
        w.startswith("rollout replica 0:") and "SGLANG_PROFILE_WITH_STACK=false" in w
        for w in view.warnings
    ), view.warnings


def test_replicas_hosted_in_one_process_are_profiled_independently(job_factory) -> None:
    """A replica's profiler lives in its engine: two replicas whose agents share a process
    are two devices, not one."""
    job = job_factory(colocated=False)
    first = job.owner.call(
        "create_session", {"duration_s": 30, "roles": {"rollout": {"ranks": [0]}}}
    )
    second = job.owner.call(
        "create_session", {"duration_s": 30, "roles": {"rollout": {"ranks": [2]}}}
    )
    assert [t.rank for t in first.targets] == [0] and [t.rank for t in second.targets] == [1]
    with pytest.raises(ConflictError, match=first.session_id):
        job.owner.call("create_session", {"duration_s": 5, "roles": {"rollout": {"ranks": [1]}}})

    def engines_saw(path: str) -> bool:
        return all(any(p == path for _, p, _ in f.requests) for f in job.fakes)

    wait_until(lambda: engines_saw("/start_profile"), 10, what="both engines started")
    for view in (first, second):
        job.owner.call("cancel_session", view.session_id)
    # cancelling a timed window stops the engine now, not when its 30 s are up
    wait_until(lambda: engines_saw("/stop_profile"), 10, what="engines stopped on cancel")


def test_colocated_replica_and_training_on_its_devices_never_profile_at_once(job_factory) -> None:
    """A colocated replica shares its global ranks' devices (and, in a hybrid engine, their
    processes) with the training ranks of those numbers: another session cannot take one
    while a session holds the other, and a timed request cannot take both at once."""
    job = job_factory(colocated=True)
    job.step(1, mark_rollout=True)
    training = job.owner.call("create_session", {"steps": [50], "roles": {"actor": {}}})
    assert [(t.role, t.rank) for t in training.targets] == [("actor", 0)]
    with pytest.raises(ConflictError, match=training.session_id) as err:
        job.owner.call("create_session", {"steps": [50], "roles": {"rollout": {"ranks": [1]}}})
    assert "rollout rank 0" in err.value.message
    other = job.owner.call(  # replica 1 (global ranks 2-3) shares nothing with actor rank 0
        "create_session", {"steps": [50], "roles": {"rollout": {"ranks": [2]}}}
    )
    for view in (training, other):
        job.owner.call("cancel_session", view.session_id)
    with pytest.raises(ConflictError, match="this timed request"):
        job.owner.call(
            "create_session",
            {"duration_s": 5, "roles": {"actor": {"ranks": [0]}, "rollout": {"ranks": [0]}}},
        )
    assert all(s.state.value == "cancelled" for s in job.owner.call("list_sessions"))


def test_timed_session_waits_as_long_as_its_engines_may_flush(local_coordinator, tmp_path) -> None:
    """Engines flush slowly: a timed session's deadline leaves the replica its whole stop
    and flush budget (here an hour), not a fixed five minutes."""
    from profd.rollout.relocate import FlushWait

    fake, agent = sglang_pair(tmp_path, replica=0, tp=1, flush=FlushWait(timeout_s=3600))
    with fake:
        svc = RolloutService(agent, replicas=1, find_link=local_coordinator.link).start()
        try:
            wait_until(lambda: svc.connected, 10, what="replica registered")
            view = local_coordinator.call(
                "create_session", {"duration_s": 2, "roles": {"rollout": {"all_ranks": True}}}
            )
            assert view.deadline - view.created_at >= 2 + 3600 + 5  # + the engine's stop_s
            local_coordinator.call("cancel_session", view.session_id)
        finally:
            svc.close(timeout=30)


def test_launch_time_session_adopts_a_colocated_replica_and_its_training_rank(
    local_coordinator, tmp_path
) -> None:
    """In one session the driver orders a colocated replica before training, so a launch-time
    session adopts both, whichever registers first; nothing is refused against itself."""
    view = local_coordinator.call(
        "create_session",
        {
            "steps": [50],
            "wait_for_agents": True,
            "roles": {"actor": {"all_ranks": True}, "rollout": {"all_ranks": True}},
        },
    )
    (actor,) = start_agents(local_coordinator, 1, role="actor")
    fake, agent = vllm_pair(tmp_path, replica=0, tp=2)
    with fake:
        svc = RolloutService(
            agent, replicas=1, colocated=True, find_link=local_coordinator.link
        ).start()
        try:
            wait_until(
                lambda: len(local_coordinator.call("get_session", view.session_id).targets) == 2,
                10,
                what="both adopted",
            )
            view = local_coordinator.call("get_session", view.session_id)
            assert sorted(t.role for t in view.targets) == ["actor", "rollout"]
            assert not any("not adopted" in w for w in view.warnings), view.warnings
            local_coordinator.call("cancel_session", view.session_id)
        finally:
            svc.close(timeout=30)
            actor.close()


def test_the_driver_waits_for_the_engines_stop_not_for_its_files(local_coordinator, tmp_path):
    """A profiled rollout step: the driver's ``rollout()`` returns once the colocated engine
    has stopped, and the wait for its files (an engine's files settle for ``settle_s``, 2 s by
    default) goes on after; it used to be the driver's, about 2 s of every profiled step that
    the job's own timeline showed as idle."""
    import time

    from profd.rollout.relocate import FlushWait

    slow_settle = FlushWait(
        settle_s=4.0, gz_settle_s=4.0, poll_s=0.1, timeout_s=60, first_file_timeout_s=30
    )
    fake, agent = vllm_pair(tmp_path, replica=0, tp=1, flush=slow_settle)
    with fake:
        svc = RolloutService(
            agent, replicas=1, colocated=True, find_link=local_coordinator.link,
            poll_timeout_s=1.0,
        ).start()  # fmt: skip
        ctl = Controller(lambda: local_coordinator, timeout_s=10, rollout_timeout_s=60)
        try:
            wait_until(lambda: svc.connected, 10, what="replica registered")
            with ctl.step(1):
                pass
            view = local_coordinator.call(
                "create_session", {"next_steps": 1, "roles": {"rollout": {"all_ranks": True}}}
            )
            (step,) = view.steps
            waits = {}
            for n in range(2, step + 3):  # the window's step, and two after it
                started = time.monotonic()
                with ctl.step(n):  # begin, rollout, training, end: all the driver waits for
                    with ctl.rollout():
                        fake.advance(2)
                    torch.ones(8).sum()
                waits[n] = time.monotonic() - started
            collecting = local_coordinator.call("get_session", view.session_id).state.value
            view = wait_terminal(local_coordinator, view.session_id, timeout=60)
        finally:
            ctl.close()
            svc.close(timeout=30)
    assert view.state.value == "done", view.reason
    assert [t.steps for t in view.traces] == [[step]]
    assert collecting != "done"  # the driver went on while the files settled
    # the stop, not the 4 s settle of its files: neither the step nor the next ones wait
    assert max(waits[step], waits[step + 1], waits[step + 2]) < 3.0, waits


@contextmanager
def slow_files_replica(owner: Any, tmp_path: Path, settle_s: float) -> Iterator[Any]:
    """A replica of its own devices (one vLLM fake, tp=1) whose files settle for
    ``settle_s``, connected, and the driver (profd's delivery timeout, 1 s) past step 1;
    yields (fake, service, controller). The service closes at the end, files or not."""
    from profd.rollout.relocate import FlushWait

    flush = FlushWait(
        settle_s=settle_s, gz_settle_s=settle_s, poll_s=0.1, timeout_s=60, first_file_timeout_s=30
    )
    fake, agent = vllm_pair(tmp_path, replica=0, tp=1, flush=flush)
    with fake:
        svc = RolloutService(agent, replicas=1, find_link=owner.link, poll_timeout_s=1.0).start()
        ctl = Controller(lambda: owner)
        try:
            wait_until(lambda: svc.connected, 10, what="replica registered")
            with ctl.step(1):
                pass
            yield fake, svc, ctl
        finally:
            ctl.close()
            svc.close(timeout=30)


def test_a_later_groups_window_starts_while_the_earlier_ones_files_settle(
    local_coordinator, tmp_path
):
    """Two steps in two groups on a replica of its own: the second group's engine window
    starts when the driver announces its step, not once the first group's files settled
    (it started seconds late, after the driver had gone on: the start of the step's
    generation was not in its trace, and the driver warned that the step reached the
    replica late). Each group's trace holds its own step."""
    import time

    with slow_files_replica(local_coordinator, tmp_path, 4.0) as (fake, _, ctl):
        view = local_coordinator.call(
            "create_session", {"next_steps": 2, "roles": {"rollout": {"all_ranks": True}}}
        )
        first, second = view.steps
        assert [list(g) for g in view.groups] == [[first], [second]]
        starts, waits = {}, {}
        for n in range(2, second + 2):
            began = time.monotonic()
            with ctl.step(n):  # the replica's window is to be recording by now
                starts[n] = sum(1 for _, path, _ in fake.requests if path == "/start_profile")
                fake.advance(2)
            waits[n] = time.monotonic() - began  # (its end waits for the engine's stop)
        view = wait_terminal(local_coordinator, view.session_id, timeout=60)
    assert view.state.value == "done", view.reason
    assert (starts[first], starts[second]) == (1, 2), starts
    assert sorted(t.steps for t in view.traces) == [[first], [second]]
    # the engine's traces have no step marks: summarize takes each one's step from profd's
    # record beside it (they were one row, step None)
    from profd.analysis.summary import summarize_dir

    summary = summarize_dir(view.save_dir)
    rows = [r for r in summary.stage_times if r.track.startswith("rollout")]
    assert sorted(r.step for r in rows) == [first, second], rows
    # no step waited for a 4 s settle: not the next group's start, nor its stop (the
    # earlier window's files are told apart from the later one's as the later one starts)
    assert max(waits.values()) < 3.0, waits


def test_a_replica_closed_while_its_files_settle_still_hands_them_in(local_coordinator, tmp_path):
    """The service closes (the job ends) right after the window's engine stopped: its
    collection, on a thread of its own, still ends the part with the trace."""
    with slow_files_replica(local_coordinator, tmp_path, 2.0) as (fake, _, ctl):
        view = local_coordinator.call(
            "create_session", {"next_steps": 1, "roles": {"rollout": {"all_ranks": True}}}
        )
        for n in range(2, view.steps[0] + 1):
            with ctl.step(n):
                fake.advance(2)
        assert local_coordinator.call("get_session", view.session_id).state.value != "done"
    # (closed with the files still settling)
    view = wait_terminal(local_coordinator, view.session_id, timeout=30)
    assert view.state.value == "done", view.reason
    assert [t.steps for t in view.traces] == [list(view.steps)]
