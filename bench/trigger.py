"""Trigger latency: from ``POST /api/v1/sessions`` until every target holds its plan.

16 real agents (one Ray actor process each, ``profd.attach``, a training-like loop of a step
every 50 ms) against a real coordinator and sidecar on a local Ray; the coordinator persists
to SQLite in a temporary state directory, as ``profd up`` does. Each session is posted over
HTTP; the bench polls it until every target reported its plan installed, cancels it and waits
until every agent's plan is empty again (asked of each worker: the bench measures a trigger
on idle agents, not one overlapping the previous session's teardown).

Measured per session, from the moment the POST is sent:

* **armed**: until the last target's ``armed_at`` (stamped by the agent when its poller
  installs the plan; one host, one clock). This is the plan's fan-out to every agent: no
  separate fan-out figure exists, the agents' own stamp is the moment the plan reached them.
* **post**: until the POST's reply (the coordinator admitted the session).

Four variants run in every round, their order rotating round by round: sessions with explicit
``steps`` (pure fan-out) and with ``next_steps`` (the coordinator first asks every target for
its current step), each on the normal disk and on a slow one (every commit of the
coordinator's SQLite store made ``--slow-commit-ms`` longer: the store's measurement hook,
switched between variants on the one coordinator). The store writes behind the event loop,
so the slow disk should move no figure (target: p50s within 10 %).

    python bench/trigger.py [--agents 16] [--rounds 100] [--slow-commit-ms 50] [--relay off]

The agents reach the coordinator as profd's do by default, through their node's relay
(``--relay off``: ``PROFD_RELAY=0`` in the workers, each long-polls the coordinator); the
rounds start once every agent reports that link (``link`` in RESULT).

Last line: ``RESULT agents=16 rounds=100 link=relay|direct p50_ms=... p99_ms=...
next_steps_p50_ms=... next_steps_p99_ms=... slow_disk_p50_ms=... slow_disk_next_steps_p50_ms=...
slow_disk_delta_pct=... slow_disk_next_steps_delta_pct=... post_p50_ms=...
slow_disk_post_p50_ms=... incomplete=... slow_disk_incomplete=... targets=met|missed:...
load_start=... load=...`` (targets: both normal-disk p50s ≤ 100 ms; the slow disk moves each
p50 by less than 10 %). ``incomplete`` counts sessions a target ended without arming (a
``next_steps`` window that had already begun on it when its plan arrived, under heavy load):
they are not timed.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger("bench.trigger")

#: Round targets: p50 of trigger to armed, and how far the slow disk may move it.
TARGET_P50_MS = 100.0
TARGET_SLOW_DISK_PCT = 10.0

#: The variants of a round: (request kind, slow disk).
VARIANTS = (("steps", False), ("next_steps", False), ("steps", True), ("next_steps", True))
ROLES = {"actor": {"all_ranks": True}}
BODIES = {
    "steps": {"steps": [10**9], "roles": ROLES},
    "next_steps": {"next_steps": 1, "roles": ROLES},
}


class BenchWorker:
    """One training process: its agent attached, stepping until killed."""

    def __init__(self, rank: int, world: int) -> None:
        import profd

        self.agent = profd.attach(role="actor", rank=rank, world_size=world)

    def ready(self) -> bool:
        return True

    def disarmed(self) -> bool:
        """Whether the agent's plan holds no window (runs beside :meth:`loop`)."""
        return not self.agent.plan.windows

    def loop(self, seconds: float) -> int:
        step = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            with self.agent.step(step), self.agent.stage("work"):
                time.sleep(0.05)
            step += 1
        self.agent.close(timeout=10)
        return step


def slow_disk_coordinator() -> type:
    """The coordinator with one RPC more: set the store's commit delay (the slow disk)."""
    from profd.actors.coordinator import ProfileCoordinator

    class SlowDiskCoordinator(ProfileCoordinator):
        async def set_commit_delay(self, seconds: float) -> None:
            self._store.commit_delay_s = seconds  # SqliteStore's measurement hook

        async def store_stats(self) -> dict[str, int]:
            store = self._store
            return {"commits": store.commits, "failed": store.failed_writes}

    return SlowDiskCoordinator


#: Part states after which a target never arms in its session.
TERMINAL_PARTS = {"done", "partial", "missed", "failed", "lost", "cancelled", "expired"}


