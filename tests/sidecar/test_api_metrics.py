"""Prometheus ``/metrics`` over real HTTP, after a real session recorded real traces."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from profd.api import create_app
from profd.api.deps import get_client
from profd.core.errors import CoordinatorUnavailable
from profd.core.settings import SidecarConfig

from helpers import AUTH, LoopClient, start_agents, wait_terminal, wait_until


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: dict, name: str, **labels: str) -> float:
    return metrics[(name, tuple(sorted(labels.items())))]


def record(url: str, owner: Any, agents: list[Any]) -> Any:
    """A session on every actor with a finish hook and uploads, run to its end."""
    body = {
        "steps": [1],
        "roles": {"actor": {"all_ranks": True}},
        "finish_hook_cmd": "true",
        "upload_uri": "memory://profd-metrics/run",
    }
    r = httpx.post(f"{url}/api/v1/sessions", json=body, headers=AUTH)
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    wait_until(lambda: all(a.plan.windows for a in agents), 10, what="plans")
    for a in agents:
        for n in (1, 2):
            with a.step(n), a.stage("work"):
                torch.ones(4) @ torch.ones(4)
    view = wait_terminal(owner, sid)
    assert view.state.value == "done", view.reason

    def finished() -> bool:
        v = owner.call("get_session", sid)
        return all(u.state == "done" for u in v.uploads) and v.hooks[0].state == "done"

    wait_until(finished, 20, what="hook and uploads")
    return view


def test_metrics_after_a_recorded_session(make_sidecar, local_coordinator) -> None:
    agents = start_agents(local_coordinator, 2, "actor")
    critic = start_agents(local_coordinator, 1, "critic")[0]
    try:
        with make_sidecar(
            allow_hook_commands=True, upload_prefixes=("memory://profd-metrics",)
        ) as srv:
            view = record(srv.url, local_coordinator, agents)
            live = httpx.post(f"{srv.url}/api/v1/sessions", json={"steps": [50]}, headers=AUTH)
            assert live.status_code == 201  # a live session: rank 0 of every role
            r = httpx.get(f"{srv.url}/metrics")
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/plain")
            m = samples(r.text)
    finally:
        for a in [*agents, critic]:
            a.close(timeout=10)
    traces = view.traces
    assert value(m, "profd_coordinator_up") == 1
    assert value(m, "profd_agents", role="actor", state="alive") == 2
    assert value(m, "profd_agents", role="critic", state="alive") == 1
    assert value(m, "profd_sessions", state="done") == 1
    assert value(m, "profd_sessions", state="armed") == 1
    assert value(m, "profd_traces_total", tool="torch") == len(traces) == 2
    assert value(m, "profd_trace_bytes_total", tool="torch") == sum(t.bytes for t in traces)
    assert value(m, "profd_export_stall_seconds_count", tool="torch") == 2
    assert value(m, "profd_export_stall_seconds_sum", tool="torch") > 0
    assert value(m, "profd_export_stall_seconds_max", tool="torch") > 0
    assert value(m, "profd_finish_hooks", state="done") == 1
    assert value(m, "profd_uploads", state="done") == 2
    events = value(m, "profd_coordinator_events_total")
    assert events > 0 and value(m, "profd_coordinator_reports_total") > 0
    assert value(m, "profd_coordinator_rejected_events_total") == 0  # every event applied
    uptime = value(m, "profd_coordinator_uptime_seconds")
    assert value(m, "profd_coordinator_event_rate") == pytest.approx(events / uptime, rel=0.5)


def test_metrics_without_a_coordinator_say_so(make_sidecar) -> None:
    class Down:
        async def call(self, method: str, *args: Any) -> Any:
            raise CoordinatorUnavailable("the profd coordinator is not running")

    with make_sidecar(token=None, dependency_overrides={get_client: lambda: Down()}) as srv:
        r = httpx.get(f"{srv.url}/metrics")
    assert r.status_code == 200
    m = samples(r.text)
    assert value(m, "profd_coordinator_up") == 0
    assert not any(name.startswith("profd_agents") for name, _ in m)


def test_each_app_has_its_own_registry(local_coordinator) -> None:
    a = create_app(SidecarConfig(), client=LoopClient(local_coordinator))
    b = create_app(SidecarConfig(), client=LoopClient(local_coordinator))
    assert a.state.metrics[0] is not b.state.metrics[0]
    assert not any(n.startswith("profd_") for n in REGISTRY._names_to_collectors)


def test_a_snapshot_shared_by_requests_is_rendered_once(
    make_sidecar, local_coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests that share one coordinator snapshot (``SharedReads``) share its text; a new
    snapshot, after a change, is rendered again."""
    from profd.api import metrics as metrics_mod

    renders: list[int] = []
    real = metrics_mod.generate_latest

    def counted(registry: Any) -> bytes:
        renders.append(1)
        return real(registry)

    monkeypatch.setattr(metrics_mod, "generate_latest", counted)
    agents = start_agents(local_coordinator, 1, "actor")
    try:
        with make_sidecar(read_cache_s=5.0) as srv:
            a, b = (httpx.get(f"{srv.url}/metrics") for _ in range(2))
            assert a.status_code == b.status_code == 200 and a.text == b.text
            assert len(renders) == 1
            live = httpx.post(f"{srv.url}/api/v1/sessions", json={"steps": [50]}, headers=AUTH)
            assert live.status_code == 201
            c = httpx.get(f"{srv.url}/metrics")
            assert len(renders) == 2
            sessions = {k: v for k, v in samples(c.text).items() if k[0] == "profd_sessions"}
            assert sum(sessions.values()) == 1  # the new snapshot, with the new session
    finally:
        for agent in agents:
            agent.close()
