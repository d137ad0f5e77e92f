"""Each route's error codes over real HTTP, the one error body everywhere, and an OpenAPI
schema that describes every field, parameter and error response."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from profd.api import create_app
from profd.core.settings import SidecarConfig

from helpers import AUTH, TOKEN, LoopClient, Sidecar, start_agents


@pytest.fixture
def url(sidecar: Sidecar) -> str:
    return sidecar.url


CASES = [
    # (method, path, json body, headers, status, error code, words in the message)
    ("GET", "/api/v1/sessions/has%20space", None, {}, 422, "invalid_request", "session_id"),
    ("GET", "/api/v1/sessions/" + "x" * 65, None, {}, 422, "invalid_request", "session_id"),
    ("GET", "/api/v1/sessions/nope", None, {}, 404, "not_found", "no session 'nope'"),
    ("GET", "/api/v1/sessions/nope/summary", None, {}, 404, "not_found", "nope"),
    ("GET", "/api/v1/sessions/a%2Fb/summary", None, {}, 404, "not_found", ""),
    ("POST", "/api/v1/sessions/nope/cancel", None, {}, 401, "unauthorized", "bearer token"),
    ("POST", "/api/v1/sessions/nope/cancel", None, AUTH, 404, "not_found", "nope"),
    ("POST", "/api/v1/sessions/x%20y/cancel", None, AUTH, 422, "invalid_request", "session_id"),
    ("GET", "/api/v1/traces?rank=-1", None, {}, 422, "invalid_request", "rank"),
    ("GET", "/api/v1/traces?rank=abc", None, {}, 422, "invalid_request", "rank"),
    ("GET", f"/api/v1/traces?rank={2**53}", None, {}, 422, "invalid_request", "rank"),
    ("GET", "/api/v1/traces?limit=501", None, {}, 422, "invalid_request", "limit"),
    ("GET", "/api/v1/traces?limit=0", None, {}, 422, "invalid_request", "limit"),
    ("GET", "/api/v1/traces?cursor=bm9wZQ", None, {}, 422, "invalid_request", "cursor"),
    ("GET", "/api/v1/sessions?limit=501", None, {}, 422, "invalid_request", "limit"),
    ("GET", "/api/v1/sessions?limit=1e2", None, {}, 422, "invalid_request", "limit"),
    ("GET", "/api/v1/sessions?cursor=%25%25", None, {}, 422, "invalid_request", "cursor"),
    ("GET", "/api/v1/sessions?cursor=" + "A" * 513, None, {}, 422, "invalid_request", "cursor"),
    ("GET", "/api/v1/traces/not-hex/download", None, {}, 422, "invalid_request", "trace_id"),
    ("GET", "/api/v1/traces/0123456789abcdef/download", None, {}, 404, "not_found", "no trace"),
    ("POST", "/api/v1/sessions", [1, 2], AUTH, 422, "invalid_request", ""),
    ("POST", "/api/v1/sessions", {"steps": [1]}, {}, 401, "unauthorized", "profd up"),
    ("POST", "/api/v1/sessions", {"steps": [2**70]}, AUTH, 422, "invalid_request", "steps.0"),
    ("DELETE", "/api/v1/sessions", None, AUTH, 405, "method_not_allowed", ""),
    ("GET", "/api/v2/nothing", None, {}, 404, "not_found", ""),
]


@pytest.mark.parametrize(("method", "path", "body", "headers", "status", "code", "words"), CASES)
def test_error_codes_and_one_body(
    url: str, method: str, path: str, body: Any, headers: dict, status: int, code: str, words: str
) -> None:
    r = httpx.request(method, url + path, json=body, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()
    assert set(err) <= {"error", "message", "fields", "detail"} and err["error"] == code
    assert isinstance(err["fields"], list) and words in err["message"] + str(err["fields"])


def test_unreadable_body_is_422_naming_the_body(url: str) -> None:
    r = httpx.post(
        f"{url}/api/v1/sessions",
        content=b'{"steps": [1], "tool": "\xff\xfe"}',  # not UTF-8
        headers={**AUTH, "content-type": "application/json"},
    )
    assert r.status_code == 422, r.text
    assert r.json()["error"] == "invalid_request" and r.json()["fields"][0]["field"] == "body"
    for shape in ([1, 2], "steps", 3):  # JSON, but not an object: named "body", not ""
        r = httpx.post(f"{url}/api/v1/sessions", json=shape, headers=AUTH)
        assert r.status_code == 422 and r.json()["fields"][0]["field"] == "body", r.text
        assert r.json()["message"].startswith("body: ")


def test_create_list_get_cancel_and_listing_filters(url: str, local_coordinator) -> None:
    agents = start_agents(local_coordinator, 2, "actor")
    try:
        r = httpx.post(
            f"{url}/api/v1/sessions",
            json={"steps": [7], "roles": {"actor": {"ranks": [1]}}},
            headers=AUTH,
        )
        assert r.status_code == 201
        sid = r.json()["session_id"]
        assert [s["session_id"] for s in httpx.get(f"{url}/api/v1/sessions").json()["data"]] == [
            sid
        ]
        assert httpx.get(f"{url}/api/v1/sessions/{sid}").json()["targets"][0]["rank"] == 1
        # The second request for the same rank names the holder (409), nothing is created.
        r = httpx.post(
            f"{url}/api/v1/sessions",
            json={"steps": [8], "roles": {"actor": {"ranks": [1]}}},
            headers=AUTH,
        )
        assert r.status_code == 409 and r.json()["detail"]["holders"] == [sid]
        assert httpx.get(f"{url}/api/v1/sessions").json()["count"] == 1
        r = httpx.post(f"{url}/api/v1/sessions/{sid}/cancel", headers=AUTH)
        assert r.status_code == 200 and r.json()["state"] == "cancelled"
        listing = httpx.get(f"{url}/api/v1/traces", params={"session_id": sid, "role": "actor"})
        assert listing.json() == {
            "data": [],
            "count": 0,
            "total": 0,
            "next_cursor": None,
            "bytes": 0,
        }
    finally:
        for a in agents:
            a.close(timeout=10)


def test_oversized_integers_are_refused_whole_and_hold_nothing(url: str, local_coordinator) -> None:
    """Integers no JSON reader keeps exactly are a 422 naming the field, before anything is
    held: the same rank is free for the next request."""
    agents = start_agents(local_coordinator, 1, "actor")
    try:
        for body, field in (
            ({"steps": [5], "roles": {"actor": {"ranks": [0, 2**70]}}}, "roles.actor.ranks.1"),
            ({"steps": [5], "finish_hook_ranks": [2**64]}, "finish_hook_ranks.0"),
        ):
            r = httpx.post(f"{url}/api/v1/sessions", json=body, headers=AUTH)
            assert r.status_code == 422, r.text
            assert field in [f["field"] for f in r.json()["fields"]]
        assert httpx.get(f"{url}/api/v1/sessions").json()["data"] == []
        r = httpx.post(f"{url}/api/v1/sessions", json={"steps": [5]}, headers=AUTH)
        assert r.status_code == 201, r.text
        status = httpx.get(f"{url}/api/v1/status").json()
        assert status["state_write_failures"] == 0 and status["state_last_error"] is None
    finally:
        for a in agents:
            a.close()


def test_without_a_configured_token_changes_are_open(make_sidecar, local_coordinator) -> None:
    (agent,) = start_agents(local_coordinator, 1, "actor")
    try:
        with make_sidecar(token=None) as srv:
            r = httpx.post(f"{srv.url}/api/v1/sessions", json={"steps": [3]})
            assert r.status_code == 201, r.text
            sid = r.json()["session_id"]
            r = httpx.post(f"{srv.url}/api/v1/sessions/{sid}/cancel")
            assert r.status_code == 200 and r.json()["state"] == "cancelled"
            spec = httpx.get(f"{srv.url}/openapi.json").json()
            assert "securitySchemes" not in spec.get("components", {})
    finally:
        agent.close(timeout=10)


def test_dashboard_page_is_self_contained(url: str) -> None:
    r = httpx.get(f"{url}/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "<script>" in page and "<style>" in page
    assert "http://" not in page and "https://" not in page and "src=" not in page  # no CDN
    assert TOKEN not in page
    csp = r.headers["content-security-policy"]
    assert "script-src 'sha256-" in csp and "connect-src 'self'" in csp
    assert r.headers["x-frame-options"] == "DENY"


def _described(spec: dict, schema: dict) -> bool:
    if schema.get("description"):
        return True
    ref = schema.get("$ref") or next(
        (s.get("$ref") for s in schema.get("allOf", []) + schema.get("anyOf", []) if "$ref" in s),
        None,
    )
    if ref:
        return bool(spec["components"]["schemas"][ref.rsplit("/", 1)[1]].get("description"))
    return False


def test_openapi_describes_every_field_parameter_and_error(local_coordinator) -> None:
    spec = create_app(SidecarConfig(token=TOKEN), client=LoopClient(local_coordinator)).openapi()
    missing = []
    for name, schema in spec["components"]["schemas"].items():
        for prop, ps in schema.get("properties", {}).items():
            if not _described(spec, ps):
                missing.append(f"{name}.{prop}")
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            where = f"{method.upper()} {path}"
            if not op.get("description"):
                missing.append(where)
            missing += [
                f"{where} ?{p['name']}"
                for p in op.get("parameters", [])
                if not p.get("description")
            ]
            for code, resp in op["responses"].items():
                if code.startswith(("4", "5")):
                    ref = resp["content"]["application/json"]["schema"]["$ref"]
                    assert ref.endswith("/ErrorBody"), (where, code, ref)
    assert missing == []
    assert "HTTPValidationError" not in spec["components"]["schemas"]  # one error body only
    secured = {
        (m, p) for p, ops in spec["paths"].items() for m, op in ops.items() if "security" in op
    }
    assert secured == {
        ("post", "/api/v1/sessions"),
        ("post", "/api/v1/sessions/{session_id}/cancel"),
        ("post", "/api/v1/triggers"),
        ("put", "/api/v1/triggers/{trigger_id}"),
        ("delete", "/api/v1/triggers/{trigger_id}"),
    }  # on loopback only changes need the token
    post = spec["paths"]["/api/v1/sessions"]["post"]["responses"]
    assert {"201", "400", "401", "403", "409", "413", "422"} <= set(post)
    # the Host check answers every route, so every operation declares its 400
    assert all("400" in op["responses"] for ops in spec["paths"].values() for op in ops.values())
    assert set(spec["paths"]) >= {
        "/healthz",
        "/metrics",
        "/api/v1/status",
        "/api/v1/agents",
        "/api/v1/sessions",
        "/api/v1/sessions/{session_id}",
        "/api/v1/sessions/{session_id}/cancel",
        "/api/v1/sessions/{session_id}/summary",
        "/api/v1/traces",
        "/api/v1/traces/{trace_id}/download",
    }


def test_freeze_gc_moves_the_startup_heap_out_of_collections(make_sidecar) -> None:
    import gc

    gc.unfreeze()
    try:
        with make_sidecar(token=None, freeze_gc=True) as srv:
            assert httpx.get(f"{srv.url}/healthz").status_code == 200
            assert gc.get_freeze_count() > 10_000  # imports and the app, frozen at start
    finally:
        gc.unfreeze()


def test_summary_cache_is_bounded_and_keeps_what_was_used_last() -> None:
    from profd.api.summaries import SummaryCache

    cache = SummaryCache(2)
    a, b, c = (("a", ()), ("b", ()), ("c", ()))
    cache.put(a, "A")  # type: ignore[arg-type]
    cache.put(b, "B")  # type: ignore[arg-type]
    assert cache.get(a) == "A"  # a is now the most recently used
    cache.put(c, "C")  # type: ignore[arg-type]
    assert cache.get(b) is None and cache.get(a) == "A" and cache.get(c) == "C"


def test_shared_reads_collapse_polling_and_changes_clear_them() -> None:
    import asyncio

    from profd.api.client import SharedReads

    class Counting:
        def __init__(self) -> None:
            self.calls: list[tuple] = []
            self.fail = False

        async def call(self, method: str, *args: Any) -> Any:
            self.calls.append((method, *args))
            await asyncio.sleep(0.01)
            if self.fail:
                raise RuntimeError("coordinator hiccup")
            return {"n": len(self.calls)}

    now = [0.0]
    inner = Counting()
    shared = SharedReads(inner, ttl_s=0.1, clock=lambda: now[0])

    async def scenario() -> None:
        # fifty concurrent polls: one call; their answers are the same object
        first = await asyncio.gather(*[shared.call("status") for _ in range(50)])
        assert len(inner.calls) == 1 and all(r is first[0] for r in first)
        assert await shared.call("list_traces", "s1", None, None) != first[0]  # other key
        now[0] = 0.05
        assert await shared.call("status") is first[0]  # still fresh
        await shared.call("get_trace", "t1")  # not a change: what is held stays
        assert await shared.call("status") is first[0]
        probes = await asyncio.gather(*[shared.call("ping") for _ in range(20)])
        assert [c[0] for c in inner.calls].count("ping") == 1  # liveness probes share one
        assert all(p is probes[0] for p in probes)
        await shared.call("ping")  # within ttl, but the last ping ended: asked again
        assert [c[0] for c in inner.calls].count("ping") == 2
        await shared.call("cancel_session", "s1")  # a change clears what is held
        assert await shared.call("status") is not first[0]
        now[0] = 1.0
        inner.fail = True
        with pytest.raises(RuntimeError):
            await shared.call("status")
        inner.fail = False
        assert await shared.call("status")  # a failed read was not kept
        assert [c[0] for c in inner.calls].count("status") == 4

    asyncio.run(scenario())