@dataclass
class Samples:
    armed_ms: list[float] = field(default_factory=list)
    post_ms: list[float] = field(default_factory=list)
    #: Sessions a target ended before arming (a ``next_steps`` window already begun on it
    #: when its plan arrived): not timed, counted, and their reasons kept.
    incomplete: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def wait_disarmed(workers: list[Any], timeout_s: float = 30.0) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while not all(ray.get([w.disarmed.remote() for w in workers])):
        if time.monotonic() > deadline:
            raise RuntimeError(f"agents still hold a cancelled window after {timeout_s:.0f} s")
        time.sleep(0.01)


def one_round(api: httpx.Client, body: dict[str, Any], n: int, out: Samples) -> None:
    t0 = time.time()
    r = api.post("/api/v1/sessions", json=body)
    posted = time.time()
    r.raise_for_status()
    sid = r.json()["session_id"]
    deadline = time.monotonic() + 30
    while True:
        view = api.get(f"/api/v1/sessions/{sid}").json()
        armed = [p["armed_at"] for p in view["targets"] if p["armed_at"] is not None]
        ended = [
            p for p in view["targets"] if p["armed_at"] is None and p["state"] in TERMINAL_PARTS
        ]
        if len(armed) + len(ended) == n:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(armed)}/{n} targets armed: {view['reason']}")
        time.sleep(0.01)
    r = api.post(f"/api/v1/sessions/{sid}/cancel")
    if r.status_code != 409:  # 409: the session ended by itself (every target missed)
        r.raise_for_status()
    out.post_ms.append((posted - t0) * 1000)
    if ended:
        out.incomplete.append(f"{ended[0]['role']} rank {ended[0]['rank']}: {ended[0]['reason']}")
        log.warning("session %s: %d target(s) never armed: %s", sid, len(ended), out.incomplete[-1])
    else:
        out.armed_ms.append((max(armed) - t0) * 1000)


@dataclass(frozen=True)
class Stack:
    """What one run holds (referenced for the whole run: Ray collects unreferenced actors)."""

    coordinator: Any
    services: Any
    api: httpx.Client
    workers: list[Any]


def start(agents: int, state_dir: str, relay: bool) -> Stack:
    """The coordinator (persisting under ``state_dir``), the sidecar and ``agents`` workers
    that have all reported a step through the link asked for (``relay``, or direct)."""
    import ray

    from profd.actors import COORDINATOR_MAX_CONCURRENCY
    from profd.cli.ray_cluster import start_services
    from profd.core.constants import COORDINATOR_NAME, NAMESPACE
    from profd.core.settings import ProfdSettings, SidecarConfig

    settings = ProfdSettings(poll_timeout_s=5.0, save_root=os.path.join(state_dir, "profile"))
    coord_settings = settings.coordinator().model_copy(update={"state_dir": state_dir})
    coordinator = (
        ray.remote(slow_disk_coordinator())
        .options(
            name=COORDINATOR_NAME,
            namespace=NAMESPACE,
            num_cpus=0,
            max_concurrency=COORDINATOR_MAX_CONCURRENCY,
        )
        .remote(coord_settings.model_dump())
    )
    ray.get(coordinator.start.remote())
    token = secrets.token_urlsafe(16)
    services = start_services(coord_settings, SidecarConfig(port=0, token=token), detached=False)
    assert not services.coordinator_created, "the bench's coordinator was not the one found"
    api = httpx.Client(
        base_url=services.address["url"], timeout=60, headers={"Authorization": f"Bearer {token}"}
    )
    env = {"env_vars": {"PROFD_RELAY": "1" if relay else "0"}}
    remote = ray.remote(BenchWorker).options(  # loop + disarmed
        num_cpus=0, max_concurrency=2, runtime_env=env
    )
    workers = [remote.remote(r, agents) for r in range(agents)]
    ray.get([w.ready.remote() for w in workers])
    for w in workers:
        w.loop.remote(3600)
    link = "relay" if relay else "direct"

    def ready() -> int:
        data = api.get("/api/v1/agents").json()["data"]
        return sum(1 for a in data if a["current_step"] and a["link"] == link)

    deadline = time.monotonic() + 120
    while ready() < agents:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the agents did not all report a step via {link} within 120 s")
        time.sleep(0.2)
    return Stack(coordinator, services, api, workers)


def run_rounds(stack: Stack, rounds: int, slow_s: float) -> dict[tuple[str, bool], Samples]:
    """``rounds`` rounds of the four variants, their order rotating round by round."""
    import ray

    samples = {v: Samples() for v in VARIANTS}
    n = len(stack.workers)
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for kind, slow in order:
            ray.get(stack.coordinator.set_commit_delay.remote(slow_s if slow else 0.0))
            one_round(stack.api, BODIES[kind], n, samples[(kind, slow)])
            wait_disarmed(stack.workers)
        if (r + 1) % 10 == 0:
            log.info("round %d/%d, load average %.2f", r + 1, rounds, os.getloadavg()[0])
    ray.get(stack.coordinator.set_commit_delay.remote(0.0))
    return samples


