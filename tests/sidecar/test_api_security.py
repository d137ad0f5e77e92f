"""Sidecar security over real HTTP: the token rule beyond loopback, save_path / upload_uri
confinement, the request size limit, hook commands only when the operator allowed them, and
the Host header rule (DNS rebinding)."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from profd.core.settings import SidecarConfig

from helpers import AUTH, TOKEN, start_agents


@pytest.fixture
def actor(local_coordinator) -> Iterator[Any]:
    (agent,) = start_agents(local_coordinator, 1, "actor")
    yield agent
    agent.close(timeout=10)


def post_session(url: str, body: dict[str, Any], headers: dict[str, str] = AUTH) -> httpx.Response:
    # ASCII JSON, as json.dumps writes it: a lone surrogate travels as its escape
    content = json.dumps(body).encode()
    headers = {**headers, "content-type": "application/json"}
    return httpx.post(f"{url}/api/v1/sessions", content=content, headers=headers)


def field_error(r: httpx.Response, field: str) -> str:
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error"] == "invalid_request"
    messages = [f["message"] for f in body["fields"] if f["field"] == field]
    assert messages, body
    return messages[0]


# -- the token --------------------------------------------------------------------------------
READS = [
    "/api/v1/status",
    "/api/v1/agents",
    "/api/v1/sessions",
    "/api/v1/sessions/s1",
    "/api/v1/sessions/s1/summary",
    "/api/v1/traces",
    "/api/v1/traces/0123456789abcdef/download",
    "/metrics",
]


def test_beyond_loopback_every_route_needs_the_token(make_sidecar) -> None:
    # Configured as if bound to every interface; served on 127.0.0.1 (tests stay on loopback).
    with make_sidecar(host="0.0.0.0") as sidecar:
        url = sidecar.url
        for path in READS:
            r = httpx.get(url + path)
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"] == "unauthorized" and r.headers["www-authenticate"] == "Bearer"
            wrong = httpx.get(url + path, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 403 and wrong.json()["message"] == "invalid token"
            ok = httpx.get(url + path, headers=AUTH)
            assert ok.status_code in (200, 404), (path, ok.text)  # 404: unknown ids
        # Liveness, the data-free dashboard page and the schema stay open.
        assert httpx.get(f"{url}/healthz").status_code == 200
        assert httpx.get(f"{url}/").status_code == 200
        assert httpx.get(f"{url}/openapi.json").status_code == 200
        assert post_session(url, {"steps": [1]}, headers={}).status_code == 401


def test_on_loopback_reads_are_open_and_changes_are_not(make_sidecar, local_coordinator) -> None:
    with make_sidecar() as sidecar:
        url = sidecar.url
        for path in READS:
            assert httpx.get(url + path).status_code in (200, 404), path
        r = httpx.post(f"{url}/api/v1/sessions/s1/cancel")
        assert r.status_code == 401
        assert post_session(url, {"steps": [1]}, headers={}).status_code == 401
        for bad in (f"Bearer {TOKEN[:6]}", f"Bearer {TOKEN}x", f"Basic {TOKEN}", "Bearer", TOKEN):
            r = post_session(url, {"steps": [1]}, headers={"Authorization": bad})
            assert r.status_code in (401, 403), bad
        # The scheme is case-insensitive; a 422 shows the token was accepted.
        r = post_session(url, {"steps": []}, headers={"Authorization": f"bearer {TOKEN}"})
        assert field_error(r, "steps") == "must list at least one step"
    assert local_coordinator.call("list_sessions") == []


def test_binding_beyond_loopback_without_a_token_is_refused() -> None:
    with pytest.raises(ValueError, match="beyond loopback"):
        SidecarConfig(host="0.0.0.0")
    assert SidecarConfig(host="::1").loopback and SidecarConfig(host="localhost").loopback
    assert not SidecarConfig(host="10.1.2.3", token="t").loopback


# -- save_path --------------------------------------------------------------------------------
def test_save_path_must_stay_under_the_save_root(
    make_sidecar, actor, local_coordinator, tmp_path
) -> None:
    root = Path(local_coordinator.coordinator.settings.save_root)
    root.mkdir(parents=True, exist_ok=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "escape")
    with make_sidecar() as sidecar:
        url = sidecar.url
        for bad in ("/etc", f"{root}/../outside", f"{root}/escape/x", f"{root}x"):
            msg = field_error(post_session(url, {"steps": [5], "save_path": bad}), "save_path")
            assert "allowed save root" in msg and str(root) in msg, msg
        msg = field_error(post_session(url, {"steps": [5], "save_path": "rel"}), "save_path")
        assert "absolute" in msg
        assert local_coordinator.call("list_sessions") == []  # nothing half-applied
        r = post_session(url, {"steps": [5], "save_path": f"{root}/mine"})
        assert r.status_code == 201, r.text
        assert r.json()["save_dir"].startswith(f"{root}/mine/")


def test_operator_allowed_save_roots_and_relative_paths(make_sidecar, actor, tmp_path) -> None:
    extra = tmp_path / "team"
    with make_sidecar(save_roots=(str(extra),), base_dir=str(tmp_path)) as sidecar:
        url = sidecar.url
        r = post_session(url, {"steps": [5], "save_path": "team/run1"})
        assert r.status_code == 201, r.text
        assert r.json()["save_dir"].startswith(f"{extra}/run1/")
        msg = field_error(post_session(url, {"steps": [6], "save_path": "team/../x"}), "save_path")
        assert str(tmp_path / "x") in msg


# -- upload_uri -------------------------------------------------------------------------------
def test_upload_uri_is_refused_unless_a_prefix_is_allowed(make_sidecar, local_coordinator) -> None:
    with make_sidecar() as sidecar:
        url = sidecar.url
        r = post_session(url, {"steps": [5], "upload_uri": "memory://bucket/traces"})
        assert "uploads over HTTP are disabled" in field_error(r, "upload_uri")
        # the operator's rule first, not this host's missing package for the protocol
        assert importlib.util.find_spec("s3fs") is None
        r = post_session(url, {"steps": [5], "upload_uri": "s3://bucket/traces"})
        assert "uploads over HTTP are disabled" in field_error(r, "upload_uri")
        trigger = {"name": "slow", "when": {"role": "actor", "factor": 2.0}}
        r = httpx.post(
            f"{url}/api/v1/triggers",
            json={**trigger, "session": {"upload_uri": "s3://bucket/traces"}},
            headers=AUTH,
        )
        assert "uploads over HTTP are disabled" in field_error(r, "session.upload_uri")
        # a body FastAPI does not read as JSON, nested past the parser's depth: a 422
        for headers in ({"content-type": "text/plain"}, {}):
            for path in ("/api/v1/sessions", "/api/v1/triggers"):
                r = httpx.post(f"{url}{path}", content=b"[" * 5000, headers={**AUTH, **headers})
                assert r.status_code == 422, (path, headers, r.text)
    assert local_coordinator.call("list_sessions") == []
    assert local_coordinator.call("list_triggers") == []


def test_upload_uri_must_start_with_an_allowed_prefix(make_sidecar, actor, tmp_path) -> None:
    bucket = tmp_path / "bucket"
    prefixes = ("memory://bucket/traces", f"file://{bucket}")
    with make_sidecar(upload_prefixes=prefixes) as sidecar:
        url = sidecar.url
        for bad, rule in [
            ("memory://bucket/tracesX", "allowed upload prefix"),
            ("memory://bucket/traces/../other", "'..' segments"),
            ("memory://other/traces", "allowed upload prefix"),
            (f"file://{bucket}/../etc", "'..' segments"),
            (f"file://{tmp_path}", "allowed upload prefix"),
            ("simplecache::memory://bucket/traces", "chain filesystems"),
            ("s3://bucket/traces", "allowed upload prefix"),  # not "Install s3fs"
            (f"file://{bucket}/\ud800", "lone surrogates"),  # (was a 500 from realpath)
        ]:
            msg = field_error(post_session(url, {"steps": [5], "upload_uri": bad}), "upload_uri")
            assert rule in msg, (bad, msg)
        r = post_session(url, {"steps": [5], "upload_uri": "memory://bucket/traces/run1"})
        assert r.status_code == 201, r.text
        sid = r.json()["session_id"]
        httpx.post(f"{url}/api/v1/sessions/{sid}/cancel", headers=AUTH).raise_for_status()
        r = post_session(url, {"steps": [6], "upload_uri": f"file://{bucket}/run2"})
        assert r.status_code == 201, r.text


# -- hooks ------------------------------------------------------------------------------------
def test_hook_commands_only_when_allowed(make_sidecar, actor) -> None:
    body = {"steps": [5], "finish_hook_cmd": "echo done"}
    with make_sidecar() as sidecar:
        url = sidecar.url
        assert "--allow-hook-commands" in field_error(post_session(url, body), "finish_hook_cmd")
    with make_sidecar(allow_hook_commands=True) as sidecar:
        url = sidecar.url
        r = post_session(url, body)
        assert r.status_code == 201 and r.json()["request"]["finish_hook_cmd"] == "echo done"


# -- request size -----------------------------------------------------------------------------
def test_windows_are_bounded(make_sidecar, local_coordinator) -> None:
    with make_sidecar(max_window_steps=100) as sidecar:
        url = sidecar.url
        msg = field_error(post_session(url, {"next_steps": 500}), "next_steps")
        assert "at most 100 steps" in msg  # the operator's cap
        msg = field_error(post_session(url, {"next_steps": 2**63 - 1}), "next_steps")
        assert "less than or equal to 10000" in msg  # the model's own bound
        msg = field_error(post_session(url, {"steps": list(range(101))}), "steps")
        assert "at most 100 steps per session, got 101" in msg
    assert local_coordinator.call("list_sessions") == []


def test_oversized_bodies_get_413(make_sidecar, local_coordinator) -> None:
    big = {"steps": [1], "roles": {"actor": {"ranks": list(range(300_000))}}}  # about 2 MB
    with make_sidecar(max_body_bytes=64 * 1024) as sidecar:
        url = sidecar.url
        r = post_session(url, big)
        assert r.status_code == 413, r.text
        body = r.json()
        assert body["error"] == "payload_too_large" and "65536" in body["message"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"steps": [1], "roles": {"actor": {"ranks": ['
            for _ in range(2000):
                yield b"0, " * 100
            yield b"0]}}}"

        r = httpx.post(
            f"{url}/api/v1/sessions",
            content=chunks(),
            headers={**AUTH, "content-type": "application/json"},
        )
        assert r.status_code == 413, r.text
        assert r.json()["error"] == "payload_too_large"
        # Under the limit the same route answers normally (no agent: 422 naming roles).
        assert field_error(post_session(url, {"next_steps": 1}), "roles")
    assert local_coordinator.call("list_sessions") == []


def test_only_files_inside_the_session_directory_are_indexed_or_served(
    make_sidecar, actor, local_coordinator, tmp_path
) -> None:
    """Downloads serve indexed traces only, and an agent cannot get a file outside its
    session's directory indexed — not by an absolute path, not through ``..``."""
    from profd.core.naming import trace_id_for
    from profd.core.protocol import AgentEvent, EventKind, PartDone, TraceWritten

    secret = tmp_path / "secret.txt"
    secret.write_text("not a trace")
    with make_sidecar() as sidecar:
        url = sidecar.url
        sid = post_session(url, {"steps": [10**6]}).json()["session_id"]
        save_dir = local_coordinator.call("get_session", sid).save_dir
        inside = Path(save_dir) / "actor_train_step1_rank0.json.gz"
        inside.parent.mkdir(parents=True, exist_ok=True)
        inside.write_bytes(b"\x1f\x8b")
        escapes = [str(secret), f"{save_dir}/../../secret.txt", "relative/trace.json.gz"]
        events = [
            AgentEvent(
                EventKind.TRACE,
                sid,
                1,
                payload=TraceWritten(trace_id_for(None, p), p, 1, (1,), "train", "torch"),
            )
            for p in [*escapes, str(inside)]
        ]
        assert local_coordinator.call("report", actor.agent_id, events)
        listed = httpx.get(f"{url}/api/v1/traces", params={"session_id": sid}).json()["data"]
        assert [t["path"] for t in listed] == [str(inside)]
        for p in escapes:
            r = httpx.get(f"{url}/api/v1/traces/{trace_id_for(None, p)}/download")
            assert r.status_code == 404, r.text
        warnings = local_coordinator.call("get_session", sid).warnings
        assert sum("outside the session directory" in w for w in warnings) == 3
        # a refused file never counts as recorded: the part ends partial, saying why
        done = AgentEvent(EventKind.PART_DONE, sid, 1, payload=PartDone(recorded=(1,)))
        assert local_coordinator.call("report", actor.agent_id, [done])
        view = local_coordinator.call("get_session", sid)
        (part,) = view.targets
        assert part.state.value == "partial" and "outside the session directory" in part.reason
        assert [t.path for t in view.traces] == [str(inside)]


