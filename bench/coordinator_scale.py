"""The real coordinator against 10,000 simulated agents hosted in a few processes.

Each host (a Ray actor) runs thousands of agents that speak the agents' real protocol to the
real coordinator actor — ``register`` each, one shared long-poll per host (``poll_many``, as
:mod:`profd.agent.multiplex` does for the agents of one process), ``report`` batches — and
measures:

* registration of all agents;
* plan fan-out: from ``create_session`` (every agent targeted) until every agent's own
  long-poll has returned its plan;
* event throughput: events per second the coordinator accepts through ``report`` — real
  events of the live 10,000-target session, each applied to its part, the session advanced
  and the changed part persisted to SQLite (the state directory ``profd up`` uses);
* memory: the coordinator's resident memory per additional agent once its RPC buffers have
  grown to their working size (half the agents registered first), with every agent
  registered and long-polling; the growth from an empty coordinator is printed too.

    python bench/coordinator_scale.py [--agents 10000] [--hosts 4]

Last line: ``RESULT agents=10000 fanout_ms=... events_per_s=... bytes_per_agent=...``
(targets: fan-out ≤ 1 s, ≥ 20,000 events/s, ≤ 2 KB per agent).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from typing import Any


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class AgentHost:
    """Many simulated agents in one process, each with its own long-poll."""

    def __init__(self, coordinator: Any, offset: int, count: int, world: int) -> None:
        from profd.core.protocol import AgentInfo
        from profd.core.request import ToolKind

        caps = {t.value: None for t in ToolKind}
        self.coord = coordinator
        self.infos = [
            AgentInfo(f"sim-{i}", "sim", i, world, {}, "host", os.getpid(), capabilities=caps)
            for i in range(offset, offset + count)
        ]
        self.versions = {info.agent_id: 0 for info in self.infos}
        self.received: dict[str, float] = {}
        self.tasks: list[asyncio.Task] = []

    async def register_all(self, part: int = 0, parts: int = 1) -> float:
        """Register this host's agents (the ``part``-th of ``parts`` slices)."""
        t0 = time.perf_counter()
        size = len(self.infos) // parts
        mine = self.infos[part * size : (part + 1) * size if part < parts - 1 else None]
        for i in range(0, len(mine), 50):
            chunk = mine[i : i + 50]
            regs = await asyncio.gather(*[self.coord.register.remote(a, 0) for a in chunk])
            for a, reg in zip(chunk, regs, strict=True):
                self.versions[a.agent_id] = reg.plan.version
        return time.perf_counter() - t0

    async def _poll_all(self) -> None:
        steps = {a.agent_id: 0 for a in self.infos}
        while True:
            replies = await self.coord.poll_many.remote(dict(self.versions), steps, 60.0)
            now = time.time()
            for agent_id, reply in replies.items():
                if reply.plan is not None:
                    self.versions[agent_id] = reply.plan.version
                    if reply.plan.windows:
                        self.received.setdefault(agent_id, now)

    async def start_polling(self) -> int:
        self.tasks = [asyncio.get_running_loop().create_task(self._poll_all())]
        await asyncio.sleep(0)
        return len(self.infos)

    async def received_count(self) -> tuple[int, float]:
        return len(self.received), max(self.received.values(), default=0.0)

    async def send_events(self, session_id: str, batches: int, size: int) -> tuple[int, float]:
        """Real events of the live session, each batch from another agent: every report
        updates that agent's part, advances the session and persists it (SQLite)."""
        from profd.core.protocol import AgentEvent, EventKind, PhaseDone
        from profd.core.states import ControllerPhase

        phases = list(ControllerPhase)

        def batch(k: int) -> list[AgentEvent]:
            return [
                AgentEvent(
                    EventKind.PHASE, session_id, k, payload=PhaseDone(k, phases[i % len(phases)])
                )
                for i in range(size)
            ]

        t0 = time.perf_counter()
        for i in range(0, batches, 8):
            n = min(8, batches - i)
            agents = [self.infos[(i + j) % len(self.infos)].agent_id for j in range(n)]
            await asyncio.gather(*[self.coord.report.remote(a, batch(i)) for a in agents])
        return batches * size, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--event-batches", type=int, default=500, help="per host")
    # An agent sends what piled up since its last report: one step of a busy discrete
    # window is tens of events; at 10 per report the Ray round trip bounds the rate.
    parser.add_argument("--batch-size", type=int, default=100)
    args = parser.parse_args()

    from profd.core.ray_env import init_local_ray

    init_local_ray()  # on 127.0.0.1; the loopback settings come before Ray is imported
    import ray

    from profd.actors import get_or_create_coordinator
    from profd.core.settings import ProfdSettings

    state_dir = tempfile.mkdtemp(prefix="profd-bench-state-")  # persisted, as `profd up` does
    settings = ProfdSettings(poll_timeout_s=60.0, heartbeat_timeout_s=600.0).coordinator()
    coord, _ = get_or_create_coordinator(
        settings.model_copy(update={"state_dir": state_dir}), detached=False
    )
    pid = ray.get(coord.pid.remote())
    per_host = args.agents // args.hosts
    host_cls = ray.remote(AgentHost).options(num_cpus=0, max_concurrency=100_000)
    hosts = [host_cls.remote(coord, h * per_host, per_host, args.agents) for h in range(args.hosts)]
    time.sleep(1.0)
    base = rss_bytes(pid)

    # Half the agents first: Ray's RPC buffers reach their working size; the second half
    # shows what one more agent costs the coordinator (its state, not buffer growth).
    t0 = time.perf_counter()
    ray.get([h.register_all.remote(0, 2) for h in hosts])
    time.sleep(1.0)
    half = rss_bytes(pid)
    ray.get([h.register_all.remote(1, 2) for h in hosts])
    register_s = time.perf_counter() - t0
    time.sleep(1.0)
    marginal = (rss_bytes(pid) - half) / (args.agents - args.agents // 2)
    ray.get([h.start_polling.remote() for h in hosts])
    time.sleep(3.0)  # every agent parked in its long-poll
    per_agent = (rss_bytes(pid) - base) / args.agents

    t_create = time.time()
    view = ray.get(
        coord.create_session.remote({"steps": [10**9], "roles": {"sim": {"all_ranks": True}}})
    )
    deadline = time.monotonic() + 120
    while True:
        counts = ray.get([h.received_count.remote() for h in hosts])
        if sum(c for c, _ in counts) >= args.agents or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    fanout_ms = (max(t for _, t in counts) - t_create) * 1000
    got = sum(c for c, _ in counts)

    sid = view.session_id
    sent = ray.get([h.send_events.remote(sid, args.event_batches, args.batch_size) for h in hosts])
    status = ray.get(coord.status.remote())
    total = sum(n for n, _ in sent)
    events_per_s = total / max(s for _, s in sent)

    print(f"agents: {args.agents} in {args.hosts} host processes; {len(view.targets)} targeted")
    print(f"registration      : {register_s:7.2f} s")
    print(f"plan fan-out      : {fanout_ms:7.0f} ms  ({got}/{args.agents} agents; target <= 1000)")
    print(f"events            : {events_per_s:9.0f} /s  ({total} events; target >= 20000)")
    print(
        f"coordinator memory: {marginal:7.0f} B per additional agent (RSS; target <= 2048); "
        f"{per_agent:.0f} B per agent counting the RPC buffers' growth from empty"
    )
    print(f"state writes failed: {status.state_write_failures} (SQLite in {state_dir})")
    ray.shutdown()
    shutil.rmtree(state_dir, ignore_errors=True)
    print(
        f"RESULT agents={args.agents} fanout_ms={fanout_ms:.0f} events_per_s={events_per_s:.0f} "
        f"bytes_per_agent={marginal:.0f}"
    )


if __name__ == "__main__":
    main()
