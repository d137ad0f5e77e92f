"""The CLI against a token-protected sidecar: helpful errors when the token is missing or
wrong, and ``profd up``'s confinement flags reaching the sidecar it starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers import TOKEN, wait_until

PROFD = [sys.executable, "-m", "profd.cli.main"]


def cli(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*PROFD, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=env["HOME"]
    )


def env_for(tmp_path: Path, token: str | None) -> dict[str, str]:
    state = tmp_path / "state"
    state.mkdir(mode=0o700, exist_ok=True)
    if token is not None:
        (state / "token").write_text(token + "\n")
    return dict(os.environ, HOME=str(tmp_path), PROFD_STATE_DIR=str(state), COLUMNS="200")


@pytest.fixture
def remote_sidecar(make_sidecar) -> str:
    """A sidecar configured as bound beyond loopback (every route needs the token),
    served on 127.0.0.1."""
    return make_sidecar(host="0.0.0.0").url


def test_missing_token_says_where_it_should_be(remote_sidecar: str, tmp_path: Path) -> None:
    env = env_for(tmp_path, None)
    for args in (["status"], ["sessions"], ["traces"], ["profile", "--steps", "5"]):
        r = cli([*args, "--url", remote_sidecar], env)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert "HTTP 401" in r.stderr and "no token" in r.stderr, r.stderr
        assert str(tmp_path / "state" / "token") in r.stderr.replace("\n", "")


def test_wrong_token_is_named_as_refused(remote_sidecar: str, tmp_path: Path) -> None:
    r = cli(["status", "--url", remote_sidecar], env_for(tmp_path, "stale-token"))
    assert r.returncode == 1
    assert "HTTP 403" in r.stderr and "was refused" in r.stderr.replace("\n", " ")


def test_right_token_works_for_reads_and_json(remote_sidecar: str, tmp_path: Path) -> None:
    r = cli(["status", "--url", remote_sidecar, "--json"], env_for(tmp_path, TOKEN))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["status"]["agents"] == 0
    r = cli(["traces", "--url", remote_sidecar, "--json"], env_for(tmp_path, TOKEN))
    assert r.returncode == 0 and json.loads(r.stdout) == []


def test_up_help_lists_the_operator_flags() -> None:
    env = dict(os.environ, COLUMNS="200", TERM="dumb")
    out = subprocess.run(
        [*PROFD, "up", "--help"], capture_output=True, text=True, timeout=60, env=env
    )
    text = out.stdout
    for flag in (
        "--address",
        "--host",
        "--port",
        "--allow-hook-commands",
        "--allow-save-root",
        "--allow-upload-prefix",
    ):
        assert flag in text, flag


@pytest.fixture
def up_env(tmp_path: Path, ray_session: Any) -> Iterator[dict[str, str]]:
    from profd.cli.ray_cluster import stop_services
    from profd.core.ray_env import find_coordinator

    stop_services()
    wait_until(lambda: find_coordinator() is None, 30, what="no coordinator")
    env = dict(os.environ, HOME=str(tmp_path), PROFD_STATE_DIR=str(tmp_path / "state"))
    yield env
    stop_services()


def test_up_confinement_flags_reach_the_sidecar(
    up_env: dict[str, str], ray_session: Any, tmp_path: Path
) -> None:
    team = tmp_path / "team"
    address = ray_session.address_info["address"]
    r = cli(
        [
            "up",
            "--address",
            address,
            "--port",
            "0",
            "--allow-save-root",
            str(team),
            "--allow-upload-prefix",
            "memory://bucket/traces",
        ],
        up_env,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr + r.stdout
    state = json.loads((tmp_path / "state" / "sidecar.json").read_text())
    token = (tmp_path / "state" / "token").read_text().strip()
    url, auth = state["url"], {"Authorization": f"Bearer {token}"}

    def create(**extra: Any) -> dict[str, Any]:
        r = httpx.post(f"{url}/api/v1/sessions", json={"steps": [5], **extra}, headers=auth)
        assert r.status_code == 422, r.text
        return {f["field"]: f["message"] for f in r.json()["fields"]}

    # Allowed paths pass the sidecar's checks and reach the coordinator (no agent: 'roles');
    # others are refused by the sidecar, naming the field.
    assert "roles" in create(save_path=str(team / "run1"))
    assert "roles" in create(save_path=f"{state['save_root']}/run1")
    assert "save_path" in create(save_path=str(tmp_path / "elsewhere"))
    assert "roles" in create(save_path="team/run2")  # relative: against the base dir (HOME)
    assert "roles" in create(upload_uri="memory://bucket/traces/run1")
    assert "upload_uri" in create(upload_uri="memory://bucket/other")
    assert "finish_hook_cmd" in create(finish_hook_cmd="echo hi")  # not allowed at `up`
    r = cli(["down"], up_env)
    assert r.returncode == 0, r.stderr
