"""End to end on a real local Ray: coordinator and sidecar actors, workers in their own
processes, a session over HTTP, and the trace files checked for their contents."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from profd.backends.torch_backend import read_trace
from profd.core.naming import parse_trace_name
from profd.core.settings import SidecarConfig

from helpers import AUTH, TOKEN, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def services(ray_coordinator, tmp_path) -> Any:
    """The real sidecar actor (uvicorn inside Ray) next to the per-test coordinator."""
    import ray

    from profd.actors import get_or_create_sidecar

    handle, created = get_or_create_sidecar(SidecarConfig(port=0, token=TOKEN), detached=False)
    assert created
    url = ray.get(handle.address.remote())["url"]
    yield url, handle
    # the coordinator fixture stops both actors


def workers(specs: list[tuple[str, int, int]]) -> list[Any]:
    import ray

    from profd.demo.workload import DemoWorker

    remote = ray.remote(DemoWorker).options(num_cpus=0)
    made = [remote.remote(role, rank, world, seed=1) for role, rank, world in specs]
    ray.get([w.ready.remote() for w in made], timeout=120)
    return made


def session_end(url: str, sid: str) -> dict[str, Any]:
    """The session's view once it ended (over HTTP)."""

    def finished() -> Any:
        v = httpx.get(f"{url}/api/v1/sessions/{sid}").json()
        return v if v["state"] not in ("pending", "armed", "recording", "collecting") else None

    return wait_until(finished, 90, 0.2, what="session end")


def test_session_over_http_profiles_live_workers(services) -> None:
    import ray

    url, _ = services
    ws = workers([("actor_rollout_ref", 0, 2), ("actor_rollout_ref", 1, 2), ("critic", 0, 1)])
    try:
        from profd.demo.workload import StepBudget

        budget = ray.remote(StepBudget).options(num_cpus=0).remote()
        runs = [w.run.remote(8, 0.5, 1, budget) for w in ws]

        def stepping() -> Any:
            data = httpx.get(f"{url}/api/v1/agents").json()["data"]
            return len([a for a in data if a["current_step"] is not None]) == 3

        wait_until(stepping, 60, 0.05, what="workers stepping")
        r = httpx.post(
            f"{url}/api/v1/sessions",
            json={"next_steps": 2, "roles": {"actor": {"all_ranks": True}, "critic": {}}},
            headers=AUTH,
        )
        assert r.status_code == 201, r.text
        view = r.json()
        sid, steps = view["session_id"], view["steps"]
        assert len(steps) == 2 and steps[1] == steps[0] + 1
        assert {t["role_block"] for t in view["targets"]} == {"actor", "critic"}
        ray.get(budget.extend_to.remote(steps[-1] + 1))

        view = session_end(url, sid)
        assert view["state"] == "done", view["reason"]
        results = ray.get(runs, timeout=120)
        assert all(r["traces_written"] for r in results)
    finally:
        for w in ws:
            ray.kill(w)
    traces = httpx.get(f"{url}/api/v1/traces", params={"session_id": sid}).json()["data"]
    assert len(traces) == 6  # 3 workers x 2 steps
    pids = set()
    for t in traces:
        path = Path(t["path"])
        assert path.is_file() and path.stat().st_size == t["bytes"]
        parts = parse_trace_name(path.name)
        assert parts.rank == t["rank"] and parts.step == str(t["steps"][0])
        pids.add(parts.pid)
        trace = read_trace(path)
        names = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"}
        assert trace["distributedInfo"]["rank"] == t["rank"]
        assert trace["profd"]["session_id"] == sid and trace["profd"]["role"] == t["role"]
        assert not any("ProfilerStep" in e.get("name", "") for e in trace["traceEvents"])
        if t["role"] == "critic":
            assert {"compute_values", "update_critic", "mini_batch1", "micro_batch1"} <= names
        else:
            assert {
                "generate_sequences",
                "compute_log_prob",
                "ref_compute_log_prob",
                "update_actor",
                "mini_batch0",
                "micro_batch1",
            } <= names
    assert len(pids) == 3  # three worker processes


