"""Several nodes, and the faults a long-running cluster sees (real Ray processes).

The session's Ray is a two-node ``ray.cluster_utils.Cluster`` (see conftest): the driver,
coordinator and sidecar live on the head; workers are placed on node B with its custom
resource. Tests that remove a node add a third one first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from profd.core.settings import SidecarConfig

from helpers import AUTH, TOKEN, coordinator_settings, wait_until

pytestmark = pytest.mark.slow


def place(resource: str | None) -> dict[str, Any]:
    return {"resources": {resource: 0.01}} if resource else {}


def start_workers(specs: list[tuple[str, int, int, str | None]]) -> list[Any]:
    import ray

    from profd.demo.workload import DemoWorker

    made = [
        ray.remote(DemoWorker).options(num_cpus=0, **place(res)).remote(role, rank, world, seed=5)
        for role, rank, world, res in specs
    ]
    ray.get([w.ready.remote() for w in made], timeout=120)
    return made


def head_budget(ray_session: Any) -> Any:
    """The step budget actor, pinned to the head (it must outlive removed nodes)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from profd.demo.workload import StepBudget

    strategy = NodeAffinitySchedulingStrategy(ray_session.node_id, soft=False)
    budget = ray.remote(StepBudget).options(num_cpus=0, scheduling_strategy=strategy).remote()
    assert ray.get(budget.node_id.remote()) == ray_session.node_id
    return budget


def node_of(worker: Any) -> str:
    import ray

    return ray.get(worker.node_id.remote())


def session_done(url: str, sid: str, timeout: float = 90) -> dict[str, Any]:
    def finished() -> Any:
        v = httpx.get(f"{url}/api/v1/sessions/{sid}").json()
        return v if v["state"] not in ("pending", "armed", "recording", "collecting") else None

    try:
        return wait_until(finished, timeout, 0.2, what=f"session {sid} to end")
    except AssertionError:
        v = httpx.get(f"{url}/api/v1/sessions/{sid}").json()
        agents = httpx.get(f"{url}/api/v1/agents").json()["data"]
        raise AssertionError(
            f"{v['state']}: {[(p['rank'], p['state'], p['reason']) for p in v['targets']]}; "
            f"agents {[(a['rank'], a['state'], a['last_seen_s']) for a in agents]}"
        ) from None


UPLOADS = Path("/tmp/profd-test-uploads")  # an upload prefix the sidecar allows


@pytest.fixture
def sidecar(ray_coordinator) -> Any:
    import ray

    from profd.actors import get_or_create_sidecar

    config = SidecarConfig(
        port=0, token=TOKEN, allow_hook_commands=True, upload_prefixes=(f"file://{UPLOADS}",)
    )
    handle, _ = get_or_create_sidecar(config, detached=False)
    yield ray.get(handle.address.remote())["url"]  # the handle keeps the actor alive
    del handle


def test_traces_stay_on_their_node_and_download_through_it(sidecar, ray_session) -> None:
    import shutil
    import uuid

    import ray

    url = sidecar
    bucket = f"file://{UPLOADS}/{uuid.uuid4().hex}"
    ws = start_workers([("actor", 0, 2, "node_b"), ("actor", 1, 2, "node_b")])
    node_b = node_of(ws[0])
    assert node_b != ray_session.node_id
    budget = head_budget(ray_session)
    ray.get(budget.extend_to.remote(40))
    try:
        runs = [w.run.remote(3, 0.3, 1, budget) for w in ws]
        wait_until(  # both agents: a session targets the agents registered when it starts
            lambda: (
                sum(
                    1 for a in httpx.get(f"{url}/api/v1/agents").json()["data"] if a["current_step"]
                )
                == 2
            ),
            60,
            what="stepping",
        )
        r = httpx.post(
            f"{url}/api/v1/sessions",
            headers=AUTH,
            json={
                "next_steps": 1,
                "roles": {"actor": {"all_ranks": True}},
                "finish_hook_cmd": 'echo node=$PROFD_NODE files=$(echo "$PROFD_TRACES" | wc -l)',
                "upload_uri": bucket,
            },
        )
        assert r.status_code == 201, r.text
        view = session_done(url, r.json()["session_id"])
        ray.get(budget.extend_to.remote(0))
        ray.get(runs, timeout=120)
    finally:
        for w in ws:
            ray.kill(w)
    assert view["state"] == "done", view["reason"]
    assert len(view["traces"]) == 2 and {t["node_id"] for t in view["traces"]} == {node_b}
    listing = httpx.get(f"{url}/api/v1/traces", params={"session_id": view["session_id"]})
    assert all(t["node_ip"] and t["bytes"] > 0 for t in listing.json()["data"])
    (hook,) = view["hooks"]  # one run for node B, where both agents live
    assert hook["node"] == node_b and hook["exit_code"] == 0
    assert f"node={node_b} files=2" in hook["output"]
    t = view["traces"][0]
    r = httpx.get(f"{url}/api/v1/traces/{t['trace_id']}/download")
    assert r.status_code == 200 and r.headers["x-profd-node"] == node_b
    assert r.content == Path(t["path"]).read_bytes()  # streamed from node B by Ray tasks
    summary = httpx.get(f"{url}/api/v1/sessions/{view['session_id']}/summary").json()
    assert sorted(tr["rank"] for tr in summary["tracks"]) == [0, 1]  # read on node B
    assert "update_actor" in summary["stages"]
    # each trace uploaded once, by a task on the node that holds it
    uploads = view["uploads"]
    assert len(uploads) == 2 and {u["state"] for u in uploads} == {"done"}
    assert {u["node_id"] for u in uploads} == {node_b}
    for tr in view["traces"]:
        copy = Path(bucket.removeprefix("file://")) / view["session_id"] / tr["file_name"]
        assert copy.read_bytes() == Path(tr["path"]).read_bytes()
    shutil.rmtree(bucket.removeprefix("file://"), ignore_errors=True)


