"""The sidecar over real HTTP (uvicorn on 127.0.0.1), with an in-process coordinator swapped
in through ``dependency_overrides``."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from profd.agent import ProfilerAgent
from profd.api.deps import get_client
from profd.core.errors import CoordinatorUnavailable

from helpers import TOKEN, Sidecar, wait_until


def step(agent: ProfilerAgent, n: int) -> None:
    with agent.step(n), agent.stage("work"):
        torch.ones(4) @ torch.ones(4)


@pytest.fixture
def agents(sidecar: Sidecar) -> Iterator[list[ProfilerAgent]]:
    owner = sidecar.owner
    made = [ProfilerAgent("actor", r, 2, find_link=owner.link).start() for r in range(2)]
    made.append(ProfilerAgent("critic", 0, 1, find_link=owner.link).start())
    wait_until(lambda: all(a.connected for a in made), 10, what="registration")
    for a in made:
        step(a, 0)
    yield made
    for a in made:
        a.close(timeout=10)


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_health_status_and_agents(sidecar, agents) -> None:
    url = sidecar.url
    assert httpx.get(f"{url}/healthz").json()["status"] == "ok"
    st = httpx.get(f"{url}/api/v1/status").json()
    assert st["agents"] == 3 and st["agents_by_role"] == {"actor": 2, "critic": 1}
    body = httpx.get(f"{url}/api/v1/agents").json()
    assert body["count"] == 3
    assert [(a["role"], a["rank"]) for a in body["data"]] == [
        ("actor", 0),
        ("actor", 1),
        ("critic", 0),
    ]
    assert all(a["capabilities"]["torch"] is None for a in body["data"])


def test_create_get_list_cancel(sidecar, agents) -> None:
    url = sidecar.url
    req = {"steps": [5, 6], "roles": {"actor": {"ranks": [1, 7]}, "ref": {}}}
    r = httpx.post(f"{url}/api/v1/sessions", json=req, headers=auth())
    assert r.status_code == 201, r.text
    view = r.json()
    sid = view["session_id"]
    assert view["state"] == "armed" and view["steps"] == [5, 6]
    assert [(t["role"], t["rank"]) for t in view["targets"]] == [("actor", 1)]
    reasons = {(i["role"], i["rank"]): i["reason"] for i in view["ignored"]}
    assert "out of range (world_size 2)" in reasons[("actor", 7)]
    assert "no live agent has role ref" in reasons[("ref", None)]
    assert httpx.get(f"{url}/api/v1/sessions/{sid}").json()["session_id"] == sid
    listed = httpx.get(f"{url}/api/v1/sessions").json()
    assert listed["count"] == 1
    r = httpx.post(f"{url}/api/v1/sessions/{sid}/cancel", headers=auth())
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    r = httpx.post(f"{url}/api/v1/sessions/{sid}/cancel", headers=auth())
    assert r.status_code == 409 and "already cancelled" in r.json()["message"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"steps": [1], "next_steps": 1}, "steps"),
        ({"next_steps": 1, "tool": "nvprof"}, "tool"),
        ({"next_steps": 1, "roles": {"actor": {"ranks": [-1]}}}, "roles.actor.ranks.0"),
        (
            {"next_steps": 1, "roles": {"actor": {"tool_config": {"torch": {"contents": ["x"]}}}}},
            "roles.actor.tool_config.torch.contents.0",
        ),
        ({"next_steps": 1, "roles": {"critic": {"unknown": True}}}, "roles.critic.unknown"),
        ({"next_steps": 1, "finish_hook_cmd": "aws s3 sync ."}, "finish_hook_cmd"),
        ({"next_steps": 1, "roles": {"reward": {}}}, "roles.reward"),  # no agent has it
    ],
)
def test_bad_requests_get_422_naming_the_field(sidecar, agents, body, field) -> None:
    url, owner = sidecar.url, sidecar.owner
    r = httpx.post(f"{url}/api/v1/sessions", json=body, headers=auth())
    assert r.status_code == 422, r.text
    err = r.json()
    assert err["error"] == "invalid_request"
    assert field in [f["field"] for f in err["fields"]], err
    assert owner.call("list_sessions") == []  # nothing half-applied


def test_malformed_json_is_a_422_on_the_body_saying_where(sidecar) -> None:
    headers = {**auth(), "Content-Type": "application/json"}
    r = httpx.post(f"{sidecar.url}/api/v1/sessions", content=b'{"steps": [1,', headers=headers)
    assert r.status_code == 422, r.text
    (err,) = r.json()["fields"]
    assert err["field"] == "body" and "at character 13" in err["message"], err


def test_malformed_json_is_422_not_500(sidecar) -> None:
    url = sidecar.url
    r = httpx.post(
        f"{url}/api/v1/sessions",
        content=b"{not json",
        headers={**auth(), "content-type": "application/json"},
    )
    assert r.status_code == 422 and r.json()["error"] == "invalid_request"


def test_conflict_names_the_holder(sidecar, agents) -> None:
    url = sidecar.url
    first = httpx.post(f"{url}/api/v1/sessions", json={"steps": [9]}, headers=auth()).json()
    r = httpx.post(f"{url}/api/v1/sessions", json={"steps": [10]}, headers=auth())
    assert r.status_code == 409
    body = r.json()
    assert body["error"] == "conflict" and first["session_id"] in body["message"]
    assert body["detail"]["holders"] == [first["session_id"]]


def test_summary_before_any_trace_is_409(sidecar, agents) -> None:
    url = sidecar.url
    sid = httpx.post(f"{url}/api/v1/sessions", json={"steps": [40]}, headers=auth()).json()[
        "session_id"
    ]
    r = httpx.get(f"{url}/api/v1/sessions/{sid}/summary")
    assert r.status_code == 409 and "no Chrome trace" in r.json()["message"]
    assert httpx.get(f"{url}/api/v1/sessions/nope/summary").status_code == 404


def test_unknown_ids_are_404(sidecar) -> None:
    url = sidecar.url
    assert httpx.get(f"{url}/api/v1/sessions/nope").status_code == 404
    r = httpx.post(f"{url}/api/v1/sessions/nope/cancel", headers=auth())
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    assert httpx.get(f"{url}/api/v1/traces/0123456789abcdef/download").status_code == 404
    bad = httpx.get(f"{url}/api/v1/traces/..%2F..%2Fetc%2Fpasswd/download")
    assert bad.status_code in (404, 422)


def test_changes_need_the_token(sidecar, agents) -> None:
    url = sidecar.url
    body = {"steps": [5]}
    r = httpx.post(f"{url}/api/v1/sessions", json=body)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(f"{url}/api/v1/sessions", json=body, headers=auth("wrong"))
    assert r.status_code == 403
    assert httpx.get(f"{url}/api/v1/sessions").status_code == 200  # reads are open


def test_traces_list_and_download(sidecar, agents) -> None:
    url = sidecar.url
    r = httpx.post(
        f"{url}/api/v1/sessions",
        json={"steps": [1], "roles": {"actor": {"all_ranks": True}}},
        headers=auth(),
    )
    sid = r.json()["session_id"]
    actor_agents = [a for a in agents if a.info.role == "actor"]
    wait_until(lambda: all(a.plan.windows for a in actor_agents), 10, what="plans")
    for a in agents:
        step(a, 1)
        step(a, 2)

    def finished() -> Any:
        v = httpx.get(f"{url}/api/v1/sessions/{sid}").json()
        return v if v["state"] == "done" else None

    wait_until(finished, 20, what="session done")
    listing = httpx.get(f"{url}/api/v1/traces", params={"session_id": sid}).json()
    assert listing["count"] == 2 and listing["bytes"] == sum(t["bytes"] for t in listing["data"])
    only_1 = httpx.get(f"{url}/api/v1/traces", params={"rank": 1}).json()
    assert [t["rank"] for t in only_1["data"]] == [1]
    summary = httpx.get(f"{url}/api/v1/sessions/{sid}/summary").json()
    assert summary["steps"] == [1] and "work" in summary["stages"]
    assert sorted(tr["rank"] for tr in summary["tracks"]) == [0, 1]
    assert {st["stage"] for st in summary["stage_times"]} >= {"work"}
    t = listing["data"][0]
    r = httpx.get(f"{url}/api/v1/traces/{t['trace_id']}/download")
    assert r.status_code == 200 and len(r.content) == t["bytes"]
    assert b'"distributedInfo"' in gzip.decompress(r.content)
    # HEAD (`curl -I`): the same headers, no bytes
    head = httpx.head(f"{url}/api/v1/traces/{t['trace_id']}/download")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == str(t["bytes"])
    assert head.headers["content-disposition"] == r.headers["content-disposition"]


def test_health_is_degraded_without_a_coordinator(make_sidecar) -> None:
    class Down:
        async def call(self, method: str, *args: Any) -> Any:
            raise CoordinatorUnavailable("the profd coordinator is not running")

    with make_sidecar(token=None, dependency_overrides={get_client: lambda: Down()}) as down:
        url = down.url
        health = httpx.get(f"{url}/healthz").json()
        assert health == {"status": "degraded", "coordinator": False, "version": health["version"]}
        r = httpx.get(f"{url}/api/v1/status")
        assert r.status_code == 503 and r.json()["error"] == "coordinator_unavailable"
