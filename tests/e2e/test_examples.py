"""The integrations in ``examples/`` run on the test session's Ray and leave real traces.

* Ray Train: a ``TorchTrainer`` with 2 CPU workers attaches each worker with its world rank;
* verl style: a single-controller driver (worker groups, stages marked in worker methods, the
  driver announcing the step) with a verl config given to profd unchanged;
* standalone, as ``examples/README.md`` shows: no ``--address``, so the example starts its
  own Ray on 127.0.0.1 with profd's loopback settings.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from profd.backends.torch_backend import read_trace
from profd.core.naming import parse_trace_name

from helpers import wait_until

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py``; Ray ships its functions and classes by value (the
    workers cannot import the examples directory, just as for a user's own script)."""
    from ray import cloudpickle

    spec = importlib.util.spec_from_file_location(f"profd_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module


def session_end(coordinator: Any, session_id: str, timeout: float = 60) -> Any:
    import ray

    def terminal() -> Any:
        view = ray.get(coordinator.get_session.remote(session_id))
        return view if view.state.is_terminal else None

    return wait_until(terminal, timeout, 0.2, what=f"session {session_id} terminal")


def annotations(path: str) -> list[str]:
    trace = read_trace(path)
    return [e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]


RAY_TRAIN_ACTORS = ("TrainController", "DatasetManager", "RayTrainWorker")


@pytest.fixture
def ray_train_cleanup(ray_session: Any) -> Any:
    """Ray Train leaves its controller (owned by this driver; its SIGINT handler holds the
    handle) and Ray Data's detached autoscaling coordinator behind; the session's Ray is
    shared, so they go after the test, and pytest gets its SIGINT handler back."""
    import gc
    import signal

    import ray

    sigint = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, sigint)
    gc.collect()  # the driver's last handle on the controller
    try:
        ray.kill(ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator"))
    except ValueError:
        pass

    def left() -> list[str]:
        return [
            a["ActorClassName"]
            for a in ray._private.state.actors().values()
            if a["State"] == "ALIVE"
            and a["ActorClassName"] in (*RAY_TRAIN_ACTORS, "_AutoscalingCoordinatorActor")
        ]

    wait_until(lambda: not left(), 30, 0.2, what="Ray Train's actors gone")


def test_ray_train_torchtrainer_workers_attach_with_their_world_rank(
    ray_coordinator: Any, tmp_path: Path, ray_train_cleanup: Any
) -> None:
    example = load_example("ray_train_torchtrainer")
    out = example.main(steps=5, num_workers=2, profile_steps=[3], storage_path=str(tmp_path / "rt"))
    assert out["error"] is None and out["state"] == "done" and len(out["traces"]) == 2
    view = session_end(ray_coordinator, out["session_id"])
    assert view.state.value == "done", view.reason
    assert sorted((t.role, t.rank) for t in view.targets) == [("trainer", 0), ("trainer", 1)]
    assert sorted(t.rank for t in view.traces) == [0, 1]
    pids = set()
    for t in view.traces:
        assert t.steps == [3] and Path(t.path).is_file()
        parts = parse_trace_name(Path(t.path).name)
        assert (parts.rank, parts.world_size, parts.step) == (t.rank, 2, "3")
        pids.add(parts.pid)
        trace = read_trace(t.path)
        assert trace["distributedInfo"]["rank"] == t.rank
        assert trace["distributedInfo"]["world_size"] == 2
        assert trace["profd"]["role"] == "trainer" and trace["profd"]["rank"] == t.rank
        names = annotations(t.path)
        assert names.count("step3") == 1 and "step2" not in names and "step4" not in names
        assert {"load_batch", "forward_backward", "optimizer_step", "mini_batch1"} <= set(names)
        ops = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "cpu_op"}
        assert any("allreduce" in op.lower() for op in ops), "DDP's all-reduce is in the trace"
    assert len(pids) == 2  # two Ray Train worker processes