def test_reused_token_file_is_made_owner_only_again(tmp_path) -> None:
    import stat

    from profd.cli.ray_cluster import read_or_create_token

    token, path = read_or_create_token(tmp_path / "state")
    os.chmod(path, 0o644)
    os.chmod(path.parent, 0o755)
    again, _ = read_or_create_token(tmp_path / "state")
    assert again == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_the_token_is_compared_in_constant_time(make_sidecar, monkeypatch) -> None:
    import secrets

    seen: list[tuple[bytes, bytes]] = []
    real = secrets.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(secrets, "compare_digest", spy)
    with make_sidecar() as sidecar:
        url = sidecar.url
        wrong = {"Authorization": "Bearer wrong-token"}
        assert httpx.post(f"{url}/api/v1/sessions/x/cancel", headers=wrong).status_code == 403
    assert seen == [(b"wrong-token", TOKEN.encode())]


# -- the Host header (DNS rebinding) ----------------------------------------------------------
HOST_ROUTES = ["/api/v1/traces", "/api/v1/status", "/", "/healthz", "/metrics", "/openapi.json"]


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def raw_request(url: str, head: str) -> tuple[int, dict[str, Any]]:
    """Send ``head`` (request line and headers, CRLF-separated, no blank line) over a plain
    socket; the status and the JSON body of the answer (the sidecar closes after it)."""
    import json
    import socket

    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    body = rest.split(b"\r\n\r\n", 1)[1]
    return int(status_line.split()[1]), json.loads(body) if body.startswith(b"{") else {}


