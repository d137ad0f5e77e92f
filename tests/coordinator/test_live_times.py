"""Live step and stage times: real agents mark real steps and stages against an in-process
coordinator, and a real sidecar shows them in ``GET /api/v1/agents`` and ``/metrics``."""

from __future__ import annotations

import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from helpers import start_agents, wait_until

SLEEP_S = 0.02  # rank 1's "load" stage, and the stage-only worker's "generate"
STEPS = 3


def agents_by_key(url: str) -> dict[tuple[str, int], dict[str, Any]]:
    data = httpx.get(f"{url}/api/v1/agents").json()["data"]
    return {(a["role"], a["rank"]): a for a in data}


def metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(metrics: dict, name: str, **labels: str) -> float | None:
    return metrics.get((name, tuple(sorted(labels.items()))))


def run_loops(actors: list[Any], worker: Any) -> None:
    """SPMD actors mark steps with two stages; the worker of a single-controller job marks
    one stage per step and no step (its step is its driver's)."""
    for step in range(STEPS):
        for rank, a in enumerate(actors):
            with a.step(step):
                with a.stage("load"):
                    time.sleep(SLEEP_S if rank == 1 else 0)
                with a.stage("compute"):
                    sum(range(100))
        with worker.stage("generate"):
            time.sleep(SLEEP_S)


def all_arrived(url: str) -> dict[tuple[str, int], dict[str, Any]] | None:
    agents = agents_by_key(url)
    counts = [(agents[("actor", r)].get("step_time") or {}).get("count") for r in (0, 1)] + [
        (agents[("worker", 0)]["stage_times"].get("generate") or {}).get("count")
    ]
    return agents if counts == [STEPS, STEPS, STEPS] else None


def check_agents(agents: dict[tuple[str, int], dict[str, Any]]) -> None:
    fast, slow, worker = agents[("actor", 0)], agents[("actor", 1)], agents[("worker", 0)]
    assert slow["median_step_s"] >= SLEEP_S and slow["last_step_s"] >= SLEEP_S
    assert slow["stage_times"]["load"]["median_s"] >= SLEEP_S
    assert fast["stage_times"]["load"]["median_s"] < SLEEP_S <= slow["median_step_s"]
    for a in (fast, slow, worker):  # every duration timed from its own mark's start
        for t in [a["step_time"] or {"recent_s": []}, *a["stage_times"].values()]:
            assert all(0 <= v < 1.0 for v in t["recent_s"]), a
    for a in (fast, slow):
        step = a["step_time"]
        assert step["samples"] == STEPS and step["lost"] == 0 and a["current_step"] == STEPS - 1
        assert len(step["recent_s"]) == STEPS and step["last_s"] == step["recent_s"][-1]
        assert sorted(a["stage_times"]) == ["compute", "load"]
        # a step holds its stages
        in_stages = sum(a["stage_times"][k]["last_s"] for k in ("compute", "load"))
        assert a["last_step_s"] >= in_stages
    assert worker["last_step_s"] is None and worker["step_time"] is None
    assert list(worker["stage_times"]) == ["generate"]
    assert worker["stage_times"]["generate"]["median_s"] >= SLEEP_S


def check_metrics(url: str) -> None:
    m = metric_samples(url)
    assert sample(m, "profd_step_seconds", role="actor", rank="1", quantile="0.5") >= SLEEP_S
    assert sample(m, "profd_step_seconds_count", role="actor", rank="1") == STEPS
    assert sample(m, "profd_step_seconds_sum", role="actor", rank="1") >= STEPS * SLEEP_S
    assert sample(m, "profd_step_seconds_last", role="actor", rank="0") < SLEEP_S
    load = {"role": "actor", "stage": "load"}
    assert sample(m, "profd_stage_seconds", rank="1", quantile="0.5", **load) >= SLEEP_S
    assert sample(m, "profd_stage_seconds", rank="0", quantile="0.5", **load) < SLEEP_S
    assert sample(m, "profd_stage_seconds_count", rank="0", **load) == STEPS
    gen = {"role": "worker", "rank": "0", "stage": "generate"}
    assert sample(m, "profd_stage_seconds_last", **gen) >= SLEEP_S
    assert sample(m, "profd_step_seconds_count", role="worker", rank="0") is None


def test_step_and_stage_times_reach_the_agents_route_and_metrics(
    local_coordinator, make_sidecar
) -> None:
    actors = start_agents(local_coordinator, 2, "actor")
    worker = start_agents(local_coordinator, 1, "worker")[0]
    try:
        with make_sidecar() as srv:
            run_loops(actors, worker)
            agents = wait_until(lambda: all_arrived(srv.url), 10, what="step and stage times")
            check_agents(agents)
            check_metrics(srv.url)

            actors[0].close(timeout=5)  # a closed agent's times go, everywhere

            def gone() -> bool:
                a = agents_by_key(srv.url)[("actor", 0)]
                return a["state"] == "closed" and a["step_time"] is None

            wait_until(gone, 10, what="closed agent's times dropped")
            m = metric_samples(srv.url)
            assert sample(m, "profd_step_seconds_count", role="actor", rank="0") is None
            assert sample(m, "profd_step_seconds_count", role="actor", rank="1") == STEPS
    finally:
        for a in [*actors, worker]:
            a.close(timeout=5)
