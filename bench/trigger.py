"""Trigger latency: from ``POST /api/v1/sessions`` until every target holds its plan.

16 real agents (one Ray actor each) run a training-like loop (a step every 50 ms) against a
real coordinator and sidecar on a local Ray. Each round posts a session over HTTP and waits
until every target reported the plan installed (the ``armed_at`` time each agent stamps when
its poller installs the plan), then cancels it. Reported separately: sessions with explicit
``steps`` (pure fan-out) and ``next_steps`` (which first asks every target for its current
step).

    python bench/trigger.py [--agents 16] [--rounds 30]

Last line: ``RESULT agents=16 p50_ms=... p99_ms=...`` (explicit steps; target p50 ≤ 100 ms).
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import time
from typing import Any

import httpx


class BenchWorker:
    def __init__(self, rank: int, world: int) -> None:
        import profd

        self.agent = profd.attach(role="actor", rank=rank, world_size=world)
        self.stop = False

    def ready(self) -> bool:
        return True

    def loop(self, seconds: float) -> int:
        step = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            with self.agent.step(step), self.agent.stage("work"):
                time.sleep(0.05)
            step += 1
        self.agent.close(timeout=10)
        return step


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def one_round(api: httpx.Client, body: dict[str, Any], n: int) -> float:
    t0 = time.time()
    r = api.post("/api/v1/sessions", json=body)
    r.raise_for_status()
    sid = r.json()["session_id"]
    deadline = time.monotonic() + 30
    while True:
        view = api.get(f"/api/v1/sessions/{sid}").json()
        armed = [p["armed_at"] for p in view["targets"] if p["armed_at"] is not None]
        if len(armed) == n:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(armed)}/{n} targets armed: {view['reason']}")
        time.sleep(0.01)
    api.post(f"/api/v1/sessions/{sid}/cancel").raise_for_status()
    return (max(armed) - t0) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()

    from profd.core.ray_env import init_local_ray

    init_local_ray()  # on 127.0.0.1; the loopback settings come before Ray is imported
    import ray

    from profd.cli.ray_cluster import start_services
    from profd.core.settings import ProfdSettings, SidecarConfig

    token = secrets.token_urlsafe(16)
    services = start_services(
        ProfdSettings(poll_timeout_s=5.0).coordinator().model_copy(update={"state_dir": None}),
        SidecarConfig(port=0, token=token),
        detached=False,
    )
    api = httpx.Client(
        base_url=services.address["url"], timeout=60, headers={"Authorization": f"Bearer {token}"}
    )
    remote = ray.remote(BenchWorker).options(num_cpus=0)
    workers = [remote.remote(r, args.agents) for r in range(args.agents)]
    ray.get([w.ready.remote() for w in workers])
    runs = [w.loop.remote(3600) for w in workers]
    while sum(1 for a in api.get("/api/v1/agents").json()["data"] if a["current_step"]) < len(
        workers
    ):
        time.sleep(0.2)
    roles = {"actor": {"all_ranks": True}}
    explicit, aligned = [], []
    for _ in range(args.rounds):
        explicit.append(one_round(api, {"steps": [10**9], "roles": roles}, args.agents))
        aligned.append(one_round(api, {"next_steps": 1, "roles": roles}, args.agents))
    for w in workers:
        ray.kill(w)
    del runs, services
    ray.shutdown()
    for name, vals in (("explicit steps", explicit), ("next_steps", aligned)):
        print(
            f"{name:>15}: p50 {statistics.median(vals):6.1f} ms  p99 {percentile(vals, 0.99):6.1f}"
            f" ms  (POST until all {args.agents} agents hold the plan, {len(vals)} rounds)"
        )
    print(
        f"RESULT agents={args.agents} p50_ms={statistics.median(explicit):.1f} "
        f"p99_ms={percentile(explicit, 0.99):.1f}"
    )


if __name__ == "__main__":
    main()