def assert_host_refused(r: httpx.Response, host: str) -> None:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["error"] == "host_not_allowed" and body["fields"][0]["field"] == "host"
    msg = body["message"]
    assert repr(host) in msg and "localhost" in msg and "profd up --allow-host NAME" in msg, msg


@pytest.fixture
def indexed_trace(make_sidecar, actor, local_coordinator) -> Iterator[tuple[str, str]]:
    """A sidecar on loopback holding one indexed trace: ``(url, trace_id)``."""
    from profd.core.naming import trace_id_for
    from profd.core.protocol import AgentEvent, EventKind, TraceWritten

    with make_sidecar() as sidecar:
        url = sidecar.url
        sid = post_session(url, {"steps": [10**6]}).json()["session_id"]
        save_dir = local_coordinator.call("get_session", sid).save_dir
        path = Path(save_dir) / "actor_train_step1_rank0.json.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x1f\x8b trace bytes")
        tid = trace_id_for(None, str(path))
        written = TraceWritten(tid, str(path), 1, (1,), "train", "torch")
        event = AgentEvent(EventKind.TRACE, sid, 1, payload=written)
        assert local_coordinator.call("report", actor.agent_id, [event])
        yield url, tid


def test_requests_naming_another_host_are_refused_on_every_route(
    indexed_trace, local_coordinator
) -> None:
    """On loopback a page on attacker.example whose name rebinds to 127.0.0.1 reaches the
    sidecar, but its requests say ``Host: attacker.example``: every route refuses them."""
    url, tid = indexed_trace
    download = f"/api/v1/traces/{tid}/download"
    port = port_of(url)
    assert httpx.get(url + download).content == b"\x1f\x8b trace bytes"  # reachable as itself
    assert len(httpx.get(f"{url}/api/v1/traces").json()["data"]) == 1
    sessions = local_coordinator.call("list_sessions")
    (sid,) = [s.session_id for s in sessions]
    state = local_coordinator.call("get_session", sid).state
    for host in (
        "attacker.example",
        f"attacker.example:{port}",
        f"localhost.attacker.example:{port}",
        f"127.0.0.1.nip.io:{port}",
        f"localhost:{port}@attacker.example",
        "[::1",
        "localhost:99999",  # not a TCP port
        "[::1]:65536",
        "127.0.0.1:\u00b2",  # a digit to str.isdigit, not to a port
    ):
        raw = host.encode("latin-1")
        for path in [*HOST_ROUTES, download, "/docs", "/api/v1/sessions"]:
            r = httpx.get(url + path, headers={"Host": raw})
            assert_host_refused(r, host)
            assert "trace bytes" not in r.text
        # changes too, with the right token, before the body is even looked at
        r = httpx.post(f"{url}/api/v1/sessions", json={"steps": [7]}, headers={**AUTH, "Host": raw})
        assert_host_refused(r, host)
        r = httpx.post(f"{url}/api/v1/sessions/{sid}/cancel", headers={**AUTH, "Host": raw})
        assert_host_refused(r, host)
    assert local_coordinator.call("list_sessions") == sessions  # nothing created or cancelled
    assert local_coordinator.call("get_session", sid).state == state


