"""The real coordinator against a fleet laid out as fleets run: nodes x processes, one agent each.

``--agents`` agents (default 10,000) on ``--nodes`` simulated nodes (default 1,250: 8 processes
a node). Every agent holds its **own** long-poll, as one agent per GPU process does; the
coordinator is the real actor, persisting to SQLite in a temporary state directory as
``profd up`` does. Its poll period is 30 s (``--poll-timeout-s``; what
``PROFD_POLL_TIMEOUT_S=30`` sets; heartbeat 120 s): at profd's default of 5 s each relay
releases its agents every 5 s to poll again with fresh steps, and 10,000 agents doing that
here, each through a real Ray call, is 2,000 calls a second on this machine's 2 cores (on a
fleet they are spread over the nodes).

How the fleet is hosted on one machine (``--mode relay``, the default), and which hops are
real Ray RPCs:

* **Relays.** Each simulated node has a real :class:`profd.actors.relay.NodeRelay` (the
  relay's own code) with its own :class:`~profd.actors.relay.RayCoordinatorCaller`. They are
  hosted ``--relay-hosts`` (4) to a process here: each relay-host actor holds a quarter of the
  nodes' relays and hands each call it gets (``register`` / ``poll`` / ``report``, keyed by
  node) to that node's relay. relay -> coordinator is a real Ray call: ``relay_sync`` (its
  agents' versions and steps, the host's handle and the node), ``report_many`` batches,
  ``register``; the coordinator -> relay push is a real Ray call to the relay host, keyed by
  node (``--delivery push``, the default, as profd's relay actors do; ``--delivery poll``:
  one ``poll_many`` parked at the coordinator per node instead).
* **Simulated agents.** Hosted ``--agent-hosts`` (4) to a process: each agent-host actor runs
  one asyncio task per agent, which registers and then long-polls, each poll a **real Ray
  actor call of its own** to its node's relay host (every agent's poll in flight at once); it
  reports its events the same way. They make the calls a real agent's channel makes
  (``register``, ``poll`` with its plan version and step, ``report``) but are not
  :class:`~profd.agent.channel.Channel` threads (10,000 threads do not fit on 2 cores).
* **Real agents.** The first ``--real-agents`` (16: two nodes of 8) run the real agent code
  path: :class:`~profd.agent.agent.ProfilerAgent` with its :class:`~profd.agent.channel.Channel`
  (poller and reporter threads, live step times), linked by
  :class:`~profd.agent.relay_link.NodeLinkFinder` -> :class:`~profd.agent.relay_link.RelayLink`,
  stepping every 0.2 s; a node's 8 agents share one process. Their relays are standalone relay
  actors as profd starts them: the first node's by ``profd.actors.get_or_create_relay`` for
  this Ray node (the finder's own default), the second the same actor under a simulated node
  id (without node affinity).

``--agent-hop local`` hosts each relay host's simulated agents in that process instead: their
``register`` / ``poll`` / ``report`` await their node's relay directly (not an RPC), so the
figures are the coordinator's and the relays' without 10,000 agent-to-relay Ray calls
competing for the same 2 cores (on a fleet that hop runs on each node, in parallel).

``--mode direct`` has no relays: each simulated agent's own long-poll is a Ray call straight to
the coordinator's ``poll`` (``register`` and ``report`` too); the real agents use
:func:`~profd.agent.channel.find_ray_link`.

Measured:

* **registration** of every agent (through its relay);
* **memory** with every agent registered and long-polling (each relay's shared poll parked at
  the coordinator, every agent's own poll parked at its relay), read after ``--settle-s`` of
  polling, past a poll period, so the relays' first shared polls have ended (the highest of 5
  readings a second apart, at least 90 % of the polls parked at their relay): the coordinator's
  RSS growth over its RSS before any agent came, per agent (``bytes_per_agent``, target
  <= 2 KB); its growth from half the nodes polling to all of them, per added agent
  (``marginal_bytes_per_agent``); the relay hosts' growth per agent, apart
  (``relay_host_bytes_per_agent``: on a fleet, each node's relay holds 8 of them);
* **plan fan-out**: from ``create_session`` (every agent targeted) until the last agent's own
  poll returned its plan (``fanout_ms``, target <= 1 s): a simulated agent's receipt stamped in
  its host, a real agent's ``armed_at`` (stamped by its poller as it installs the plan; one
  host, one clock). ``relay_fanout_ms``: until the last relay answered its agent's poll with the
  plan. The run fails (exit 1, no RESULT) when any agent did not get its plan;
* **events**: every simulated agent sends one report of the 10 events a real window sends, to
  its relay: ``armed``, ``recording``, 5 x ``trace`` (a ``TraceWritten`` record of a file in
  the session directory: indexed, persisted), ``missed`` (``StepsMissed``), ``collecting``,
  ``part_done`` (``PartDone``); all at once, as a fleet's windows end together.
  ``events_per_s``: those events over the time until every report was acknowledged (a relay
  answers once the coordinator took its batch; target >= 20,000/s). A report that fails (a
  relay's ``report_many`` timing out) is sent again after the channel's back-off, and counted
  (``report_retries``); its events are numbered as a channel numbers them, so the coordinator
  drops a copy whose first arrived late (``duplicates_dropped``). Every part must have ended
  (``partial``: 5 steps recorded, one missed) and every trace be indexed, else the run fails.

CPU seconds each kind of process spent during fan-out and events, and its share of a core
while every agent polls, are printed (the machine is shared: the load average is in RESULT).

``coordinator_fanout_cpu_s``: the coordinator's CPU seconds during fan-out (on a fleet the
relays' and agents' share runs on their own nodes; the coordinator's is one event loop's).
With ``--relay-forward-min`` relays or more to push to (profd's default, 64), the coordinator
pushes to one relay of each group of about sqrt(n), which pushes to the others
(:mod:`profd.actors.relay_forward`); here those relays are hosted several to a process, so
their forwarding shares the same 2 cores.

``--py-spy DIR`` records the coordinator and one relay host with py-spy during fan-out and
events (collapsed stacks in ``DIR``): where each phase's CPU went.

    python bench/coordinator_scale.py [--agents 10000] [--nodes 1250] [--mode relay|direct]

Last line: ``RESULT agents=10000 nodes=1250 mode=relay agent_hop=socket delivery=push
relay_forward_min=64 relay_hosts=4 agent_hosts=4 gc_young=0 fanout_ms=...
relay_fanout_ms=... coordinator_fanout_cpu_s=...
events_per_s=... bytes_per_agent=... marginal_bytes_per_agent=...
relay_host_bytes_per_agent=... plans_delivered=10000 real_agents=16 register_s=...
create_ms=... report_retries=... duplicates_dropped=... targets=met|missed:<which>
load_start=... load=...``
(1-minute load averages).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from _fleet import Fleet, rss_bytes
from _fleet_hosts import EVENTS_PER_REPORT, WINDOW_STEPS
from _fleet_phases import Events, Failed, Fanout, Memory, fan_out, register_and_weigh, send_events

TARGET_FANOUT_MS = 1000.0
TARGET_EVENTS_PER_S = 20_000.0
TARGET_BYTES_PER_AGENT = 2048.0


def _cpu_line(before: dict[str, float], after: dict[str, float]) -> str:
    return ", ".join(f"{k} {after[k] - before[k]:.1f}" for k in before)


def run(args: argparse.Namespace, load_start: float) -> int:
    f = Fleet(args)
    try:
        return measure(f, args, load_start)
    finally:
        f.close()


def measure(f: Fleet, args: argparse.Namespace, load_start: float) -> int:
    time.sleep(2.0)
    base = (rss_bytes(f.cpid), sum(rss_bytes(p) for p in f.rh_pids))
    if not f.start_real():
        return 1
    relay_pids = f.relay_pids() if args.mode == "relay" else []
    try:
        mem = register_and_weigh(f, args, relay_pids, base)
    except Failed as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    fan = fan_out(f, args, relay_pids)
    view = fan.view
    print(
        f"agents: {args.agents} on {args.nodes} nodes x {f.per_node} ({args.mode}); "
        f"{args.real_agents} real agents on {f.real_nodes} nodes (links {fan.links}); "
        f"{len(view.targets)} targeted; load at start {load_start:.2f}"
    )
    if fan.got < args.agents or len(view.targets) < args.agents:
        print(
            f"FAILED: {fan.got}/{args.agents} agents got their plan within "
            f"{args.fanout_timeout_s:.0f} s ({len(view.targets)} targeted; {fan.unknown} polls "
            f"unknown, {fan.poll_errors} failed)",
            file=sys.stderr,
        )
        return 1
    print_memory_and_fanout(f, mem, fan)
    ev = send_events(f, args, relay_pids, view)
    print_events(f, args, ev, fan)
    if (
        ev.states.get("partial", 0) != f.sim
        or ev.traces != f.sim * (WINDOW_STEPS - 1)
        or ev.not_known
    ):
        print("FAILED: not every window's events were applied", file=sys.stderr)
        return 1
    print(result_line(f, args, mem, fan, ev, load_start))
    return 0


def print_memory_and_fanout(f: Fleet, mem: Memory, fan: Fanout) -> None:
    print(f"registration       : {mem.register_s:7.2f} s")
    print(
        f"plan fan-out       : {fan.fanout_ms:7.0f} ms  (every agent's own poll; target <= 1000; "
        f"create_session answered in {fan.create_ms:.0f} ms)"
    )
    if fan.relay_fanout_ms is not None:
        print(
            f"  relays answered  : {fan.relay_fanout_ms:7.0f} ms  (the last agent's poll at its "
            "relay)"
        )
    print(f"  CPU s            : {_cpu_line(*fan.cpu)}")
    print(f"idle polling, CPU %: {', '.join(f'{k} {v:.0f}' for k, v in mem.idle_pct.items())}")
    print(
        f"coordinator memory : {mem.per_agent(f.args.agents):7.0f} B per agent, every agent "
        f"polling (RSS {mem.base / 2**20:.0f} -> {mem.half / 2**20:.0f} -> "
        f"{mem.full / 2**20:.0f} MiB; target <= 2048); {mem.marginal(f.sim):.0f} B per agent "
        "added from half the nodes polling"
    )
    if f.rh_pids:
        print(
            f"relay host memory  : {(mem.full_rh - mem.base_rh) / f.sim:7.0f} B per agent "
            f"({len(f.rh_pids)} hosts, RSS {mem.base_rh / 2**20:.0f} -> "
            f"{mem.half_rh / 2**20:.0f} -> {mem.full_rh / 2**20:.0f} MiB); "
            f"{(mem.full_rh - mem.half_rh) / (f.sim - mem.half_sim):.0f} B per agent added; at "
            f"least {mem.parked_min} of {f.sim} polls parked at their relay as memory was read"
        )


def print_events(f: Fleet, args: argparse.Namespace, ev: Events, fan: Fanout) -> None:
    print(
        f"events             : {ev.per_s:9.0f} /s  ({ev.total} in {ev.seconds:.2f} s, "
        f"{EVENTS_PER_REPORT} per report; target >= 20000); {ev.not_known} reports not known, "
        f"{ev.retries} sent again after a failure (the relay's report_many timing out), "
        f"{ev.copies} events dropped by the coordinator as copies"
    )
    print(f"  CPU s            : {_cpu_line(*ev.cpu)}")
    print(f"parts              : {ev.states}; {ev.traces} traces indexed")
    if f.rh_pids:
        rstats = ev.relay_stats
        print(
            f"relays             : {args.delivery}: shared polls (or syncs) "
            f"{sum(s['shared_polls'] for s in rstats)}, pushes "
            f"{sum(s['pushes'] for s in rstats)}, "
            f"event batches {sum(s['reports'] for s in rstats)}, coordinator errors "
            f"{sum(s['errors'] for s in rstats)}"
        )
    print(
        f"polls unknown {fan.unknown}, failed {fan.poll_errors}; state writes failed: "
        f"{ev.state_write_failures} (SQLite in {f.state_dir})"
    )


def result_line(
    f: Fleet, args: argparse.Namespace, mem: Memory, fan: Fanout, ev: Events, load_start: float
) -> str:
    bytes_per_agent = mem.per_agent(args.agents)
    missed = [
        name
        for name, bad in (
            ("fanout", fan.fanout_ms > TARGET_FANOUT_MS),
            ("events", ev.per_s < TARGET_EVENTS_PER_S),
            ("memory", bytes_per_agent > TARGET_BYTES_PER_AGENT),
        )
        if bad
    ]
    hop_part = (
        f"agent_hop={args.agent_hop} delivery={args.delivery} "
        f"relay_forward_min={args.relay_forward_min} relay_hosts={args.relay_hosts} "
        if args.mode == "relay"
        else ""
    )
    fanout_cpu = fan.cpu[1]["coordinator"] - fan.cpu[0]["coordinator"]
    relay_part = (
        "" if fan.relay_fanout_ms is None else f"relay_fanout_ms={fan.relay_fanout_ms:.0f} "
    )
    rh_part = (
        f"relay_host_bytes_per_agent={(mem.full_rh - mem.base_rh) / f.sim:.0f} "
        if f.rh_pids
        else ""
    )
    return (
        f"RESULT agents={args.agents} nodes={args.nodes} mode={args.mode} {hop_part}"
        f"agent_hosts={args.agent_hosts} gc_young={args.gc_young} "
        f"fanout_ms={fan.fanout_ms:.0f} {relay_part}coordinator_fanout_cpu_s={fanout_cpu:.1f} "
        f"events_per_s={ev.per_s:.0f} "
        f"bytes_per_agent={bytes_per_agent:.0f} marginal_bytes_per_agent="
        f"{mem.marginal(f.sim):.0f} "
        f"{rh_part}plans_delivered={fan.got} real_agents={args.real_agents} "
        f"register_s={mem.register_s:.1f} create_ms={fan.create_ms:.0f} "
        f"report_retries={ev.retries} duplicates_dropped={ev.copies} "
        f"targets={'met' if not missed else 'missed:' + ','.join(missed)} "
        f"load_start={load_start:.2f} load={os.getloadavg()[0]:.2f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=1_250)
    parser.add_argument("--mode", choices=("relay", "direct"), default="relay")
    parser.add_argument("--relay-hosts", type=int, default=4)
    parser.add_argument("--agent-hosts", type=int, default=4)
    parser.add_argument(
        "--agent-hop", choices=("socket", "rpc", "local"), default="socket",
        help="simulated agents' calls to their relay: each agent's own connections to its "
        "relay's Unix socket (as profd's agents make them), Ray calls from agent hosts, or "
        "awaits in the relay's own process",
    )  # fmt: skip
    parser.add_argument(
        "--delivery", choices=("push", "poll"), default="push",
        help="how relays get plans: pushed by the coordinator (profd's relays) or a "
        "poll_many parked at the coordinator per relay",
    )  # fmt: skip
    parser.add_argument("--real-agents", type=int, default=16, help="whole nodes of them")
    parser.add_argument(
        "--settle-s", type=float, default=35.0,
        help="seconds of polling before memory is read (past a poll period)",
    )  # fmt: skip
    parser.add_argument("--fanout-timeout-s", type=float, default=60.0)
    parser.add_argument(
        "--poll-timeout-s", type=float, default=30.0,
        help="the coordinator's poll_timeout_s (profd's default: 5)",
    )  # fmt: skip
    parser.add_argument(
        "--heartbeat-timeout-s", type=float, default=120.0,
        help="the coordinator's heartbeat_timeout_s (profd's default: 30)",
    )  # fmt: skip
    parser.add_argument(
        "--relay-forward-min", type=int, default=64,
        help="the coordinator's relay_forward_min (PROFD_RELAY_FORWARD_MIN; profd's default "
        "64): with this many relays to push to, pushes go through relays; 0: every push direct",
    )  # fmt: skip
    parser.add_argument(
        "--gc-young", type=int, default=0,
        help="the coordinator process's young-collection threshold (PROFD_GC_YOUNG_OBJECTS; "
        "0, profd's default: Python's own, 700)",
    )  # fmt: skip
    parser.add_argument(
        "--py-spy", metavar="DIR",
        help="record the coordinator and a relay host with py-spy during fan-out and events",
    )  # fmt: skip
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    load_start = os.getloadavg()[0]
    per_node = args.agents // args.nodes
    if per_node * args.nodes != args.agents or args.real_agents % per_node:
        parser.error("--agents must be a multiple of --nodes, --real-agents of agents per node")

    from profd.core.ray_env import init_local_ray

    init_local_ray()  # on 127.0.0.1; the loopback settings come before Ray is imported
    return run(args, load_start)


if __name__ == "__main__":
    sys.exit(main())