def describe(name: str, values: list[float], agents: int) -> str:
    return (
        f"{name:>26}: p50 {statistics.median(values):6.1f} ms  p10-p90 "
        f"{percentile(values, 0.1):6.1f}-{percentile(values, 0.9):6.1f}  p99 "
        f"{percentile(values, 0.99):6.1f} ms  ({len(values)} sessions, {agents} agents)"
    )


def result_fields(samples: dict[tuple[str, bool], Samples]) -> dict[str, str]:
    def p(kind: str, slow: bool, q: float, what: str = "armed_ms") -> float:
        values = getattr(samples[(kind, slow)], what)
        return statistics.median(values) if q == 0.5 else percentile(values, q)

    def delta(kind: str) -> float:
        return (p(kind, True, 0.5) / p(kind, False, 0.5) - 1) * 100

    fields: dict[str, float | int] = {}
    for slow, prefix in ((False, ""), (True, "slow_disk_")):
        fields[f"{prefix}p50_ms"] = p("steps", slow, 0.5)
        fields[f"{prefix}p99_ms"] = p("steps", slow, 0.99)
        fields[f"{prefix}next_steps_p50_ms"] = p("next_steps", slow, 0.5)
        fields[f"{prefix}next_steps_p99_ms"] = p("next_steps", slow, 0.99)
    for slow, prefix in ((False, ""), (True, "slow_disk_")):
        fields[f"{prefix}incomplete"] = sum(len(samples[(k, slow)].incomplete) for k in BODIES)
    fields["slow_disk_delta_pct"] = delta("steps")
    fields["slow_disk_next_steps_delta_pct"] = delta("next_steps")
    for slow, prefix in ((False, ""), (True, "slow_disk_")):
        fields[f"{prefix}post_p50_ms"] = p("steps", slow, 0.5, "post_ms")
        fields[f"{prefix}next_steps_post_p50_ms"] = p("next_steps", slow, 0.5, "post_ms")
    missed = [k for k in ("p50_ms", "next_steps_p50_ms") if fields[k] > TARGET_P50_MS]
    missed += [
        k
        for k in ("slow_disk_delta_pct", "slow_disk_next_steps_delta_pct")
        if abs(fields[k]) >= TARGET_SLOW_DISK_PCT
    ]
    out = {k: f"{v:.1f}" if isinstance(v, float) else str(v) for k, v in fields.items()}
    out["targets"] = "met" if not missed else "missed:" + ",".join(missed)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--slow-commit-ms", type=float, default=50.0)
    parser.add_argument(
        "--relay", choices=("on", "off"), default="on",
        help="agents through their node's relay (profd's default) or each to the coordinator",
    )  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    load_start = os.getloadavg()[0]

    from profd.core.ray_env import init_local_ray

    init_local_ray()  # on 127.0.0.1; the loopback settings come before Ray is imported
    import ray

    with tempfile.TemporaryDirectory(prefix="profd-bench-trigger-") as state_dir:
        stack = start(args.agents, state_dir, args.relay == "on")
        slow_s = args.slow_commit_ms / 1000
        samples = run_rounds(stack, args.rounds, slow_s)
        stats = ray.get(stack.coordinator.store_stats.remote())
        for w in stack.workers:
            ray.kill(w)
        del stack
        ray.shutdown()
    for (kind, slow), s in samples.items():
        disk = f"slow disk ({args.slow_commit_ms:g} ms)" if slow else "normal disk"
        print(describe(f"{kind}, {disk}: armed", s.armed_ms, args.agents))
        print(describe(f"{kind}, {disk}: post", s.post_ms, args.agents))
        if s.incomplete:
            print(
                f"{len(s.incomplete)} {kind} session(s) with a target never armed, e.g. "
                f"{s.incomplete[0]}"
            )
    print(f"store: {stats['commits']} commits, {stats['failed']} failed")
    fields = {"agents": str(args.agents), "rounds": str(args.rounds)}
    fields["link"] = "relay" if args.relay == "on" else "direct"
    fields |= {"slow_commit_ms": f"{args.slow_commit_ms:g}", **result_fields(samples)}
    fields |= {"load_start": f"{load_start:.2f}", "load": f"{os.getloadavg()[0]:.2f}"}
    print("RESULT " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


if __name__ == "__main__":
    main()
