"""The `profd` command line as a user runs it: real subprocesses against a real Ray."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import wait_until

PROFD = [sys.executable, "-m", "profd.cli.main"]


def cli(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*PROFD, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=env["HOME"]
    )


@pytest.fixture
def cli_env(tmp_path: Path, ray_session: Any) -> dict[str, str]:
    from profd.cli.ray_cluster import stop_services
    from profd.core.ray_env import find_coordinator

    stop_services()
    wait_until(lambda: find_coordinator() is None, 30, what="no coordinator")
    env = dict(os.environ)
    env.update(
        HOME=str(tmp_path),
        PROFD_STATE_DIR=str(tmp_path / "state"),
        PROFD_POLL_TIMEOUT_S="1",
        COLUMNS="200",
    )
    yield env
    stop_services()


def test_help_lists_every_command() -> None:
    out = subprocess.run([*PROFD, "--help"], capture_output=True, text=True, timeout=60).stdout
    for cmd in ("up", "down", "status", "profile", "sessions", "traces", "demo"):
        assert cmd in out


def test_unreachable_sidecar_is_exit_3_with_a_hint(tmp_path: Path) -> None:
    env = dict(os.environ, HOME=str(tmp_path), PROFD_STATE_DIR=str(tmp_path / "s"))
    r = cli(["status", "--url", "http://127.0.0.1:9"], env, timeout=60)
    assert r.returncode == 3
    assert "cannot reach the profd sidecar" in r.stderr and "profd up" in r.stderr


def test_bad_usage_is_exit_2(tmp_path: Path) -> None:
    env = dict(os.environ, HOME=str(tmp_path), PROFD_STATE_DIR=str(tmp_path / "s"))
    for args, option in (
        (["--steps", "a,b"], "--steps"),
        (["--next-steps", "2", "--ranks", "0,x"], "--ranks"),
        (["--steps", "9-3"], "--steps"),
    ):
        r = cli(["profile", *args], env, timeout=60)
        text = " ".join(r.stderr.replace("│", " ").split())
        assert r.returncode == 2 and f"Invalid value for {option}:" in text, (args, text)


def test_every_float_option_refuses_nan_and_inf() -> None:
    """A bound compares false with NaN and JSON has no NaN or inf: a float option that let
    them through ended in a traceback (`profd watch --step-time nan`) or the wrong rule."""
    import typer
    from typer.testing import CliRunner

    from profd.cli.main import app

    runner = CliRunner()
    seen = []
    for name, cmd in sorted(typer.main.get_command(app).commands.items()):
        for p in cmd.params:
            if type(p).__name__ != "TyperOption":
                continue
            if p.type_descriptor.annotation not in (float, float | None):
                continue
            needed = ["x" for q in cmd.params if type(q).__name__ == "TyperArgument" and q.required]
            for bad in ("nan", "inf", "-inf"):
                r = runner.invoke(app, [name, *needed, p.opts[0], bad])
                text = " ".join(r.output.replace("│", " ").split())
                assert r.exit_code == 2, (name, p.opts, bad, text)
                assert f"'{p.opts[0]}': must be a finite number" in text, (name, text)
            seen.append(p.opts[0])
    assert len(seen) >= 18 and "--step-time" in seen and "--wait-s" in seen, seen


def test_integer_lists_take_runs() -> None:
    import typer

    from profd.cli.common import comma_list

    assert comma_list("120-123, 130", "--steps", as_int=True) == [120, 121, 122, 123, 130]
    assert comma_list("a, b", "--roles") == ["a", "b"] and comma_list(None, "--x") is None
    for bad in ("3-", "-1", "5-4", "1-1000000", " , ", "1,,2", "1,2,"):
        with pytest.raises(typer.BadParameter):
            comma_list(bad, "--steps", as_int=True)
    with pytest.raises(typer.BadParameter, match="empty item"):
        comma_list("actor,,critic", "--roles")


def test_up_profile_traces_down(cli_env: dict[str, str], ray_session: Any, tmp_path: Path) -> None:
    import ray

    from profd.demo.workload import DemoWorker, StepBudget

    address = ray_session.address_info["address"]
    r = cli(["up", "--address", address, "--port", "0"], cli_env)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "profd is up: sidecar http://127.0.0.1:" in r.stdout
    state_dir = Path(cli_env["PROFD_STATE_DIR"])
    token_file = state_dir / "token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    state = json.loads((state_dir / "sidecar.json").read_text())
    assert state["started_ray"] is False and state["ray_address"] == address

    again = cli(["up", "--address", address, "--port", "0"], cli_env)
    assert again.returncode == 0 and "already up" in again.stdout
    flat = " ".join(again.stderr.split())
    assert "not applied to the running profd: --address;" in flat, again.stderr  # --port 0
    other = cli(["up", "--port", "1", "--allow-host", "x.example"], cli_env)
    flat = " ".join(other.stderr.split())
    assert "not applied to the running profd: --port, --allow-host;" in flat, other.stderr
    # a running profd takes --trigger (posted over HTTP); a bad file is refused up front
    triggers = tmp_path / "triggers.json"
    triggers.write_text(json.dumps({"name": "slow", "when": {"kind": "step_time", "role": "x"}}))
    posted = cli(["up", "--trigger", str(triggers)], cli_env)
    assert posted.returncode == 0, posted.stderr
    assert "already up" in posted.stdout and "trigger slow: watching (trg-" in posted.stdout
    assert "not applied" not in posted.stderr
    triggers.write_text(json.dumps({"name": "bad", "when": {"kind": "oom", "stage": "x"}}))
    refused = cli(["up", "--trigger", str(triggers)], cli_env)
    assert refused.returncode == 2 and "when.role" in refused.stderr, refused.stderr
    listed = cli(["watch", "--list", "--json"], cli_env, timeout=60)
    assert [t["name"] for t in json.loads(listed.stdout)] == ["slow"]
    # the record is lost while the services run: `up` replaces the sidecar it cannot vouch
    # for, so the CLI's token works again (the coordinator and its sessions stay)
    (state_dir / "sidecar.json").unlink()
    lost = cli(["up", "--address", address, "--port", "0"], cli_env)
    assert lost.returncode == 0 and "replaced it" in lost.stdout, lost.stdout + lost.stderr
    assert cli(["status"], cli_env, timeout=60).returncode == 0

    remote = ray.remote(DemoWorker).options(num_cpus=0)
    # rank 1 on the second node, as a job's ranks are: its agent starts that node's relay
    # and moves to it while the job starts (its step reached the coordinator late there,
    # and the window was placed before where the rank already was)
    on_b = ray.remote(DemoWorker).options(num_cpus=0, resources={"node_b": 0.01})
    workers = [remote.remote("actor", 0, 2, seed=3), on_b.remote("actor", 1, 2, seed=3)]
    budget = ray.remote(StepBudget).options(num_cpus=0).remote()
    try:
        ray.get([w.ready.remote() for w in workers], timeout=120)
        # the window is chosen by the coordinator: the workers run on until step 30 (on a
        # loaded machine their own 8 steps could end, and their agents close, before it)
        ray.get(budget.extend_to.remote(30))
        runs = [w.run.remote(8, 0.4, 1, budget) for w in workers]

        def stepping() -> bool:
            st = cli(["status", "--json"], cli_env, timeout=60)
            agents = json.loads(st.stdout)["agents"]
            alive = [a for a in agents if a["state"] == "alive"]
            return len([a for a in alive if a["current_step"] is not None]) == 2

        wait_until(stepping, 60, 0.2, what="agents stepping")
        r = cli(["profile", "--next-steps", "1", "--all-ranks", "--wait", "--json"], cli_env)
        assert r.returncode == 0, r.stderr + r.stdout
        view = json.loads(r.stdout)
        said = ("steps", "reason", "warnings", "ignored", "targets", "traces")
        assert view["state"] == "done" and len(view["traces"]) == 2, json.dumps(
            {k: view.get(k) for k in said}, indent=1
        )
        sid = view["session_id"]

        listed = cli(["sessions", "--json"], cli_env)
        assert [s["session_id"] for s in json.loads(listed.stdout)] == [sid]
        dest = tmp_path / "downloaded"
        r = cli(["traces", "--session", sid, "--download", str(dest)], cli_env)
        assert r.returncode == 0, r.stderr
        files = sorted(p.name for p in dest.iterdir())
        assert files == sorted(t["file_name"] for t in view["traces"])
        assert all((dest / f).stat().st_size > 0 for f in files)

        bad = cli(["profile", "--next-steps", "1", "--role", "nobody"], cli_env)
        assert bad.returncode == 2 and "no live agent has role nobody" in bad.stderr  # 422
        ray.get(budget.extend_to.remote(0))
        ray.get(runs, timeout=120)
    finally:
        for w in workers:
            ray.kill(w)

    r = cli(["down"], cli_env)
    assert r.returncode == 0 and "profd_sidecar" in r.stdout and "profd_coordinator" in r.stdout
    assert not (state_dir / "sidecar.json").exists()
    from profd.core.ray_env import find_coordinator

    wait_until(lambda: find_coordinator() is None, 30, what="coordinator stopped")


# `profd up` without --address (its own loopback Ray, stopped by `down`, nothing left
# behind) is part of tests/e2e/test_lifecycle.py's operator's day.


def test_down_joins_with_the_auth_mode_up_recorded(tmp_path: Path, monkeypatch) -> None:
    """A token-auth cluster refuses a driver without RAY_AUTH_MODE=token: `down` reuses the
    mode `up` ran with (here the cluster is unreachable, so only the join is observed)."""
    from profd.cli import service
    from profd.cli.ray_cluster import ServiceState, save_state

    state_dir = tmp_path / "state"
    monkeypatch.setenv("PROFD_STATE_DIR", str(state_dir))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    save_state(
        state_dir,
        ServiceState(
            url="http://127.0.0.1:1",
            host="127.0.0.1",
            port=1,
            ray_address="10.255.255.1:6379",
            started_ray=False,
            save_root=str(tmp_path),
            ray_auth_mode="token",
        ),
    )
    seen: list[str | None] = []

    def fake_connect(address: str | None, quiet: bool = False) -> None:
        seen.append(os.environ.get("RAY_AUTH_MODE"))
        raise ConnectionError("unreachable in this test")

    monkeypatch.setattr("profd.core.ray_env.connect_ray", fake_connect)
    service.down(address=None)
    assert seen == ["token"] and not (state_dir / "sidecar.json").exists()


def test_down_refuses_when_it_cannot_join_a_ray_it_started_that_still_runs(
    tmp_path: Path, monkeypatch
) -> None:
    """A join that fails (auth mode, Ray version) is no proof the cluster is gone: with its
    GCS process alive, `profd down` stops nothing and keeps the record."""
    import typer

    from profd.cli import service
    from profd.cli.ray_cluster import ServiceState, save_state

    state_dir = tmp_path / "state"
    monkeypatch.setenv("PROFD_STATE_DIR", str(state_dir))
    save_state(
        state_dir,
        ServiceState(
            url="http://127.0.0.1:1",
            host="127.0.0.1",
            port=1,
            ray_address="127.0.0.1:1",
            started_ray=True,
            save_root=str(tmp_path),
            ray_temp_dir=str(tmp_path / "ray"),
        ),
    )
    stopped: list[str] = []

    def fail(address: str | None, quiet: bool = False) -> None:
        raise RuntimeError("version mismatch")

    monkeypatch.setattr("profd.core.ray_env.connect_ray", fail)
    monkeypatch.setattr("profd.cli.ray_cluster.gcs_process", lambda temp_dir: 4242)
    monkeypatch.setattr(
        "profd.cli.ray_cluster.stop_local_ray", lambda *a, **k: stopped.append("ray")
    )
    with pytest.raises(typer.Exit) as exit_info:
        service.down(address=None, stop_ray=False, keep_ray=False)
    assert exit_info.value.exit_code == 1
    assert stopped == [] and (state_dir / "sidecar.json").exists()


def test_a_clusters_processes_are_found_by_whole_arguments(tmp_path: Path) -> None:
    """`profd down --stop-ray` signals the processes of its cluster (argument = temp dir, a
    path below it, or --option=temp dir), never a user's `tail <temp dir>-logs`."""
    import subprocess
    import sys

    from profd.cli.ray_cluster import _pids_mentioning

    marker = str(tmp_path / "profd-ray-x")
    code = "import time; time.sleep(60)"
    procs = {
        arg: subprocess.Popen([sys.executable, "-c", code, arg])
        for arg in (f"--temp-dir={marker}", f"{marker}/session/logs", f"{marker}-logs")
    }

    def execed(arg: str, proc: subprocess.Popen) -> bool:  # (a child not yet exec'd
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:  # shows its parent's command)
            return arg.encode() in f.read().split(b"\0")

    try:
        wait_until(lambda: all(execed(a, p) for a, p in procs.items()), 30, 0.02, what="exec")
        found = set(_pids_mentioning(marker))
        assert procs[f"--temp-dir={marker}"].pid in found
        assert procs[f"{marker}/session/logs"].pid in found
        assert procs[f"{marker}-logs"].pid not in found
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
