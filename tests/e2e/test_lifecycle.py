"""A live job is never hurt by profd, and profd comes back from every crash.

Each test runs a real ``profd up`` (which starts its own local Ray) and the user's job
(``examples/single_controller.py``) as a separate process joined to that Ray, then does what
an operator does: ``profd down``, kill the sidecar or the coordinator, ``profd up`` again,
download traces after a restart.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from lifecycle import Home, Job, alive, profd_ray_pids

from helpers import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Home]:
    h = Home(tmp_path)
    yield h
    h.close()


def _names(pids: list[int]) -> set[str]:
    out = set()
    for pid in pids:
        try:
            out.add(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode())
        except OSError:
            pass
    return out


# One operator's day, in order, on one live job: every restart and crash a user meets, each
# checked where it happens. A single story rather than one test per step: each `profd up` and
# job start costs about 30 s of CI on 2 cores, and the later steps also check that state
# survives the earlier ones (a session from before a sidecar crash downloads after a new Ray).
@pytest.mark.timeout(900)
def test_an_operators_day_of_restarts_and_crashes_never_hurts_the_job(
    home: Home, tmp_path: Path
) -> None:
    first = _up_starts_its_own_loopback_ray(home)
    _a_second_coordinator_cannot_take_the_state_directory(home, first)
    # Ray ends a driver whose GCS stays away this long (60 s by default): see the last step
    job = Job(home, first["ray_address"], env={"RAY_gcs_rpc_server_reconnect_timeout_s": "5"})
    job.wait_step(3)
    wait_until(lambda: len(home.agents()) == 3, 60, what="the job's agents")
    _down_refuses_while_the_job_runs(home, job)
    traces = _up_after_a_sidecar_crash_rejoins(home, job, first)
    _keep_ray_stops_profd_only_and_up_rejoins(home, job, first)
    traces += _up_recreates_a_coordinator_killed_for_good(home, job)
    _stop_ray_stops_all_of_it(home, job, first)
    downloaded = _downloads_work_after_up_on_a_new_ray(home, tmp_path, first, traces)
    assert downloaded == len(traces) == 6  # every trace of the day, after all of it


def _up_starts_its_own_loopback_ray(home: Home) -> dict:
    up = home.up()
    state = home.state()
    address = state["ray_address"]
    assert state["started_ray"] is True and address.startswith("127.0.0.1:"), state
    assert f'ray.init(address="{address}")' in up.stdout.replace("\n", "")
    assert "may be another one" in up.stdout.replace("\n", " ")
    st = home.cli("status", "--json", timeout=60)
    assert st.returncode == 0 and json.loads(st.stdout)["status"]["agents"] == 0, st.stderr
    assert json.loads(st.stdout)["status"]["ray_address"] == address
    # no agent yet: status says which cluster a job must join (one that called ray.init()
    # without it would run on a private Ray and never register)
    table = " ".join(home.cli("status", timeout=60).stdout.split())
    assert f"Ray cluster {address} (jobs join it with RAY_ADDRESS={address})" in table, table
    return state


def _a_second_coordinator_cannot_take_the_state_directory(home: Home, first: dict) -> None:
    """The state file is lost, so `profd up` starts a new Ray: its coordinator must not share
    the SQLite file with the one still running; the new Ray is not left behind."""
    home.state_file.unlink()
    before = profd_ray_pids()
    r = home.cli("up", "--port", "0", "--num-cpus", "1")
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr.replace("\n", " ")
    assert "is in use by another profd coordinator" in err and first["ray_address"] in err
    wait_until(lambda: not [p for p in profd_ray_pids() - before if alive(p)], 30)
    # the first coordinator still serves, with its state
    from profd.cli.ray_cluster import ServiceState, save_state

    save_state(home.state_dir, ServiceState(**first))
    assert home.health()["coordinator"] is True


def _down_refuses_while_the_job_runs(home: Home, job: Job) -> None:
    down = home.cli("down")
    assert down.returncode == 1, down.stdout + down.stderr
    err = down.stderr.replace("\n", " ")
    assert "refused" in err and "single_controller.py" in err and f"pid {job.pid}" in err
    assert "--stop-ray" in err and "Nothing was stopped" in err
    job.wait_step(job.step + 5)  # the job goes on; so does profd
    health = home.health()
    assert health == {"status": "ok", "coordinator": True, "version": health["version"]}


def _up_after_a_sidecar_crash_rejoins(home: Home, job: Job, first: dict) -> list[dict]:
    ray_before = profd_ray_pids()
    home.kill_actor("profd_sidecar")
    wait_until(lambda: home.health() is None, 30, what="sidecar gone")
    r = home.up()
    assert "Rejoining the Ray cluster recorded" in r.stdout, r.stdout
    assert "Connecting to existing Ray cluster" not in r.stderr  # Ray's INFO lines: not ours
    now = home.state()
    assert now["ray_address"] == first["ray_address"]
    assert now["ray_temp_dir"] == first["ray_temp_dir"] and now["started_ray"] is True
    assert home.health()["coordinator"] is True
    assert "(the running coordinator was kept)" in r.stdout
    assert not [p for p in profd_ray_pids() - ray_before if "gcs_server" in "".join(_names([p]))]
    agents = [a for a in home.agents() if a["state"] == "alive"]
    assert sorted((a["role"], a["rank"]) for a in agents) == [
        ("actor_rollout_ref", 0),
        ("actor_rollout_ref", 1),
        ("critic", 0),
    ]
    prof = home.cli("profile", "--next-steps", "1", "--all-ranks", "--wait", "--json")
    assert prof.returncode == 0, prof.stdout + prof.stderr
    view = json.loads(prof.stdout)
    assert view["state"] == "done" and len(view["traces"]) == 3
    return view["traces"]


def _keep_ray_stops_profd_only_and_up_rejoins(home: Home, job: Job, first: dict) -> None:
    r = home.cli("down", "--keep-ray")
    assert r.returncode == 0, r.stderr
    assert "keeps running" in r.stdout and home.state_file.exists()
    assert home.health() is None
    st = home.cli("status")  # says profd was stopped, not "is `profd up` running?"
    assert st.returncode == 3 and "profd is not running (last at" in st.stderr, st.stderr
    assert "stopped by `profd down`" in " ".join(st.stderr.split())
    job.wait_step(job.step + 3)
    again = home.up()
    assert "Rejoining" in again.stdout and home.state()["ray_address"] == first["ray_address"]
    wait_until(lambda: len([a for a in home.agents() if a["state"] == "alive"]) == 3, 60)


def _up_recreates_a_coordinator_killed_for_good(home: Home, job: Job) -> list[dict]:
    # far enough to be ahead once the restart is over: a driven worker learns each step from
    # its driver's announcements, which reach no one while no coordinator runs (measured on 2
    # busy cores: agents back 80 steps after this line, at about 0.2 s a step)
    target = job.step + 200
    r = home.http(
        "POST", "/api/v1/sessions", json={"steps": [target], "roles": {"*": {"all_ranks": True}}}
    )
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]

    home.kill_actor("profd_coordinator")
    wait_until(lambda: (home.health() or {}).get("status") == "degraded", 30)
    killed_at = job.step
    job.wait_step(killed_at + 10)  # the driver keeps its pace without the coordinator
    slowest = max(s[1] for s in job.since(killed_at))
    assert slowest < 1.0, job.since(killed_at)

    up = home.up()
    assert "coordinator restored from its state" in up.stdout, up.stdout
    assert home.health()["coordinator"] is True
    wait_until(
        lambda: len([a for a in home.agents() if a["state"] == "alive"]) == 3,
        60,
        what="agents re-registered by themselves",
    )
    view = wait_until(
        lambda: (
            (v := home.http("GET", f"/api/v1/sessions/{sid}").json())["state"]
            in ("done", "partial", "failed")
            and v
        ),
        120,
        what="the restored session ends",
    )
    assert view["state"] == "done", view
    assert sorted(t["rank"] for t in view["traces"]) == [0, 0, 1]
    return view["traces"]


def _stop_ray_stops_all_of_it(home: Home, job: Job, first: dict) -> None:
    from profd.cli.ray_cluster import cluster_pids

    pids = cluster_pids(first["ray_temp_dir"], first["ray_address"])
    names = _names(pids)
    assert any("DashboardAgent" in n for n in names) and any("RuntimeEnvAgent" in n for n in names)
    stop = home.cli("down", "--stop-ray")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert "local ray" in stop.stdout
    wait_until(lambda: not [p for p in pids if alive(p)], 30, what="every Ray process gone")
    assert not home.state_file.exists()
    # the job lost its cluster; it ends (profd never keeps it hanging)
    job.proc.wait(60)
    job.stop()


def _downloads_work_after_up_on_a_new_ray(
    home: Home, tmp_path: Path, first: dict, traces: list[dict]
) -> int:
    """Returns how many of the traces were downloaded, byte for byte."""
    home.up()
    state = home.state()
    assert state["ray_address"] != first["ray_address"]  # a new cluster: node ids changed
    out = tmp_path / "dl"
    r = home.cli("traces", "--download", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(traces) == 6
    same = 0
    for t in traces:
        got = list(out.rglob(Path(t["path"]).name))
        assert len(got) == 1 and got[0].read_bytes() == Path(t["path"]).read_bytes(), t
        same += 1
    # nothing but profd runs on this Ray: a plain `down` stops it too, and leaves nothing
    down = home.cli("down", timeout=120)
    assert down.returncode == 0 and "local ray" in down.stdout, down.stdout + down.stderr
    wait_until(
        lambda: not _processes_of(state["ray_temp_dir"]), 30, what="that Ray's processes gone"
    )
    from profd.cli.ray_cluster import ray_client_servers

    # `ray start` leaves its client server an orphan naming only the GCS address
    wait_until(lambda: not ray_client_servers(state["ray_address"]), 30, what="client server")
    return same


def _processes_of(temp_dir: str) -> list[int]:
    return [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and temp_dir.encode() in _raw_cmdline(p) and alive(int(p.name))
    ]


def _raw_cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def test_the_driver_never_hangs_when_the_gcs_is_gone(home: Home) -> None:
    from profd.cli.ray_cluster import cluster_pids

    home.up()
    state = home.state()
    job = Job(home, state["ray_address"])
    job.wait_step(3)
    wait_until(lambda: len(home.agents()) == 3, 60, what="the job's agents")
    r = home.http(
        "POST", "/api/v1/sessions", json={"next_steps": 500, "roles": {"*": {"all_ranks": True}}}
    )
    assert r.status_code == 201, r.text  # a live session: every step announcement has work
    gcs = [p for p in cluster_pids(state["ray_temp_dir"]) if "gcs_server" in "".join(_names([p]))]
    assert len(gcs) == 1
    at = job.step
    import os

    os.kill(gcs[0], signal.SIGKILL)
    job.wait_step(at + 15, timeout=60)
    steps = job.since(at)
    # Ray itself stalls its workers for a few hundred ms when the GCS goes (the same job
    # without profd does); what must not happen is a driver blocked on profd
    assert max(s[1] for s in steps) < 3.0, steps
    assert "does not answer" in job.stderr()  # the controller noticed, and went on
    job.kill()
