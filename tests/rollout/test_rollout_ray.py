"""Rollout replicas in a real Ray job: each replica's engine (a fake vLLM or SGLang server) and
its rollout agent live in their own Ray actor, the training worker in another, and the single
controller in the driver — the shape of a verl job. Targeting by global rank, relocation of
both engines' files, and an engine failure that touches only its replica."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from helpers import wait_until

pytestmark = pytest.mark.slow


def wait_ended(coord: Any, sid: str, drive: Any, timeout: float = 90) -> Any:
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = ray.get(coord.get_session.remote(sid))
        if view.state.is_terminal:
            return view
        drive()
    raise AssertionError(f"session {sid} did not end: {view.state.value} {view.reason}")


def test_vllm_and_sglang_replicas_in_ray_actors(ray_coordinator, tmp_path: Path) -> None:
    import ray

    from profd.demo.replica_host import FakeReplicaHost
    from profd.demo.workload import DemoWorker
    from profd.driver.controller import Controller

    coord = ray_coordinator
    host = ray.remote(FakeReplicaHost).options(num_cpus=0)
    root = str(tmp_path / "engines")
    hosts = [host.remote("vllm", 0, 2, 2, root), host.remote("sglang", 1, 2, 2, root)]
    worker = ray.remote(DemoWorker).options(num_cpus=0).remote("actor", 0, 1, seed=1)
    try:
        ray.get(worker.ready.remote(), timeout=120)
        wait_until(lambda: all(ray.get([h.connected.remote() for h in hosts])), 60)
        wait_until(lambda: len(ray.get(coord.list_agents.remote())) == 3, 60, what="agents")
        ctl = Controller()
        step = [0]

        def drive() -> None:  # one step of the job: generation on the replicas, then training
            step[0] += 1
            with ctl.step(step[0]):
                ray.get([h.advance.remote(3) for h in hosts])
                ray.get(worker.work.remote())

        drive()
        # the replicas registered with their job: they show the driver's step as theirs
        views = ray.get(coord.list_agents.remote())
        replicas = [v for v in views if v.role == "rollout"]
        assert len(replicas) == 2
        assert all((v.current_step, v.step_source) == (1, "driver") for v in replicas), replicas
        request = {
            "next_steps": 1,
            "roles": {"actor": {"all_ranks": True}, "rollout": {"ranks": [0, 3]}},
        }
        view = ray.get(coord.create_session.remote(request))
        assert sorted((t.role, t.rank) for t in view.targets) == [
            ("actor", 0),
            ("rollout", 0),
            ("rollout", 1),
        ]
        view = wait_ended(coord, view.session_id, drive)
        assert view.state.value == "done", view.reason
        rollout = sorted(t.file_name for t in view.traces if t.role == "rollout")
        assert len(rollout) == 2
        # vLLM names its files rank<k>, SGLang -TP-<k>: each read back to the global rank
        assert re.match(r"rollout-replica0-globalrank0_rank0\.", rollout[0]), rollout
        assert re.match(r"rollout-replica1-globalrank3_.*TP-1", rollout[1]), rollout
        save_dir = Path(view.save_dir)
        assert all((save_dir / n).is_file() for n in rollout)
        assert any((save_dir / "rollout-replica1").iterdir())  # the tp peer, kept

        ray.get(hosts[1].kill_engine.remote())  # SGLang's endpoint goes away
        view = ray.get(coord.create_session.remote(request))
        view = wait_ended(coord, view.session_id, drive)
        assert view.state.value == "partial"
        parts = {(p.role, p.rank): p for p in view.targets}
        assert parts[("actor", 0)].state.value == "done"
        assert parts[("rollout", 0)].state.value == "done"
        assert parts[("rollout", 1)].state.value in ("failed", "missed")
        assert "start failed" in parts[("rollout", 1)].reason
        drive()  # the job goes on
    finally:
        for h in hosts:
            try:
                ray.get(h.close.remote(), timeout=60)
            except Exception:
                pass
            ray.kill(h)
        ray.get(worker.close.remote(), timeout=60)
        ray.kill(worker)


def test_colocated_replicas_stop_before_training_in_a_ray_job(ray_coordinator, tmp_path) -> None:
    """Replicas sharing devices with training (colocated): the driver's rollout() mark ends
    the engines' window before any training stage of the step runs."""
    import ray

    from profd.demo.replica_host import FakeReplicaHost
    from profd.demo.workload import DemoWorker
    from profd.driver.controller import Controller

    coord = ray_coordinator
    host = ray.remote(FakeReplicaHost).options(num_cpus=0)
    root = str(tmp_path / "engines")
    hosts = [host.remote("vllm", r, 1, 2, root, colocated=True) for r in range(2)]
    worker = ray.remote(DemoWorker).options(num_cpus=0).remote("actor", 0, 1, seed=2)
    stops_before_training: dict[int, int] = {}
    try:
        ray.get(worker.ready.remote(), timeout=120)
        wait_until(lambda: len(ray.get(coord.list_agents.remote())) == 3, 60, what="agents")
        ctl = Controller()
        step = [0]

        def drive() -> None:
            step[0] += 1
            with ctl.step(step[0]):
                with ctl.rollout():
                    ray.get([h.advance.remote(3) for h in hosts])
                stops = ray.get([h.engine_calls.remote("/stop_profile") for h in hosts])
                stops_before_training[step[0]] = sum(stops)
                ray.get(worker.work.remote())

        drive()
        # the replicas registered with their job: they show the driver's step as theirs
        views = ray.get(coord.list_agents.remote())
        replicas = [v for v in views if v.role == "rollout"]
        assert len(replicas) == 2
        assert all((v.current_step, v.step_source) == (1, "driver") for v in replicas), replicas
        request = {"next_steps": 1, "roles": {"actor": {}, "rollout": {"all_ranks": True}}}
        view = ray.get(coord.create_session.remote(request))
        (window,) = view.steps
        view = wait_ended(coord, view.session_id, drive)
        assert view.state.value == "done", view.reason
        assert stops_before_training[window] == 2  # both engines stopped before training ran
        assert sorted(t.role for t in view.traces) == ["actor", "rollout", "rollout"]
    finally:
        for h in hosts:
            try:
                ray.get(h.close.remote(), timeout=60)
            except Exception:
                pass
            ray.kill(h)
        ray.get(worker.close.remote(), timeout=60)
        ray.kill(worker)