def test_removed_node_and_killed_agent_end_as_lost(sidecar, cluster, ray_session) -> None:
    """Node C is removed and a worker on node B is killed mid-window; a third worker goes on.
    The session ends partial, naming both, and the survivor's traces are intact."""
    import ray

    url = sidecar
    node_c = cluster.add_node(num_cpus=1, resources={"node_c": 1})
    cluster.wait_for_nodes()
    ws = start_workers(
        [
            ("actor", 0, 3, "node_b"),
            ("actor", 1, 3, "node_b"),
            ("actor", 2, 3, "node_c"),
        ]
    )
    budget = head_budget(ray_session)  # must outlive node C
    ray.get(budget.extend_to.remote(60))
    try:
        runs = [w.run.remote(3, 0.3, 1, budget) for w in ws]
        wait_until(
            lambda: (
                sum(
                    1 for a in httpx.get(f"{url}/api/v1/agents").json()["data"] if a["current_step"]
                )
                == 3
            ),
            60,
            what="stepping",
        )
        r = httpx.post(
            f"{url}/api/v1/sessions",
            headers=AUTH,
            json={"next_steps": 6, "roles": {"actor": {"all_ranks": True}}},
        )
        sid, steps = r.json()["session_id"], r.json()["steps"]

        def recording() -> bool:
            v = httpx.get(f"{url}/api/v1/sessions/{sid}").json()
            return sum(1 for p in v["targets"] if p["recorded_steps"]) == 3

        wait_until(recording, 60, 0.1, what="every target recorded a step")
        cluster.remove_node(node_c)  # rank 2 goes away with its node
        ray.kill(ws[1])  # rank 1's process dies
        view = session_done(url, sid, timeout=120)
        ray.get(budget.extend_to.remote(0))
        survivor = ray.get(runs[0], timeout=120)
    finally:
        for w in ws:
            ray.kill(w)
    assert survivor["steps"] >= steps[-1]  # training went on
    assert view["state"] == "partial"
    parts = {p["rank"]: p for p in view["targets"]}
    assert parts[0]["state"] == "done" and parts[0]["recorded_steps"] == steps
    # found by Ray's nodes (not the 30 s heartbeat): the process is gone, or its node left
    assert parts[1]["state"] == "lost" and "exited" in parts[1]["reason"], parts[1]
    assert parts[2]["state"] == "lost", parts[2]
    assert "left the Ray cluster" in parts[2]["reason"] or "exited" in parts[2]["reason"]
    for t in view["traces"]:
        assert Path(t["path"]).is_file()


def test_coordinator_killed_mid_session_restarts_with_its_state(cluster, ray_session, tmp_path):
    import ray

    from profd.actors import get_or_create_coordinator
    from profd.cli.ray_cluster import stop_services
    from profd.core.ray_env import find_coordinator

    stop_services()
    wait_until(lambda: find_coordinator() is None, 30)
    settings = coordinator_settings(tmp_path, state_dir=str(tmp_path / "state"))
    coord, _ = get_or_create_coordinator(settings, detached=False)
    ws = start_workers([("actor", 0, 1, "node_b")])
    budget = head_budget(ray_session)
    ray.get(budget.extend_to.remote(60))
    try:
        run = ws[0].run.remote(3, 0.3, 1, budget)
        # the agent registers from its background thread: the list may be empty at first
        wait_until(lambda: any(a.current_step for a in ray.get(coord.list_agents.remote())), 60)
        view = ray.get(coord.create_session.remote({"next_steps": 4}))
        wait_until(lambda: ray.get(coord.get_session.remote(view.session_id)).traces, 60)
        pid_before = ray.get(coord.pid.remote())
        ray.kill(coord, no_restart=False)  # Ray restarts it from the same settings
        wait_until(lambda: _pid(coord) not in (None, pid_before), 60, what="a new coordinator")
        final = wait_until(
            lambda: (
                (v := ray.get(coord.get_session.remote(view.session_id))).state.is_terminal and v
            ),
            90,
            what="session end after restart",
        )
        ray.get(budget.extend_to.remote(0))
        ray.get(run, timeout=120)
    finally:
        for w in ws:
            ray.kill(w)
        stop_services()
    assert final.state.value == "done", final.reason
    assert sorted(t.steps[0] for t in final.traces) == view.steps


def _pid(handle: Any) -> int | None:
    import ray

    try:
        return ray.get(handle.pid.remote(), timeout=5)
    except Exception:  # restarting: unavailable for a moment
        return None