def test_a_py_spy_window_in_a_ray_worker_writes_its_profile(services) -> None:
    """A Ray worker runs with SIGINT blocked and py-spy, its child, inherited that: told to
    stop with SIGINT it never wrote its profile (the window failed after 120 s)."""
    import json

    import ray

    from profd.demo.workload import StepBudget

    url, _ = services
    (w,) = workers([("actor_rollout_ref", 0, 1)])
    try:
        budget = ray.remote(StepBudget).options(num_cpus=0).remote()
        run = w.run.remote(4, 0.3, 1, budget)

        def stepping() -> Any:
            data = httpx.get(f"{url}/api/v1/agents").json()["data"]
            return [a for a in data if a["current_step"] is not None]

        wait_until(stepping, 60, 0.05, what="the worker stepping")
        idle = {"tool_config": {"py_spy": {"idle": True}}}  # a step that mostly sleeps
        body = {"tool": "py_spy", "next_steps": 1, "roles": {"actor": idle}}
        r = httpx.post(f"{url}/api/v1/sessions", json=body, headers=AUTH)
        assert r.status_code == 201, r.text
        sid, steps = r.json()["session_id"], r.json()["steps"]
        ray.get(budget.extend_to.remote(steps[-1] + 1))

        view = session_end(url, sid)
        assert view["state"] == "done", view["reason"]
        ray.get(run, timeout=60)
    finally:
        ray.kill(w)
    (trace,) = httpx.get(f"{url}/api/v1/traces", params={"session_id": sid}).json()["data"]
    assert trace["file_name"].endswith(".speedscope.json") and trace["steps"] == steps
    profile = json.loads(Path(trace["path"]).read_text())
    assert "speedscope" in profile["$schema"] and profile["shared"]["frames"]


def test_errors_cross_the_actor_boundary_with_their_status(services) -> None:
    url, _ = services
    ws = workers([("critic", 0, 1)])
    try:
        wait_until(lambda: httpx.get(f"{url}/api/v1/agents").json()["count"] == 1, 30, what="agent")
        headers = AUTH
        first = httpx.post(f"{url}/api/v1/sessions", json={"steps": [50]}, headers=headers)
        assert first.status_code == 201
        r = httpx.post(f"{url}/api/v1/sessions", json={"steps": [51]}, headers=headers)
        assert r.status_code == 409 and first.json()["session_id"] in r.json()["message"]
        r = httpx.post(
            f"{url}/api/v1/sessions",
            json={"next_steps": 1, "roles": {"nobody": {}}},
            headers=headers,
        )
        assert r.status_code == 422 and r.json()["fields"][0]["field"] == "roles.nobody"
        assert httpx.get(f"{url}/api/v1/sessions/missing").status_code == 404
    finally:
        for w in ws:
            import ray

            ray.kill(w)


def test_worker_without_a_coordinator_completes_its_loop(ray_session, tmp_path) -> None:
    import ray

    from profd.cli.ray_cluster import stop_services
    from profd.core.ray_env import find_coordinator

    stop_services()
    wait_until(lambda: find_coordinator() is None, 30, what="no coordinator")
    (w,) = workers([("actor", 0, 1)])
    try:
        result = ray.get(w.run.remote(4, 0.0), timeout=120)
    finally:
        ray.kill(w)
    assert result["steps"] == 4 and result["final_loss"] is not None
    assert result["traces_written"] is True