def test_loopback_names_are_answered(indexed_trace) -> None:
    url, tid = indexed_trace
    port = port_of(url)
    for host in (
        f"localhost:{port}",
        f"127.0.0.1:{port}",
        f"[::1]:{port}",
        "localhost",
        "127.0.0.1",
        "[::1]",
        f"LocalHost:{port}",
        f"localhost.:{port}",
        f"127.0.0.2:{port}",  # any 127.x.y.z
        f"127.255.0.1:{port}",
    ):
        for path in HOST_ROUTES:
            r = httpx.get(url + path, headers={"Host": host})
            assert r.status_code == 200, (host, path, r.text)
        r = httpx.get(f"{url}/api/v1/traces/{tid}/download", headers={"Host": host})
        assert r.status_code == 200 and r.content == b"\x1f\x8b trace bytes"
    # a POST passes the check too (the body is then judged: no agent matches rank 9)
    r = post_session(url, {"steps": [3], "roles": {"actor": {"ranks": [9]}}}, {**AUTH})
    assert r.status_code in (201, 422), r.text


def test_a_missing_or_repeated_host_header_is_refused(make_sidecar) -> None:
    with make_sidecar() as sidecar:
        url = sidecar.url
        status, body = raw_request(url, "GET /api/v1/traces HTTP/1.0")
        assert status == 400 and body["error"] == "host_not_allowed"
        assert "no Host header" in body["message"] and "--allow-host" in body["message"]
        status, body = raw_request(url, "GET /healthz HTTP/1.0")
        assert status == 400
        # HTTP/1.1 without a Host, or with two: uvicorn's parser may refuse them itself (400,
        # not JSON); what gets through, the check refuses
        status, body = raw_request(url, "GET /api/v1/traces HTTP/1.1\r\nConnection: close")
        assert status == 400 and body.get("error", "host_not_allowed") == "host_not_allowed"
        two = "GET /api/v1/traces HTTP/1.1\r\nHost: localhost\r\nHost: attacker.example"
        status, body = raw_request(url, two + "\r\nConnection: close")
        assert status == 400 and "2 Host headers" in body.get("message", "2 Host headers")
        # the same raw request naming the sidecar is answered
        status, body = raw_request(url, "GET /api/v1/traces HTTP/1.0\r\nHost: 127.0.0.1")
        assert status == 200 and body["data"] == []


