"""The fleet bench's phases (``coordinator_scale.py``): registration and memory, fan-out,
events; each returns what it measured, printed and judged by the bench."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from _fleet import Fleet, PySpy, _wait, rss_bytes
from _fleet_hosts import FIRST_STEP, ROLE, WINDOW_STEPS


@dataclass
class Memory:
    """Registration, idle polling and memory with every agent polling."""

    register_s: float
    idle_pct: dict[str, float]
    base: int  # coordinator RSS before any agent, at half the nodes, with all
    half: int
    full: int
    base_rh: int  # the relay hosts' RSS, summed, at the same moments
    half_rh: int
    full_rh: int
    half_sim: int  # simulated agents polling at the half reading
    parked_min: int

    def per_agent(self, agents: int) -> float:
        return (self.full - self.base) / agents

    def marginal(self, sim: int) -> float:
        return (self.full - self.half) / (sim - self.half_sim)


def register_and_weigh(
    f: Fleet, args: argparse.Namespace, relay_pids: list[int], base: tuple[int, int]
) -> Memory:
    """Half the nodes, then the rest (the growth between them is what one more agent
    costs); then memory read with every agent polling. ``base``: the coordinator's and the
    relay hosts' RSS before any agent came. Raises ``Failed``."""
    import ray

    def parked() -> int:
        return sum(s["parked"] for s in ray.get([h.stats.remote() for h in f.relay_hosts]))

    t0 = time.perf_counter()
    ray.get([h.start_agents.remote(0, 2) for h in f.agent_hosts])
    register_s = time.perf_counter() - t0
    time.sleep(args.settle_s)
    half, half_rh = rss_bytes(f.cpid), sum(rss_bytes(p) for p in f.rh_pids)
    half_sim = sum(len(nodes[0::2]) for nodes in f.ah_nodes) * f.per_node
    t1 = time.perf_counter()
    ray.get([h.start_agents.remote(1, 2) for h in f.agent_hosts])
    register_s += time.perf_counter() - t1
    registered = ray.get(f.coord.status.remote()).agents
    if registered != args.agents:
        raise Failed(f"{registered}/{args.agents} agents registered")
    idle0 = f.cpu(relay_pids)
    t_idle = time.perf_counter()
    time.sleep(args.settle_s)
    idle1 = f.cpu(relay_pids)
    idle_s = time.perf_counter() - t_idle
    # Parked polls come and go (each relay releases its agents every poll period, so they
    # poll again with fresh steps): read the memory 5 times, keep the highest.
    want = 0.9 * f.sim
    if f.relay_hosts and not _wait(
        "90 % of the agents parked at their relay", lambda: parked() >= want, 60
    ):
        raise Failed("the agents' polls did not park at their relays")
    full = full_rh = 0
    parked_min = f.sim
    for _ in range(5):
        full = max(full, rss_bytes(f.cpid))
        full_rh = max(full_rh, sum(rss_bytes(p) for p in f.rh_pids))
        if f.relay_hosts:
            parked_min = min(parked_min, parked())
        time.sleep(1.0)
    idle = {k: (idle1[k] - idle0[k]) / idle_s * 100 for k in idle0}
    return Memory(
        register_s, idle, base[0], half, full, base[1], half_rh, full_rh, half_sim, parked_min
    )


@dataclass
class Fanout:
    """Every agent targeted by one ``create_session``, until the last one has its plan."""

    view: Any
    create_ms: float
    fanout_ms: float
    relay_fanout_ms: float | None
    got: int
    cpu: tuple[dict[str, float], dict[str, float]]
    links: dict[str, int]
    unknown: int
    poll_errors: int