def test_the_demo_never_uses_or_stops_a_running_profd(ray_session, tmp_path) -> None:
    """`profd demo --address` on a cluster where profd is up used that profd (its triggers,
    another token) and then stopped it at its end, taking the user's profd down. It
    refuses now, naming why, and the profd that runs there goes on."""
    import io

    from rich.console import Console

    from profd.cli.ray_cluster import start_services, stop_services
    from profd.core.ray_env import find_coordinator
    from profd.core.settings import ProfdSettings, SidecarConfig
    from profd.demo.run import DemoRefused, run_demo

    stop_services()
    settings = ProfdSettings(save_root=tmp_path / "up").coordinator()
    # detached, as `profd up` starts them (and kept alive without a handle held here)
    start_services(settings.model_copy(update={"state_dir": None}), SidecarConfig(port=0))
    try:
        assert find_coordinator() is not None
        with pytest.raises(DemoRefused, match="profd is up on the Ray cluster"):
            run_demo(Console(file=io.StringIO()), address=ray_session.address_info["address"])
        assert find_coordinator() is not None  # the running profd is untouched
    finally:
        stop_services()


def test_demo_runs_against_an_existing_cluster(ray_session, tmp_path, monkeypatch) -> None:
    """The demo's own flow (a session over HTTP, its table; a trigger firing on the rank
    it slowed, and the session it started) on the test session's Ray."""
    import io

    from rich.console import Console

    from profd.cli.ray_cluster import stop_services
    from profd.demo.run import SLOW_BY, UPDATE_S, run_demo

    stop_services()
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    console = Console(file=out, width=200)
    result = run_demo(
        console,
        steps=8,
        save_root=tmp_path / "out",
        address=ray_session.address_info["address"],
    )
    text = out.getvalue()
    assert result.ok, text
    assert "POST http://127.0.0.1:" in text and "/api/v1/sessions" in text
    assert len(result.traces) == 10  # 3 workers x 2 steps, 2 replicas x 2 steps
    roles = sorted({t["role"] for t in result.traces})
    assert roles == ["actor_rollout_ref", "critic", "rollout"]
    rollout = [t for t in result.traces if t["role"] == "rollout"]
    assert {t["file_name"].split("_")[0] for t in rollout} == {
        "rollout-replica0-globalrank0",
        "rollout-replica1-globalrank1",
    }
    for t in result.traces:
        assert Path(t["path"]).is_file() and t["file_name"] in text
        assert Path(t["path"]).parent.parent == tmp_path / "out"
    assert "ui.perfetto.dev" in text
    check_demo_files(result.session, result.traces)
    fired = check_demo_firing(result, text)
    # the engines' own directories are gone once their files moved into the sessions
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [result.session["session_id"], fired.session["session_id"]]
    )
    # the demo's own summary and merge are on one clock: training and rollout tracks together
    from profd.analysis.merge import merge_dir
    from profd.analysis.summary import summarize_dir

    session_dir = Path(result.traces[0]["path"]).parent
    summary = summarize_dir(session_dir)
    assert not summary.skipped and 0 < summary.span_ms < 600_000, summary.span_ms
    merged = merge_dir(session_dir, tmp_path / "merged.json.gz")
    assert not merged.skipped and not merged.aligned
    assert len(merged.tracks) == 5  # 3 workers, 2 replicas
    # the triggered session's two ranks on one clock too; the slow rank's update stands out
    fired_dir = Path(fired.traces[0]["path"]).parent
    merged = merge_dir(fired_dir, tmp_path / "fired.json.gz")
    assert not merged.skipped and not merged.aligned and len(merged.tracks) == 2
    summary = summarize_dir(fired_dir)
    assert not summary.skipped and 0 < summary.span_ms < 60_000, summary.span_ms
    walls: dict[int, list[float]] = {}
    for st in summary.stage_times:
        if st.stage == "update_actor":
            walls.setdefault(st.rank, []).append(st.wall_ms)
    assert sorted(walls) == [0, 1] and min(walls[1]) > max(walls[0]), walls
    assert min(walls[1]) >= 0.9 * SLOW_BY * UPDATE_S * 1000, walls