def test_operator_allowed_host_names_are_answered(make_sidecar) -> None:
    names = ("profd.internal", "Profd.Example.COM", "10.20.30.40", "[fd00::5]")
    with make_sidecar(allowed_hosts=names) as sidecar:
        url = sidecar.url
        port = port_of(url)
        for host in (
            "profd.internal",
            f"PROFD.internal:{port}",
            "profd.example.com:443",
            "10.20.30.40",
            f"[fd00::5]:{port}",
            f"localhost:{port}",
        ):
            r = httpx.get(f"{url}/api/v1/traces", headers={"Host": host})
            assert r.status_code == 200, (host, r.text)
        for host in ("other.internal", "internal", "x.profd.internal", "10.20.30.41"):
            r = httpx.get(f"{url}/api/v1/traces", headers={"Host": host})
            assert_host_refused(r, host)
            assert "profd.internal" in r.json()["message"]


def test_a_star_turns_the_host_check_off(make_sidecar) -> None:
    with make_sidecar(allowed_hosts=("*",)) as sidecar:
        url = sidecar.url
        r = httpx.get(f"{url}/api/v1/traces", headers={"Host": "attacker.example"})
        assert r.status_code == 200, r.text
        status, _ = raw_request(url, "GET /api/v1/traces HTTP/1.0")
        assert status == 200