def fan_out(f: Fleet, args: argparse.Namespace, relay_pids: list[int]) -> Fanout:
    import ray

    coord = f.coord
    steps = [FIRST_STEP + i for i in range(WINDOW_STEPS)]
    request = {"steps": steps, "roles": {ROLE: {"all_ranks": True}}}
    spy = PySpy(args.py_spy, "fanout", {"coordinator": f.cpid, "relay_host": f.rh_pids[:1]})
    cpu0 = f.cpu(relay_pids)
    t_create = time.time()
    view = ray.get(coord.create_session.remote(request))
    create_ms = (time.time() - t_create) * 1000
    deadline = time.monotonic() + args.fanout_timeout_s
    while True:
        counts = ray.get([h.received_times.remote() for h in f.agent_hosts])
        armed = sum(ray.get([r.armed.remote() for r in f.real]))
        got = sum(c[0] for c in counts) + armed
        if got >= args.agents or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    cpu1 = f.cpu(relay_pids)
    spy.stop()
    real_ids = {a for r in f.real for a in ray.get(r.ids.remote())}

    def real_armed_at() -> list[float]:
        parts = ray.get(coord.get_session.remote(view.session_id)).targets
        return [p.armed_at for p in parts if p.agent_id in real_ids and p.armed_at]

    # the real agents' own stamp, sent back as their `armed` event (through their relay)
    if got >= args.agents:
        _wait("the real agents' armed events", lambda: len(real_armed_at()) == len(real_ids), 30)
    links: dict[str, int] = {}
    for a in ray.get(coord.list_agents.remote()):
        if a.agent_id in real_ids:
            key = a.link.value if a.link is not None else "none"
            links[key] = links.get(key, 0) + 1
    fanout_ms = (max([c[1] for c in counts] + real_armed_at()) - t_create) * 1000
    relay_fanout_ms = None
    if f.relay_hosts and got >= args.agents:
        d = ray.get([h.delivered_times.remote() for h in f.relay_hosts])
        relay_fanout_ms = (max(t for _, t in d) - t_create) * 1000
    unknown = sum(c[2] for c in counts)
    poll_errors = sum(c[3] for c in counts)
    return Fanout(
        view, create_ms, fanout_ms, relay_fanout_ms, got, (cpu0, cpu1), links, unknown, poll_errors
    )


@dataclass
class Events:
    """Every simulated agent's window: 10 events in one report, all at once."""

    total: int
    seconds: float
    not_known: int
    retries: int
    copies: int
    states: dict[str, int]
    traces: int
    cpu: tuple[dict[str, float], dict[str, float]]
    relay_stats: list[dict[str, int]]
    state_write_failures: int

    @property
    def per_s(self) -> float:
        return self.total / self.seconds


def send_events(f: Fleet, args: argparse.Namespace, relay_pids: list[int], view: Any) -> Events:
    import ray

    coord = f.coord
    ray.get([h.prepare_window.remote(view.session_id, view.save_dir) for h in f.agent_hosts])
    spy = PySpy(args.py_spy, "events", {"coordinator": f.cpid, "relay_host": f.rh_pids[:1]})
    cpu2 = f.cpu(relay_pids)
    t_ev = time.perf_counter()
    sent = ray.get([h.send_window.remote() for h in f.agent_hosts])
    ev_s = time.perf_counter() - t_ev
    spy.stop()
    cpu3 = f.cpu(relay_pids)
    final = ray.get(coord.get_session.remote(view.session_id))
    states: dict[str, int] = {}
    for p in final.targets:
        states[p.state.value] = states.get(p.state.value, 0) + 1
    return Events(
        total=sum(n for n, _, _ in sent),
        seconds=ev_s,
        not_known=sum(u for _, u, _ in sent),
        retries=sum(r for _, _, r in sent),
        copies=int(ray.get(coord.metrics.remote()).get("duplicate_events_total", 0)),
        states=states,
        traces=len(final.traces),
        cpu=(cpu2, cpu3),
        relay_stats=ray.get([h.stats.remote() for h in f.relay_hosts]),
        state_write_failures=ray.get(coord.status.remote()).state_write_failures,
    )


class Failed(Exception):
    """The run cannot give a figure (said on stderr; no RESULT)."""
