"""Downloads after a restart on a new Ray cluster (``profd down`` then ``profd up``): Ray node
ids change with each cluster, so a trace of an earlier one is located by its node's address
or host name. Real traces recorded by agents, a coordinator restarted on the state they left,
a real uvicorn sidecar on the test session's real Ray; the CLI as a subprocess."""

from __future__ import annotations

import gzip
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from profd.actors.runner import NodeAddress, Placement, locate
from profd.api.deps import get_node_id, get_runner

from helpers import coordinator_settings, start_agents, start_sidecar, wait_terminal, wait_until

PROFD = [sys.executable, "-m", "profd.cli.main"]
GONE_ID = "0f" * 28  # a node id of a cluster that no longer exists
FOREIGN_IP = "203.0.113.9"  # TEST-NET-3: no node of any cluster here


# -- the locating function, without Ray -------------------------------------------------------
LIVE = [NodeAddress("here", "10.0.0.1", "host-a"), NodeAddress("b-new", "10.0.0.2", "host-b")]


@pytest.mark.parametrize(
    ("node_id", "node_ip", "hostname", "expected"),
    [
        (None, None, "host-a", Placement(local=True)),  # no Ray when it was written
        ("here", "10.0.0.1", "host-a", Placement(local=True)),
        ("b-new", "10.0.0.2", "host-b", Placement(local=False, node_id="b-new")),  # live node
        ("a-old", "10.0.0.1", "renamed", Placement(local=True)),  # our address, earlier cluster
        ("a-old", None, "host-a", Placement(local=True)),  # our host name, no address known
        ("b-old", "10.0.0.2", "host-b", Placement(local=False, node_id="b-new")),  # by address
    ],
)
def test_locate_by_node_id_then_address_and_host(
    node_id: str | None, node_ip: str | None, hostname: str, expected: Placement
) -> None:
    got = locate(
        node_id,
        node_ip,
        hostname,
        here_id="here",
        here_ips=["10.0.0.1"],
        here_hostname="host-a",
        live=LIVE,
    )
    assert got == expected and got.found


def test_locate_names_a_node_that_is_not_in_the_cluster() -> None:
    got = locate("c-old", "10.9.9.9", "host-c", here_id="here", here_ips=["10.0.0.1"], live=LIVE)
    assert not got.found and got.node_id is None
    assert "10.9.9.9 (host-c)" in got.reason and "not in this Ray cluster" in got.reason
    # Not knowing the live nodes (Ray did not answer): try the recorded node, as before.
    unknown = locate("c-old", "10.9.9.9", "host-c", here_id="here", live=None)
    assert unknown == Placement(local=False, node_id="c-old")
    # Without a node id for the sidecar (no Ray): every file is read here.
    assert locate("c-old", "10.9.9.9", "host-c", here_id=None, live=LIVE).local


# -- a coordinator restarted on the state of an earlier cluster -------------------------------
def record(tmp_path: Path) -> list[dict[str, Any]]:
    """A first coordinator (persisting to ``tmp_path/state``) whose two actors record step 1;
    it is then stopped. The stored trace index, one row per trace."""
    from profd.actors.coordinator import ProfileCoordinator
    from profd.testing.coordinator import InProcessCoordinator

    owner = InProcessCoordinator(ProfileCoordinator(coordinator_settings(tmp_path)))
    agents = start_agents(owner, 2, "actor")
    try:
        view = owner.call("create_session", {"steps": [1], "roles": {"actor": {"all_ranks": True}}})
        wait_until(lambda: all(a.plan.windows for a in agents), 10, what="plans")
        for n in (1, 2):
            for a in agents:
                with a.step(n), a.stage("work"):
                    torch.ones(4) @ torch.ones(4)
        assert wait_terminal(owner, view.session_id).state.value == "done"
    finally:
        for a in agents:
            a.close(timeout=10)
        stop(owner)
    with store(tmp_path) as st:
        return sorted(st.load()["traces"], key=lambda t: t["rank"])


def stop(owner: Any) -> None:
    """Stop an in-process coordinator and let go of its state directory."""
    owner.close()
    close = getattr(owner.coordinator, "close", None)
    if close is not None:
        close()


@contextmanager
def store(tmp_path: Path) -> Iterator[Any]:
    """The state store the coordinators of ``tmp_path`` use, opened while none runs."""
    from profd.actors.store import open_store

    st = open_store(str(tmp_path / "state"))
    try:
        yield st
    finally:
        close = getattr(st, "close", None)
        if close is not None:
            close()