def test_single_controller_driver_with_a_verl_config(ray_coordinator: Any, tmp_path: Path) -> None:
    """The verl-style driver run as a user runs it (its own process, the session's Ray), with
    verl's own profiler config: the actor group on every rank, the critic in discrete mode."""
    import json

    import ray

    address = ray.get_runtime_context().gcs_address
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "single_controller.py"),
            "--address",
            address,
            "--steps",
            "4",
            "--config",
            str(EXAMPLES / "verl_config.yaml"),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["steps"] == 4 and out["closed"] == [True, True, True]
    assert out["state"] == "done" and len(out["traces"]) == 8  # what the script prints
    view = session_end(ray_coordinator, out["session_id"])
    assert view.state.value == "done", view.reason
    assert view.steps == [2, 3]
    save_dir = Path(view.save_dir)
    assert save_dir == tmp_path / "outputs" / "profile" / view.session_id  # verl's save_path
    by_role: dict[str, list[Any]] = {}
    for t in view.traces:
        assert Path(t.path).parent == save_dir
        by_role.setdefault(t.role, []).append(t)
    # actor.profiler governs the colocated actor_rollout_ref worker: every rank, one per step
    actor = sorted((t.rank, t.steps[0], t.scope) for t in by_role["actor_rollout_ref"])
    assert actor == [(0, 2, "train"), (0, 3, "train"), (1, 2, "train"), (1, 3, "train")]
    for t in by_role["actor_rollout_ref"]:
        names = annotations(t.path)
        step = t.steps[0]
        assert names.count(f"step{step}") == 1 and f"step{step + 1}" not in names
        assert {
            "rollout_generate_sequences",
            "actor_compute_log_prob",
            "ref_compute_log_prob",
            "actor_update",
            "mini_batch1",
        } <= set(names)
        assert names.count("actor_update") == 1  # that step's stages only
        assert read_trace(t.path)["distributedInfo"]["rank"] == t.rank
        parts = parse_trace_name(Path(t.path).name)  # verl's stem: prefix, scope, step, rank
        assert parts.head == ("actor-rollout-ref", "train") and parts.step == str(step)
        assert (parts.rank, parts.world_size, parts.parallel) == (t.rank, 2, {"dp": t.rank})
    # critic.profiler: discrete, so one file per stage call, named by the stage
    critic = sorted((t.rank, t.steps[0], t.scope) for t in by_role["critic"])
    assert critic == [
        (0, 2, "compute_values"),
        (0, 2, "update_critic"),
        (0, 3, "compute_values"),
        (0, 3, "update_critic"),
    ]
    for t in by_role["critic"]:
        assert t.scope in annotations(t.path)
        parts = parse_trace_name(Path(t.path).name)
        assert parts.head == ("critic", t.scope.replace("_", "-"))
    assert set(by_role) == {"actor_rollout_ref", "critic"}


def test_verl_config_example_maps_as_verl_reads_it() -> None:
    """The example config, as ``profd.start_session`` and ``profd profile --config`` read it."""
    from profd.cli.requests import build_request
    from profd.driver.launch import load_request

    req = load_request(EXAMPLES / "verl_config.yaml")
    assert req.tool.value == "torch" and req.steps == (2, 3)
    assert req.save_path == "outputs/profile" and not req.profile_continuous_steps
    assert set(req.roles) == {"actor", "rollout", "critic"}  # ref.profiler.enable is false
    assert req.roles["actor"].all_ranks and not req.roles["actor"].discrete
    assert req.roles["actor"].tool_config.torch.contents == ("cpu",)
    assert req.roles["critic"].ranks == (0,) and req.roles["critic"].discrete
    assert req.roles["rollout"].all_ranks  # follows the actor
    # `profd profile --config verl_config.yaml --next-steps 2`: verl's roles, the next 2 steps
    body = build_request(
        EXAMPLES / "verl_config.yaml", None, None, 2, [], None, False, False, None, False
    )
    assert body["next_steps"] == 2 and "steps" not in body
    assert set(body["roles"]) == {"actor", "rollout", "critic"}


def test_single_controller_standalone_starts_its_own_loopback_ray(tmp_path: Path) -> None:
    """``python examples/single_controller.py --config examples/verl_config.yaml`` as the
    README runs it: no ``--address``, no ``RAY_ADDRESS`` and none of the loopback variables in
    the environment, so the example itself must start a private Ray on 127.0.0.1 (profd's
    ``init_local_ray``), record verl's window and stop that Ray when it exits."""
    import json

    from profd.core.ray_env import LOOPBACK_ENV

    env = {k: v for k, v in os.environ.items() if k not in (*LOOPBACK_ENV, "RAY_ADDRESS")}
    env["PYTHONUNBUFFERED"] = "1"
    r = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "single_controller.py"),
            "--steps",
            "3",  # verl_config.yaml profiles steps 2 and 3
            "--config",
            str(EXAMPLES / "verl_config.yaml"),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Started a local Ray instance" in r.stderr  # its own Ray, not a cluster it found
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ray_address"].startswith("127.0.0.1:")  # every port on loopback
    assert out["steps"] == 3 and out["closed"] == [True, True, True]
    assert out["state"] == "done"
    save_dir = tmp_path / "outputs" / "profile" / out["session_id"]  # verl's save_path
    files = sorted(save_dir.glob("*.json.gz"))
    assert sorted(map(str, files)) == sorted(out["traces"])
    # the actor group on both ranks, the critic in discrete mode: 2 steps x (2 + 2) files
    heads = sorted(parse_trace_name(f.name).head for f in files)
    assert heads == sorted(
        [("actor-rollout-ref", "train")] * 4
        + [("critic", "compute-values")] * 2
        + [("critic", "update-critic")] * 2
    )
    for f in files:
        parts = parse_trace_name(f.name)
        assert parts.step in ("2", "3")
        assert read_trace(str(f))["distributedInfo"]["rank"] == parts.rank
        names = annotations(str(f))
        if parts.head[0] == "critic":  # discrete: the stage's own window
            assert parts.head[1].replace("-", "_") in names
        else:
            assert names.count(f"step{parts.step}") == 1


def test_single_controller_given_an_address_where_no_ray_answers_says_so(tmp_path: Path) -> None:
    """A mistyped ``--address``: one line naming it, exit 1, no traceback."""
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / "single_controller.py"), "--address", "127.0.0.1:1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == "error: no Ray cluster answers at 127.0.0.1:1"
