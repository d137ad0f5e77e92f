"""What an operator sees and asks of a running job, end to end: one real ``profd up`` (its own
local Ray) and the user's single-controller job in its own process, shared by this module's
tests in order (the last one kills a worker)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from lifecycle import Home, Job

from helpers import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Home, Job]]:
    home = Home(tmp_path_factory.mktemp("live"))
    try:
        home.up()
        job = Job(home, home.state()["ray_address"], step_seconds=0.05)
        job.wait_step(3)
        wait_until(lambda: len(home.agents()) == 3, 60, what="the job's agents")
        yield home, job
        job.stop()
    finally:
        home.close()


def test_status_shows_the_jobs_step_from_its_driver(live: tuple[Home, Job]) -> None:
    """Before any session, a driven worker's step is its driver's, not None (nor the last
    profiled one)."""
    home, job = live
    at = job.step
    r = home.cli("status", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["status"]["driver_step"] >= at
    address = home.state()["ray_address"]
    assert out["status"]["ray_address"] == address
    for a in out["agents"]:
        assert a["step_source"] == "driver" and a["current_step"] >= at, a
    table = home.cli("status")
    assert "(driver)" in table.stdout and "driver (profd.controller()) at step" in table.stdout
    assert f"Ray cluster {address}\n" in table.stdout  # agents came: no hint to join
    assert "…" not in table.stdout  # 80 columns (a pipe's): no role or node cut short
    # relays are on by default: the job's agents end up polling their node's relay
    links = lambda: [a["link"] for a in home.agents()]  # noqa: E731
    wait_until(lambda: links() == ["relay"] * 3, 60, 0.2, what=f"agents via the relay: {links()}")
    rows = [ln for ln in home.cli("status").stdout.splitlines() if " alive " in ln]
    assert len(rows) == 3 and all("relay" in ln for ln in rows), rows  # the "via" column


def test_steps_already_past_are_refused_and_reasons_stay_true(live: tuple[Home, Job]) -> None:
    home, job = live
    r = home.http(
        "POST", "/api/v1/sessions", json={"steps": [1], "roles": {"*": {"all_ranks": True}}}
    )
    assert r.status_code == 422, r.text
    (f,) = r.json()["fields"]
    assert f["field"] == "steps" and "already begun" in f["message"]
    ahead = job.step + 400
    r = home.http("POST", "/api/v1/sessions", json={"steps": [2, ahead], "roles": {"critic": {}}})
    assert r.status_code == 201, r.text
    view = r.json()
    assert view["reason"].startswith(f"waiting for step {ahead}; step(s) 2 had already begun")
    home.http("POST", f"/api/v1/sessions/{view['session_id']}/cancel")


def test_a_session_after_a_profiled_one_aligns_on_the_jobs_step(live: tuple[Home, Job]) -> None:
    """The last profiled step must not stand in for the job's: next_steps starts after the
    driver's step, and the step shown moves on with the job after the session."""
    home, job = live
    prof = home.cli("profile", "--next-steps", "1", "--role", "critic", "--wait", "--json")
    assert prof.returncode == 0, prof.stdout + prof.stderr
    profiled = json.loads(prof.stdout)["steps"][0]
    # its summary, computed by the sidecar actor's summary worker process (local files)
    summary = home.http("GET", f"/api/v1/sessions/{json.loads(prof.stdout)['session_id']}/summary")
    assert summary.status_code == 200, summary.text
    assert {t["role"] for t in summary.json()["tracks"]} == {"critic"}
    assert summary.json()["stages"] and not summary.json()["skipped"]
    job.wait_step(profiled + 20)
    critic = next(a for a in home.agents() if a["role"] == "critic")
    assert critic["current_step"] >= profiled + 20 and critic["step_source"] == "driver"
    at = job.step
    r = home.http("POST", "/api/v1/sessions", json={"next_steps": 1, "roles": {"critic": {}}})
    assert r.status_code == 201, r.text
    assert r.json()["steps"][0] > at
    home.http("POST", f"/api/v1/sessions/{r.json()['session_id']}/cancel")