def test_bind_address_and_wildcard_defaults(make_sidecar) -> None:
    import socket

    # Configured as bound to one address (served on 127.0.0.1): that address and loopback.
    with make_sidecar(host="10.1.2.3") as sidecar:
        url = sidecar.url
        for host, ok in [("10.1.2.3:8470", True), ("localhost", True), ("10.1.2.4", False)]:
            r = httpx.get(f"{url}/healthz", headers={"Host": host})
            assert (r.status_code == 200) is ok, (host, r.text)
    # Every interface: loopback, this machine's names and any address literal, no other name.
    with make_sidecar(host="0.0.0.0") as sidecar:
        url = sidecar.url
        port = port_of(url)
        accepted = [
            socket.gethostname(),
            f"{socket.getfqdn().upper()}:{port}",
            "192.168.7.7",
            f"[fe80::1]:{port}",
            "localhost",
        ]
        for host in accepted:
            r = httpx.get(f"{url}/api/v1/traces", headers={"Host": host, **AUTH})
            assert r.status_code == 200, (host, r.text)
        r = httpx.get(f"{url}/api/v1/traces", headers={"Host": "attacker.example", **AUTH})
        assert_host_refused(r, "attacker.example")
        assert "any IP address" in r.json()["message"]


def test_allowed_hosts_entries_are_checked_and_normalised() -> None:
    from pydantic import ValidationError

    config = SidecarConfig(allowed_hosts=("Profd.Example.", "profd.example:8470", "[FD00::1]"))
    assert config.allowed_hosts == ("profd.example", "fd00::1")
    assert SidecarConfig(allowed_hosts=("*",)).allowed_hosts == ("*",)
    for bad, rule in [
        ("", "must not be empty"),
        ("profd example", "spaces"),
        ("http://profd.example", "URL"),
        ("profd.example/api", "path"),
        ("a.example,b.example", "one per entry"),
        ("*.example", "wildcards"),
        ("profd.example:http", "port"),
        ("profd.example:70000", "port"),
        ("[::1", "brackets"),
    ]:
        with pytest.raises(ValidationError) as info:
            SidecarConfig(allowed_hosts=("ok.example", bad))
        (err,) = info.value.errors()
        assert err["loc"] == ("allowed_hosts",) and "allowed_hosts" in err["msg"], err
        assert rule in err["msg"] and "--allow-host" in err["msg"], err["msg"]