def check_demo_firing(result: Any, text: str) -> Any:
    """The demo's trigger fired once, on the rank it slowed, within a few steps of the
    slowdown, with its evidence; its session profiled that rank and its peer, and the demo
    printed all of it."""
    from profd.demo.run import SLOW_BY, SLOW_WORKER, TRIGGER, UPDATE_S, WORKERS

    fired = result.fired
    assert fired is not None and fired.ok, text
    assert "POST http://127.0.0.1:" in text and "/api/v1/triggers" in text
    trigger, firing, ev = fired.trigger, fired.firing, fired.firing["evidence"]
    role, rank, _ = WORKERS[SLOW_WORKER]
    assert trigger["name"] == TRIGGER["name"] and trigger["fired"] == 1, trigger
    assert [f["state"] for f in trigger["firings"]] == ["fired"], trigger
    assert firing["state"] == "fired" and firing["session_id"] == fired.session["session_id"]
    assert (ev["role"], ev["rank"], ev["mark"]) == (role, rank, "update_actor"), ev
    assert ev["observed_s"] >= 0.9 * SLOW_BY * UPDATE_S, ev
    assert ev["observed_s"] > TRIGGER["when"]["factor"] * ev["baseline_s"], ev
    assert UPDATE_S <= ev["baseline_s"] < 2 * UPDATE_S, ev
    assert ev["baseline_samples"] >= TRIGGER["when"]["baseline_steps"], ev
    # fired within 5 steps of the slowdown (2 slow steps in a row are needed)
    assert fired.step is not None and fired.slow_from < fired.step <= fired.slow_from + 5
    assert ev["step"] == fired.step  # the driver's step, for workers that mark none
    s = fired.session
    assert s["trigger_id"] == trigger["trigger_id"] and s["evidence"] == ev
    assert s["state"] == "done" and s["steps"][0] > fired.step, s
    assert sorted((t["role"], t["rank"]) for t in s["targets"]) == [(role, 0), (role, 1)]
    assert sorted((t["rank"], t["steps"][0]) for t in fired.traces) == [
        (r, step) for r in (0, 1) for step in s["steps"]
    ]
    check_demo_files(s, fired.traces)
    line = (
        f"Trigger {trigger['trigger_id']} fired in step {fired.step} "
        f"(slow since step {fired.slow_from}): {role} rank {rank} update_actor took "
        f"{ev['observed_s'] * 1000:.1f} ms against a baseline of {ev['baseline_s'] * 1000:.1f} ms"
    )
    flat = " ".join(text.split())  # as printed, whatever the console's width
    assert line in flat, text
    assert f"It started session {s['session_id']} by itself" in flat
    for t in fired.traces:
        assert Path(t["path"]).is_file() and t["file_name"] in text
    return fired


def check_demo_files(session: dict, traces: list[dict]) -> None:
    """The files the demo names exist, parse and follow the grammar: training traces by the
    reference's stem grammar with the profd metadata inside; rollout files by the relocation
    names (``rollout-replica<n>-globalrank<g>_<engine file>``)."""
    import gzip
    import re

    from profd.backends.torch_backend import read_trace
    from profd.core.naming import parse_trace_name, sanitize

    steps = session["steps"]
    for t in traces:
        if t["role"] == "rollout":
            assert re.fullmatch(r"rollout-replica\d+-globalrank\d+_.+\.json\.gz", t["file_name"])
            with gzip.open(t["path"], "rb") as f:
                assert f.read()  # the engine's file, moved whole
            continue
        parts = parse_trace_name(t["file_name"])
        assert parts is not None, t["file_name"]
        assert parts.head[0] == sanitize(t["role"]) and parts.rank == t["rank"]
        assert parts.step == str(t["steps"][0]) and t["steps"][0] in steps
        trace = read_trace(Path(t["path"]))
        assert trace["distributedInfo"]["rank"] == t["rank"]
        meta = trace["profd"]
        assert meta["session_id"] == session["session_id"] and meta["role"] == t["role"]
        assert meta["step"] == t["steps"][0]
        names = {e.get("name") for e in trace["traceEvents"]}
        assert not any(str(n).startswith("ProfilerStep#") for n in names)