def rewrite(tmp_path: Path, trace: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """The index row of ``trace`` as an earlier cluster would have left it."""
    row = {**trace, **changes}
    with store(tmp_path) as st:
        st.save_trace(row["trace_id"], row["session_id"], row)
    return row


@contextmanager
def restarted(tmp_path: Path, **overrides: Callable[[], Any]) -> Iterator[str]:
    """A new coordinator on the stored state and a sidecar on it; the sidecar's URL."""
    from profd.actors.coordinator import ProfileCoordinator
    from profd.testing.coordinator import InProcessCoordinator

    owner = InProcessCoordinator(ProfileCoordinator(coordinator_settings(tmp_path)))
    deps = {{"runner": get_runner, "node_id": get_node_id}[k]: v for k, v in overrides.items()}
    try:
        with start_sidecar(owner, token=None, dependency_overrides=deps) as sidecar:
            yield sidecar.url
    finally:
        stop(owner)


def head_ip(ray_session: Any) -> str:
    import ray

    (ip,) = {n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == ray_session.node_id}
    return ip


@pytest.fixture
def earlier(ray_session: Any, tmp_path: Path) -> list[dict[str, Any]]:
    """Two traces of an earlier cluster: rank 0 written on this machine (its node id gone),
    rank 1 on a node whose address no node of this cluster has."""
    mine, theirs = record(tmp_path)
    assert mine["node_id"] == ray_session.node_id  # written under this Ray, as agents do
    return [
        rewrite(tmp_path, mine, node_id=GONE_ID, node_ip=head_ip(ray_session)),
        rewrite(tmp_path, theirs, node_id="1e" * 28, node_ip=FOREIGN_IP, hostname="gone-node"),
    ]


def test_downloads_after_a_restart_on_a_new_cluster(
    earlier: list[dict[str, Any]], ray_session: Any, tmp_path: Path
) -> None:
    mine, theirs = earlier
    assert mine["hostname"] == socket.gethostname()
    with restarted(tmp_path) as url:
        r = httpx.get(f"{url}/api/v1/traces/{mine['trace_id']}/download")
        assert r.status_code == 200, r.text
        assert r.content == Path(mine["path"]).read_bytes() and len(r.content) == mine["bytes"]
        assert r.headers["x-profd-node"] == ray_session.node_id  # read here
        assert b'"distributedInfo"' in gzip.decompress(r.content)

        r = httpx.get(f"{url}/api/v1/traces/{theirs['trace_id']}/download")
        assert r.status_code == 404 and r.json()["error"] == "not_found"
        message = r.json()["message"]
        assert f"{FOREIGN_IP} (gone-node)" in message and "not in this Ray cluster" in message
        assert "TaskUnschedulableError" not in message

        # The session's summary reads what it can and says what it could not.
        summary = httpx.get(f"{url}/api/v1/sessions/{mine['session_id']}/summary")
        assert summary.status_code == 200, summary.text
        body = summary.json()
        assert [t["rank"] for t in body["tracks"]] == [0] and "work" in body["stages"]
        (skipped,) = body["skipped"]
        assert skipped["name"] == theirs["file_name"] and FOREIGN_IP in skipped["reason"]


def test_a_trace_of_an_earlier_cluster_is_read_on_the_live_node_with_its_address(
    earlier: list[dict[str, Any]], tmp_path: Path
) -> None:
    """A node that came back under a new id (same address) serves its files: the read runs
    there (a runner standing in for Ray's node placement records where)."""
    mine, _ = earlier
    rewrite(tmp_path, mine, node_id="b0" * 28, node_ip="10.0.0.2", hostname="node-b")

    class Runner:
        def __init__(self) -> None:
            self.ran_on: set[str | None] = set()

        async def run(self, node_id: str | None, fn: Any, *args: Any) -> Any:
            self.ran_on.add(node_id)
            return fn(*args)

        async def nodes(self) -> list[NodeAddress]:
            return [NodeAddress("head", "10.0.0.1", "head"), NodeAddress("b1", "10.0.0.2")]

    runner = Runner()
    with restarted(tmp_path, runner=lambda: runner, node_id=lambda: "head") as url:
        r = httpx.get(f"{url}/api/v1/traces/{mine['trace_id']}/download")
        assert r.status_code == 200, r.text
        assert r.content == Path(mine["path"]).read_bytes()
        assert r.headers["x-profd-node"] == "b1" and runner.ran_on == {"b1"}
        head = httpx.head(f"{url}/api/v1/traces/{mine['trace_id']}/download")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == str(len(r.content))
        assert head.headers["x-profd-node"] == "b1"


def test_cli_download_goes_on_past_a_failure_and_reports_it(
    earlier: list[dict[str, Any]], ray_session: Any, tmp_path: Path
) -> None:
    mine, theirs = earlier
    theirs = rewrite(tmp_path, theirs, node_id=GONE_ID, node_ip=head_ip(ray_session))
    Path(theirs["path"]).unlink()  # this one is gone from disk
    dest = tmp_path / "downloaded"
    env = dict(os.environ, HOME=str(tmp_path), PROFD_STATE_DIR=str(tmp_path / "cli"))
    env["COLUMNS"] = "250"
    with restarted(tmp_path) as url:
        r = subprocess.run(
            [*PROFD, "traces", "--url", url, "--download", str(dest)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "downloaded 1 file(s)" in r.stdout
    err = " ".join(r.stderr.split())
    assert "1 of 2 trace(s) could not be downloaded" in err
    assert f"trace {theirs['trace_id']} ({theirs['file_name']}): HTTP 404:" in err
    assert "is gone from" in err
    folder = dest / mine["session_id"]  # no --session: a folder per session
    assert sorted(p.name for p in folder.iterdir()) == [mine["file_name"]]  # no .part left
    assert (folder / mine["file_name"]).read_bytes() == Path(mine["path"]).read_bytes()