def test_foreign_host_names_are_refused(live: tuple[Home, Job]) -> None:
    """DNS rebinding: a page served as attacker.example that resolves to 127.0.0.1."""
    home, _ = live
    url = home.url
    for path in ("/api/v1/traces", "/api/v1/status", "/", "/healthz"):
        r = httpx.get(url + path, headers={"Host": "attacker.example"}, timeout=10)
        assert r.status_code == 400, (path, r.status_code)
        assert r.json()["error"] == "host_not_allowed" and "--allow-host" in r.json()["message"]
    port = home.state()["port"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
        assert (
            httpx.get(url + "/api/v1/traces", headers={"Host": host}, timeout=10).status_code == 200
        )


def test_bad_input_names_the_field_and_changes_nothing(live: tuple[Home, Job]) -> None:
    home, _ = live
    before = home.http("GET", "/api/v1/sessions").json()["total"]
    bad = home.root / "bad_verl.yaml"
    for text, field in (
        (
            "global_profiler: {tool: torch, steps: [500]}\nactor_rollout_ref:\n  actor:\n"
            "    profiler: {enable: true, ranks: 5}\n",
            "actor_rollout_ref.actor.profiler.ranks",
        ),
        (
            "global_profiler: {tool: torch, steps: [500], global_tool_config: 5}\n"
            "critic: {profiler: {enable: true}}\n",
            "global_profiler.global_tool_config",
        ),
        (
            "global_profiler: {tool: torch, steps: [500]}\ncritic:\n  profiler:\n"
            "    enable: true\n    tool_config: {torch: {schedule: 3}}\n",
            "critic.profiler.tool_config.torch.schedule",
        ),
    ):
        bad.write_text(text)
        r = home.cli("profile", "--config", str(bad))
        assert r.returncode == 2, r.stdout + r.stderr
        assert (
            field in r.stderr.replace("\n", "").replace("│", "").replace(" ", "")
            or field in r.stderr
        ), r.stderr
        assert "Traceback" not in r.stderr
    headers = {"Content-Type": "application/json"}
    r = home.http("POST", "/api/v1/sessions", content=b'{"duration_s": NaN}', headers=headers)
    assert r.status_code == 422, r.text
    r = home.http(
        "POST", "/api/v1/sessions", json={"next_steps": 1, "save_path": "/tmp/" + "x" * 5000}
    )
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "save_path", r.text
    r = home.http("GET", f"/api/v1/traces?rank={2**53}")
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "rank", r.text
    assert home.http("GET", "/api/v1/sessions").json()["total"] == before


def test_lists_are_paged_newest_first(live: tuple[Home, Job]) -> None:
    home, job = live
    made = []
    for _ in range(55):  # each waits far ahead until cancelled (it holds the critic till then)
        far = {"steps": [job.step + 100_000], "roles": {"critic": {}}}
        r = home.http("POST", "/api/v1/sessions", json=far)
        assert r.status_code == 201, r.text
        made.append(r.json()["session_id"])
        assert home.http("POST", f"/api/v1/sessions/{made[-1]}/cancel").status_code == 200
    first = home.http("GET", "/api/v1/sessions").json()
    assert first["count"] == 50 and first["total"] >= 55 and first["next_cursor"]
    assert [s["session_id"] for s in first["data"][:55]][:50] == made[::-1][:50]
    rest = home.http("GET", "/api/v1/sessions", params={"cursor": first["next_cursor"]}).json()
    assert [s["session_id"] for s in rest["data"]][:5] == made[::-1][50:55]
    shown = home.cli("sessions", "--json")
    assert shown.returncode == 0 and len(json.loads(shown.stdout)) == 50
    everything = home.cli("sessions", "--all", "--json")
    assert len(json.loads(everything.stdout)) == first["total"]


def test_a_second_job_on_the_cluster_is_never_merged_with_the_first(
    live: tuple[Home, Job],
) -> None:
    """A second run of the same job joins the cluster: the same roles and ranks. A request
    for critic is refused naming job_id and both jobs (it profiled whichever critic had
    registered last, silently); `--job` picks one; status shows each agent's job."""
    home, _ = live
    second = Job(home, home.state()["ray_address"], step_seconds=0.05)
    try:
        second.wait_step(3)
        wait_until(lambda: len(home.agents()) == 6, 60, what="the second job's agents")
        jobs = sorted({a["job_id"] for a in home.agents()})
        assert len(jobs) == 2 and None not in jobs, jobs
        r = home.http("POST", "/api/v1/sessions", json={"next_steps": 1, "roles": {"critic": {}}})
        assert r.status_code == 422, r.text
        (f,) = r.json()["fields"]
        assert f["field"] == "job_id" and all(f"{j}: ranks 0" in f["message"] for j in jobs)
        newest = jobs[-1]  # Ray's job ids count up: the second job's
        prof = home.cli("profile", "--next-steps", "1", "--role", "critic", "--job", newest,
                        "--wait", "--json")  # fmt: skip
        assert prof.returncode == 0, prof.stdout + prof.stderr
        view = json.loads(prof.stdout)
        (target,) = view["targets"]
        mine = {a["agent_id"]: a["job_id"] for a in home.agents()}
        assert mine[target["agent_id"]] == newest and view["request"]["job_id"] == newest
        st = home.cli("stacks", "--job", newest, "--method", "agent", "--json")
        assert st.returncode == 0, st.stderr
        pids = {r["pid"] for g in json.loads(st.stdout)["groups"] for r in g["ranks"]}
        theirs = {a["pid"] for a in home.agents() if a["job_id"] == newest}
        assert pids == theirs and len(pids) == 3, (pids, theirs)  # that job's ranks only
        table = home.cli("status").stdout
        assert any(ln.split()[:2] == ["job", "role"] for ln in table.splitlines()), table
        rows = [ln for ln in table.splitlines() if " alive " in ln]
        assert len(rows) == 6 and all(any(j in ln for j in jobs) for ln in rows), table
        (line,) = [ln for ln in table.splitlines() if ln.startswith("drivers (profd.")]
        assert all(f"job {j} at step" in line for j in jobs), table  # each job's driver
    finally:
        second.stop()
    wait_until(lambda: len({a["job_id"] for a in home.agents() if a["state"] == "alive"}) == 1,
               60, what="the second job's agents gone")  # fmt: skip


def test_a_killed_worker_stops_being_a_target_within_seconds(live: tuple[Home, Job]) -> None:
    """Killed without close(): Ray's node knows the process is gone long before the 30 s
    heartbeat timeout would say so. (Last in this module: the job loses a worker.)"""
    home, _ = live
    critic = next(a for a in home.agents() if a["role"] == "critic")
    killed = time.monotonic()
    os.kill(critic["pid"], signal.SIGKILL)

    def lost() -> dict[str, Any] | None:
        a = next(a for a in home.agents() if a["agent_id"] == critic["agent_id"])
        return a if a["state"] == "lost" else None

    wait_until(lost, 20, what="the killed worker's agent lost")
    assert time.monotonic() - killed < 15  # the heartbeat timeout is 30 s
    r = home.http("POST", "/api/v1/sessions", json={"next_steps": 1, "roles": {"critic": {}}})
    assert r.status_code == 422, r.text
    assert r.json()["fields"][0]["field"] == "roles.critic"