def test_single_controller_driver_announces_steps(ray_coordinator) -> None:
    """verl style: the driver marks the step, workers only mark stages."""
    import ray

    import profd
    from profd.core.protocol import DriverAck
    from profd.driver.controller import Controller

    ws = workers([("actor_rollout_ref", 0, 2), ("actor_rollout_ref", 1, 2)])
    try:
        wait_until(lambda: len(ray.get(ray_coordinator.list_agents.remote())) == 2, 30)
        ctl = Controller()
        with ctl.step(1):
            ray.get([w.work.remote() for w in ws])
        assert ctl.last_reply == DriverAck(1)  # idle: no agent is contacted
        view = ray.get(
            ray_coordinator.create_session.remote(
                {"next_steps": 1, "roles": {"actor": {"all_ranks": True}}}
            )
        )
        assert view.steps == [3]  # the driver's step 1, +1 reachable, +1 lead
        for step in range(2, 6):
            with ctl.step(step):
                ray.get([w.work.remote() for w in ws])
            if step in (3, 4):  # the window is open until step 4 begins on the workers
                assert ctl.last_reply.agents == 2 and ctl.last_reply.slow == ()
        assert ray.get([w.close.remote() for w in ws]) == [True, True]
        view = wait_until(
            lambda: (
                (
                    v := ray.get(ray_coordinator.get_session.remote(view.session_id))
                ).state.is_terminal
                and v
            ),
            30,
        )
    finally:
        for w in ws:
            ray.kill(w)
    assert view.state.value == "done", view.reason
    assert sorted(t.rank for t in view.traces) == [0, 1]
    for t in view.traces:
        assert t.steps == [3]
        names = [
            e["name"]
            for e in read_trace(t.path)["traceEvents"]
            if e.get("cat") == "user_annotation"
        ]
        assert names.count("step3") == 1 and "step4" not in names
        assert {"generate_sequences", "compute_log_prob", "update_actor", "mini_batch1"} <= set(
            names
        )
        assert names.count("update_actor") == 1  # only step 3's stages
    assert profd.controller() is profd.controller()


VERL_CONFIG = {
    "global_profiler": {"tool": "torch", "steps": [3], "save_path": None},
    "actor_rollout_ref": {
        "actor": {
            "profiler": {
                "enable": True,
                "ranks": [0, 8],
                "tool_config": {"torch": {"contents": ["cpu"], "discrete": False}},
            }
        },
        "ref": {"profiler": {"enable": False}},
    },
    "critic": {"profiler": {"enable": True, "all_ranks": True}},
}


def test_launch_time_verl_config_adopts_workers_as_they_start(ray_coordinator) -> None:
    """A verl config given at job start becomes a session that workers join on attach."""
    import ray

    import profd
    from profd.demo.workload import StepBudget

    view = profd.start_session(VERL_CONFIG)
    assert view.state.value == "armed" and view.targets == [] and view.steps == [3]
    ws = workers([("actor_rollout_ref", 0, 2), ("actor_rollout_ref", 1, 2), ("critic", 0, 1)])
    try:

        def adopted() -> Any:
            v = ray.get(ray_coordinator.get_session.remote(view.session_id))
            return v if len(v.targets) == 2 else None

        v = wait_until(adopted, 30, what="adoption")
        assert sorted((t.role, t.rank, t.role_block) for t in v.targets) == [
            ("actor_rollout_ref", 0, "actor"),
            ("critic", 0, "critic"),
        ]
        budget = ray.remote(StepBudget).options(num_cpus=0).remote()
        ray.get([w.run.remote(5, 0.2, 1, budget) for w in ws], timeout=120)
    finally:
        for w in ws:
            ray.kill(w)
    view = wait_until(
        lambda: (
            (v := ray.get(ray_coordinator.get_session.remote(view.session_id))).state.is_terminal
            and v
        ),
        30,
    )
    assert view.state.value == "done", view.reason
    assert sorted((t.role, t.rank, t.steps[0]) for t in view.traces) == [
        ("actor_rollout_ref", 0, 3),
        ("critic", 0, 3),
    ]
    reasons = {(i.role, i.rank): i.reason for i in view.ignored}
    assert "out of range (world_size 2)" in reasons[("actor_rollout_ref", 8)]
