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
relay_forward_min=64 fanout_ms=... relay_fanout_ms=... coordinator_fanout_cpu_s=...
events_per_s=... bytes_per_agent=... marginal_bytes_per_agent=...
relay_host_bytes_per_agent=... plans_delivered=10000 real_agents=16 register_s=...
create_ms=... report_retries=... duplicates_dropped=... targets=met|missed:<which>
load_start=... load=...``
(1-minute load averages).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

TARGET_FANOUT_MS = 1000.0
TARGET_EVENTS_PER_S = 20_000.0
TARGET_BYTES_PER_AGENT = 2048.0
#: Events one simulated agent reports at once: its window, as a real agent sends it.
EVENTS_PER_REPORT = 10
#: The window's steps (far ahead: the real agents never reach them, they only arm).
FIRST_STEP = 10**9
WINDOW_STEPS = 6
ROLE = "trainer"


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds the processes used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone (a relay Ray restarted): what it used is not counted
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


class PySpy:
    """``--py-spy DIR``: py-spy records the named processes during one phase, as collapsed
    stacks (``DIR/<phase>-<name>.txt``; where the CPU of a phase went). Off without DIR."""

    def __init__(self, out_dir: str | None, phase: str, pids: dict[str, Any]) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        if not out_dir:
            return
        from profd.core.stacks import find_py_spy

        os.makedirs(out_dir, exist_ok=True)
        for name, pid in pids.items():
            for i, p in enumerate(pid if isinstance(pid, list) else [pid]):
                out = os.path.join(out_dir, f"{phase}-{name}{i or ''}.txt")
                cmd = [find_py_spy() or "py-spy", "record", "--pid", str(p), "--format", "raw",
                       "--rate", "200", "--nonblocking", "--output", out]  # fmt: skip
                self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
        time.sleep(1.0)  # attached before the phase starts

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for proc in self.procs:
            proc.wait(timeout=30)


def node_id_of(n: int) -> str:
    return f"simnode{n:05d}"


def window_events(session_id: str, save_dir: str, node_id: str, rank: int) -> list[Any]:
    """The 10 events of one agent's window, as its recorder and exporter send them."""
    from profd.core.naming import trace_id_for
    from profd.core.protocol import AgentEvent, EventKind, PartDone, StepsMissed, TraceWritten

    steps = [FIRST_STEP + i for i in range(WINDOW_STEPS)]
    recorded, missed = tuple(steps[:-1]), tuple(steps[-1:])
    evs = [
        AgentEvent(EventKind.ARMED, session_id, None),
        AgentEvent(EventKind.RECORDING, session_id, steps[0]),
    ]
    for s in recorded:
        path = f"{save_dir}/{ROLE}_rank{rank}_step{s}.pt.trace.json.gz"
        written = TraceWritten(
            trace_id=trace_id_for(node_id, path),
            path=path,
            bytes=12_345_678,
            steps=(s,),
            scope="train",
            tool="torch",
            stall_s=0.012,
        )
        evs.append(AgentEvent(EventKind.TRACE, session_id, s, payload=written))
    why = "the loop never entered these steps"
    evs.append(AgentEvent(EventKind.MISSED, session_id, missed[0], why, StepsMissed(missed)))
    evs.append(AgentEvent(EventKind.COLLECTING, session_id))
    evs.append(AgentEvent(EventKind.PART_DONE, session_id, payload=PartDone(recorded, missed)))
    assert len(evs) == EVENTS_PER_REPORT
    # numbered as an agent's channel numbers them (a copy sent again is dropped)
    return [dataclasses.replace(ev, seq=i) for i, ev in enumerate(evs, 1)]


class RelayHost:
    """The real :class:`NodeRelay` s of many simulated nodes in one process, each with its own
    coordinator caller; an agent's call names its node and goes to that node's relay."""

    def __init__(self, node_ids: list[str], pushed: bool) -> None:
        self.node_ids = node_ids
        self.pushed = pushed
        self.relays: dict[str, Any] = {}
        self.servers: dict[str, Any] = {}
        self.delivered: dict[str, float] = {}

    async def start(self, serve_sockets: bool) -> tuple[int, dict[str, str]]:
        """The relays; with ``serve_sockets`` each serves its own Unix socket with the
        relay's real server (``--agent-hop socket``); (pid, each node's socket path)."""
        import ray

        from profd.actors.relay import NodeRelay, RayCoordinatorCaller
        from profd.actors.relay_socket import serve

        me = ray.get_runtime_context().current_actor  # the coordinator pushes to us, by node
        self.relays = {
            n: NodeRelay(
                n, RayCoordinatorCaller(), push_target=lambda n=n: (me, n), pushed=self.pushed,
                serve_socket=False,
            )
            for n in self.node_ids
        }  # fmt: skip
        if serve_sockets:
            for n in self.node_ids:  # served as NodeRelay.ping starts it, poll receipts stamped
                server = await serve(_Stamped(self, n), n)
                if server is None:
                    raise RuntimeError("no relay socket here (see the log)")
                self.servers[n] = server
        return os.getpid(), {n: str(s.path) for n, s in self.servers.items()}

    async def close(self) -> None:
        for server in self.servers.values():
            await server.close()

    async def push(self, node: str, replies: dict[str, Any], refresh: bool) -> bool:
        return await self.relays[node].push(node, replies, refresh)

    async def push_on(
        self, node: str, replies: dict[str, Any], refresh: bool, forwards: list[Any]
    ) -> Any:
        return await self.relays[node].push_on(node, replies, refresh, forwards)

    async def register(self, node: str, info: Any, step: int | None) -> Any:
        return await self.relays[node].register(info, step)

    async def poll(
        self, node: str, agent_id: str, version: int, step: int | None, timeout: float
    ) -> Any:
        reply = await self.relays[node].poll(agent_id, version, step, timeout)
        if reply.plan is not None and reply.plan.windows:
            self.delivered.setdefault(agent_id, time.time())
        return reply

    async def report(self, node: str, agent_id: str, events: list[Any]) -> bool:
        return await self.relays[node].report(agent_id, events)

    async def stats(self) -> dict[str, int]:
        out = {"agents": 0, "parked": 0, "shared_polls": 0, "reports": 0, "events": 0, "errors": 0}
        out["pushes"] = 0
        for relay in self.relays.values():
            s = await relay.stats()
            out["pushes"] += s.pushes
            out["agents"] += s.agents
            out["parked"] += s.parked_polls
            out["shared_polls"] += s.shared_polls
            out["reports"] += s.reports_sent
            out["events"] += s.events_sent
            out["errors"] += s.coordinator_errors
        return out

    async def delivered_times(self) -> tuple[int, float]:
        return len(self.delivered), max(self.delivered.values(), default=0.0)

    # -- ``--agent-hop local``: its nodes' simulated agents live here too -----------------
    async def host_agents(self, agents: list[tuple[str, int, int]], world: int) -> int:
        self.agent_host = AgentHost("local", self, agents, world)
        return os.getpid()

    async def start_agents(self, part: int, parts: int) -> float:
        return await self.agent_host.start_agents(part, parts)

    async def received_times(self) -> tuple[int, float, int, int]:
        return await self.agent_host.received_times()

    async def prepare_window(self, session_id: str, save_dir: str) -> int:
        return await self.agent_host.prepare_window(session_id, save_dir)

    async def send_window(self) -> tuple[int, int, int]:
        return await self.agent_host.send_window()


class _Stamped:
    """One node's relay as its socket serves it, its polls' plan receipts stamped."""

    def __init__(self, host: RelayHost, node: str) -> None:
        self._host, self._node = host, node
        self._relay = host.relays[node]

    async def register(self, info: Any, step: int | None) -> Any:
        return await self._relay.register(info, step)

    async def poll(self, agent_id: str, version: int, step: int | None, timeout: float) -> Any:
        return await self._host.poll(self._node, agent_id, version, step, timeout)

    async def report(self, agent_id: str, events: list[Any]) -> bool:
        return await self._relay.report(agent_id, events)

    async def clock_ns(self) -> int:
        return await self._relay.clock_ns()

    async def ping(self) -> Any:
        return await self._relay.ping()


class SocketCalls:
    """One connection of a simulated agent to its relay's Unix socket (a real agent's poller
    and reporter each hold one), in :mod:`profd.core.relay_wire`'s frames."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._io: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._io is None:
            self._io = await asyncio.open_unix_connection(self.path)
        return self._io

    async def call(self, method: str, *args: Any) -> Any:
        from profd.core.relay_wire import HEADER_SIZE, body_size, decode, encode

        reader, writer = await self.open()
        try:
            writer.write(encode((method, args)))
            await writer.drain()
            ok, value = decode(await reader.readexactly(body_size(await reader.readexactly(
                HEADER_SIZE))))  # fmt: skip
        except BaseException:
            self._io = None  # out of step: a new connection next time
            writer.close()
            raise
        if not ok:
            raise ConnectionError(value)
        return value


class AgentHost:
    """Simulated agents of many nodes in one process: one asyncio task each, whose long-poll
    is a call of its own: over its own connection to its node's relay socket (``socket``),
    a Ray call to its node's relay host (``relay``), or to the coordinator (``direct``)."""

    def __init__(self, mode: str, target: Any, agents: list[tuple[str, int, int]], world: int):
        """``agents``: (node id, relay host index, rank) of each; ``target``: the relay hosts
        (relay mode) or the coordinator (direct)."""
        from profd.core.protocol import AgentInfo
        from profd.core.request import ToolKind

        caps = {t.value: None for t in ToolKind}
        self.mode = mode
        self.target = target
        self.agents = []
        for node, host, rank in agents:
            info = AgentInfo(
                f"{node}-r{rank}", ROLE, rank, world, {"local_rank": rank % 8}, node,
                os.getpid(), node_id=node, node_ip="127.0.0.1", capabilities=caps,
            )  # fmt: skip
            self.agents.append((node, host, info))
        self.conns: dict[tuple[str, str], SocketCalls] = {}  # (agent, poll | report)
        self.versions: dict[str, int] = {}
        self.received: dict[str, float] = {}
        self.unknown = 0
        self.poll_errors = 0
        self.report_retries = 0
        self.poll_timeout = 5.0
        self.tasks: list[asyncio.Task] = []

    async def pid(self) -> int:
        return os.getpid()

    async def _call(self, node: str, host: int, method: str, *args: Any) -> Any:
        """A call of the agent's link: over its connection to its node's relay socket
        (``socket``; ``target`` maps nodes to socket paths), a Ray call to its node's relay
        host (``relay``), an await of its node's relay in this process (``local``), or a Ray
        call to the coordinator (``direct``)."""
        if self.mode == "socket":
            agent = args[0].agent_id if method == "register" else args[0]
            key = (agent, "report" if method == "report" else "poll")
            conn = self.conns.get(key)
            if conn is None:
                conn = self.conns[key] = SocketCalls(self.target[node])
            return await conn.call(method, *args)
        if self.mode == "relay":
            return await getattr(self.target[host], method).remote(node, *args)
        if self.mode == "local":
            return await getattr(self.target, method)(node, *args)
        return await getattr(self.target, method).remote(*args)

    async def _register(self, node: str, host: int, info: Any) -> None:
        reg = await self._call(node, host, "register", info, 0)
        self.versions[info.agent_id] = reg.plan.version
        self.poll_timeout = float(reg.poll_timeout_s)
        if self.mode == "socket":  # the reporter's connection, open as a live agent's is
            conn = self.conns[(info.agent_id, "report")] = SocketCalls(self.target[node])
            await conn.open()

    async def start_agents(self, part: int, parts: int, chunk: int = 200) -> float:
        """Register the ``part``-th of ``parts`` slices of this host's nodes and start their
        agents' long-polls; the seconds it took."""
        t0 = time.perf_counter()
        nodes: dict[str, list[tuple[str, int, Any]]] = {}
        for a in self.agents:
            nodes.setdefault(a[0], []).append(a)
        mine = [a for i, node in enumerate(nodes.values()) if i % parts == part for a in node]
        for i in range(0, len(mine), chunk):
            await asyncio.gather(*[self._register(*a) for a in mine[i : i + chunk]])
        loop = asyncio.get_running_loop()
        self.tasks += [loop.create_task(self._poll(*a)) for a in mine]
        return time.perf_counter() - t0

    async def _poll(self, node: str, host: int, info: Any) -> None:
        aid = info.agent_id
        while True:
            try:
                reply = await self._call(
                    node, host, "poll", aid, self.versions[aid], 0, self.poll_timeout
                )
            except Exception:  # the channel backs off and retries; so does this
                self.poll_errors += 1
                await asyncio.sleep(0.5)
                continue
            if not reply.known:  # the channel registers again
                self.unknown += 1
                await self._register(node, host, info)
                continue
            if reply.plan is not None:
                self.versions[aid] = reply.plan.version
                if reply.plan.windows:
                    self.received.setdefault(aid, time.time())

    async def received_times(self) -> tuple[int, float, int, int]:
        last = max(self.received.values(), default=0.0)
        return len(self.received), last, self.unknown, self.poll_errors

    async def prepare_window(self, session_id: str, save_dir: str) -> int:
        """Each agent's window's 10 events (made over the window by a real agent's recorder
        and exporter; made here before the timed send); how many."""
        self.window = [
            (node, host, info, window_events(session_id, save_dir, node, info.rank))
            for node, host, info in self.agents
        ]
        return sum(len(b[3]) for b in self.window)

    async def send_window(self) -> tuple[int, int, int]:
        """Every agent reports its window's 10 events at once; (events, reports whose agent
        was not known, reports sent again)."""
        batches = self.window

        async def one(node: str, host: int, info: Any, evs: list[Any]) -> bool:
            attempt = 0
            while True:  # as the channel's reporter: a failed report is sent again
                try:
                    return await self._call(node, host, "report", info.agent_id, evs)
                except Exception:
                    self.report_retries += 1
                    attempt += 1
                    await asyncio.sleep(min(5.0, 0.5 * 2 ** min(attempt, 6)))

        known = await asyncio.gather(*[one(*b) for b in batches])
        return sum(len(b[3]) for b in batches), sum(1 for k in known if not k), self.report_retries


class RealNode:
    """One simulated node's processes as real agents: a :class:`ProfilerAgent` each (its own
    channel: poller and reporter threads), all in this process, stepping every 0.2 s."""

    def __init__(self, mode: str, node_id: str, ranks: list[int], world: int, own: bool):
        from profd.agent.agent import ProfilerAgent
        from profd.agent.channel import find_ray_link
        from profd.agent.relay_link import NodeLinkFinder

        if mode == "direct":
            find: Any = find_ray_link
        elif own:  # this Ray node's relay, as an agent finds (and starts) it
            find = NodeLinkFinder(node_id=node_id)
        else:  # a simulated node: the same relay actor, without node affinity
            find = NodeLinkFinder(node_id=node_id, get_relay=_standalone_relay)
        self.agents = [
            ProfilerAgent(ROLE, r, world, {"local_rank": i}, find_link=find).start()
            for i, r in enumerate(ranks)
        ]
        self._stop = threading.Event()
        for a in self.agents:
            threading.Thread(target=self._loop, args=(a,), daemon=True).start()

    def _loop(self, agent: Any) -> None:
        step = 0
        while not self._stop.is_set():
            with agent.step(step), agent.stage("work"):
                time.sleep(0.2)
            step += 1

    def ids(self) -> list[str]:
        return [a.info.agent_id for a in self.agents]

    def connected(self) -> int:
        return sum(1 for a in self.agents if a.connected)

    def armed(self) -> int:
        return sum(1 for a in self.agents if a.plan.windows)

    def pid(self) -> int:
        return os.getpid()


def _standalone_relay(node_id: str) -> Any:
    """The relay actor as :func:`profd.actors.get_or_create_relay` makes it, for a node id Ray
    does not know (so without node affinity)."""
    import ray

    from profd.actors import RELAY_MAX_CONCURRENCY
    from profd.actors.relay import NodeRelay, relay_name
    from profd.core.constants import NAMESPACE

    return (
        ray.remote(NodeRelay)
        .options(
            name=relay_name(node_id), namespace=NAMESPACE, get_if_exists=True,
            lifetime="detached", num_cpus=0, max_restarts=-1,
            max_concurrency=RELAY_MAX_CONCURRENCY,
        )
        .remote(node_id)
    )  # fmt: skip


def _wait(what: str, check: Any, timeout: float, every: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            print(f"FAILED: {what} not within {timeout:.0f} s", file=sys.stderr)
            return False
        time.sleep(every)
    return True


class Fleet:
    """The processes of one run and their pids (memory and CPU are read from /proc)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import ray

        from profd.actors import get_or_create_coordinator
        from profd.core.settings import ProfdSettings

        self.args = args
        self.per_node = args.agents // args.nodes
        self.real_nodes = args.real_agents // self.per_node
        self.sim = args.agents - args.real_agents
        self.state_dir = tempfile.mkdtemp(prefix="profd-bench-state-")  # as `profd up` does
        # what `profd up` reads from PROFD_POLL_TIMEOUT_S / PROFD_HEARTBEAT_TIMEOUT_S
        settings = ProfdSettings(
            poll_timeout_s=args.poll_timeout_s,
            heartbeat_timeout_s=args.heartbeat_timeout_s,
            relay_forward_min=args.relay_forward_min,
        ).coordinator()
        self.coord, _ = get_or_create_coordinator(
            settings.model_copy(update={"state_dir": self.state_dir}), detached=False
        )
        self.cpid = ray.get(self.coord.pid.remote())
        # nodes [0, real_nodes) hold the real agents, the others simulated ones
        sim_nodes = list(range(self.real_nodes, args.nodes))
        relay_of: dict[int, int] = {}
        self.sockets: dict[str, str] = {}
        self.relay_hosts: list[Any] = []
        self.rh_pids: list[int] = []
        if args.mode == "relay":
            k = args.relay_hosts
            chunks = [sim_nodes[i::k] for i in range(k)]
            for h, chunk in enumerate(chunks):
                relay_of.update({n: h for n in chunk})
            rh_cls = ray.remote(RelayHost).options(num_cpus=0, max_concurrency=100_000)
            pushed = args.delivery == "push"
            self.relay_hosts = [
                rh_cls.remote([node_id_of(n) for n in c], pushed) for c in chunks
            ]
            started = ray.get(
                [h.start.remote(args.agent_hop == "socket") for h in self.relay_hosts]
            )
            self.rh_pids = [pid for pid, _ in started]
            self.sockets = {n: path for _, paths in started for n, path in paths.items()}

        def agents_of(nodes: list[int]) -> list[tuple[str, int, int]]:
            per = self.per_node
            return [
                (node_id_of(n), relay_of.get(n, 0), n * per + p) for n in nodes for p in range(per)
            ]

        if args.mode == "relay" and args.agent_hop == "local":
            self.ah_nodes = chunks
            self.agent_hosts = self.relay_hosts
            ray.get(
                [
                    h.host_agents.remote(agents_of(c), args.agents)
                    for h, c in zip(self.relay_hosts, chunks, strict=True)
                ]
            )
        else:
            m = args.agent_hosts
            self.ah_nodes = [sim_nodes[i::m] for i in range(m)]
            ah_cls = ray.remote(AgentHost).options(num_cpus=0, max_concurrency=1000)
            hop = "socket" if args.mode == "relay" and args.agent_hop == "socket" else args.mode
            target = {"socket": self.sockets, "relay": self.relay_hosts}.get(hop, self.coord)
            self.agent_hosts = [
                ah_cls.remote(hop, target, agents_of(nodes), args.agents)
                for nodes in self.ah_nodes
            ]
        self.ah_pids = (
            []
            if self.agent_hosts is self.relay_hosts
            else ray.get([h.pid.remote() for h in self.agent_hosts])
        )
        self.real: list[Any] = []
        self.real_pids: list[int] = []

    def start_real(self) -> bool:
        """The real agents' nodes (their processes start while nothing else runs)."""
        import ray

        this_node = ray.get_runtime_context().get_node_id()
        rn_cls = ray.remote(RealNode).options(num_cpus=0, max_concurrency=4)
        per = self.per_node
        self.real = [
            rn_cls.remote(
                self.args.mode,
                this_node if n == 0 else node_id_of(n),
                [n * per + p for p in range(per)],
                self.args.agents,
                n == 0,
            )
            for n in range(self.real_nodes)
        ]
        self.real_pids = ray.get([r.pid.remote() for r in self.real])
        want = self.args.real_agents
        return _wait(
            "every real agent registered",
            lambda: sum(ray.get([r.connected.remote() for r in self.real])) == want,
            120,
        )

    def relay_pids(self) -> list[int]:
        """The standalone relays of the real agents' nodes (by their process title)."""
        pids = []
        for d in os.listdir("/proc"):
            try:
                with open(f"/proc/{d}/cmdline", "rb") as fh:
                    if d.isdigit() and fh.read().startswith(b"ray::NodeRelay"):
                        pids.append(int(d))
            except OSError:
                continue
        return pids

    def cpu(self, extra: list[int]) -> dict[str, float]:
        groups = {
            "coordinator": [self.cpid],
            "relay hosts": self.rh_pids,
            "agent hosts": self.ah_pids,
            "real agents + relays": self.real_pids + extra,
        }
        return {k: cpu_s(v) for k, v in groups.items()}

    def close(self) -> None:
        import ray

        ray.get([h.close.remote() for h in self.relay_hosts])  # their socket files
        ray.shutdown()
        shutil.rmtree(self.state_dir, ignore_errors=True)


def _cpu_line(before: dict[str, float], after: dict[str, float]) -> str:
    return ", ".join(f"{k} {after[k] - before[k]:.1f}" for k in before)


def run(args: argparse.Namespace, load_start: float) -> int:
    f = Fleet(args)
    try:
        return measure(f, args, load_start)
    finally:
        f.close()


def measure(f: Fleet, args: argparse.Namespace, load_start: float) -> int:
    import ray

    coord = f.coord
    time.sleep(2.0)
    base = rss_bytes(f.cpid)
    base_rh = sum(rss_bytes(p) for p in f.rh_pids)
    if not f.start_real():
        return 1
    relay_pids = f.relay_pids() if args.mode == "relay" else []

    def parked() -> int:
        return sum(s["parked"] for s in ray.get([h.stats.remote() for h in f.relay_hosts]))

    # Half the nodes, then the rest: the growth between them is what one more agent costs.
    t0 = time.perf_counter()
    ray.get([h.start_agents.remote(0, 2) for h in f.agent_hosts])
    register_s = time.perf_counter() - t0
    time.sleep(args.settle_s)
    half = rss_bytes(f.cpid)
    half_rh = sum(rss_bytes(p) for p in f.rh_pids)
    half_sim = sum(len(nodes[0::2]) for nodes in f.ah_nodes) * f.per_node
    t1 = time.perf_counter()
    ray.get([h.start_agents.remote(1, 2) for h in f.agent_hosts])
    register_s += time.perf_counter() - t1
    registered = ray.get(coord.status.remote()).agents
    if registered != args.agents:
        print(f"FAILED: {registered}/{args.agents} agents registered", file=sys.stderr)
        return 1
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
        return 1
    full = full_rh = 0
    parked_min = f.sim
    for _ in range(5):
        full = max(full, rss_bytes(f.cpid))
        full_rh = max(full_rh, sum(rss_bytes(p) for p in f.rh_pids))
        if f.relay_hosts:
            parked_min = min(parked_min, parked())
        time.sleep(1.0)
    bytes_per_agent = (full - base) / args.agents
    marginal = (full - half) / (f.sim - half_sim)
    rh_per_agent = (full_rh - base_rh) / f.sim if f.rh_pids else None
    rh_marginal = (full_rh - half_rh) / (f.sim - half_sim) if f.rh_pids else None

    # Fan-out: every agent targeted.
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
    sid = view.session_id
    real_ids = {a for r in f.real for a in ray.get(r.ids.remote())}

    def real_armed_at() -> list[float]:
        parts = ray.get(coord.get_session.remote(sid)).targets
        return [p.armed_at for p in parts if p.agent_id in real_ids and p.armed_at]

    # the real agents' own stamp, sent back as their `armed` event (through their relay)
    if got >= args.agents:
        _wait("the real agents' armed events", lambda: len(real_armed_at()) == len(real_ids), 30)
    links: dict[str, int] = {}
    for a in ray.get(coord.list_agents.remote()):
        if a.agent_id in real_ids:
            key = a.link.value if a.link is not None else "none"
            links[key] = links.get(key, 0) + 1
    unknown = sum(c[2] for c in counts)
    poll_errors = sum(c[3] for c in counts)
    print(
        f"agents: {args.agents} on {args.nodes} nodes x {f.per_node} ({args.mode}); "
        f"{args.real_agents} real agents on {f.real_nodes} nodes (links {links}); "
        f"{len(view.targets)} targeted; load at start {load_start:.2f}"
    )
    if got < args.agents or len(view.targets) < args.agents:
        print(
            f"FAILED: {got}/{args.agents} agents got their plan within "
            f"{args.fanout_timeout_s:.0f} s ({len(view.targets)} targeted; {unknown} polls "
            f"unknown, {poll_errors} failed)",
            file=sys.stderr,
        )
        return 1
    fanout_ms = (max([c[1] for c in counts] + real_armed_at()) - t_create) * 1000
    relay_fanout_ms = None
    if f.relay_hosts:
        d = ray.get([h.delivered_times.remote() for h in f.relay_hosts])
        relay_fanout_ms = (max(t for _, t in d) - t_create) * 1000

    print(f"registration       : {register_s:7.2f} s")
    print(
        f"plan fan-out       : {fanout_ms:7.0f} ms  (every agent's own poll; target <= 1000; "
        f"create_session answered in {create_ms:.0f} ms)"
    )
    if relay_fanout_ms is not None:
        print(
            f"  relays answered  : {relay_fanout_ms:7.0f} ms  (the last agent's poll at its relay)"
        )
    print(f"  CPU s            : {_cpu_line(cpu0, cpu1)}")
    idle = {k: (idle1[k] - idle0[k]) / idle_s * 100 for k in idle0}
    print(f"idle polling, CPU %: {', '.join(f'{k} {v:.0f}' for k, v in idle.items())}")
    print(
        f"coordinator memory : {bytes_per_agent:7.0f} B per agent, every agent polling "
        f"(RSS {base / 2**20:.0f} -> {half / 2**20:.0f} -> {full / 2**20:.0f} MiB; "
        f"target <= 2048); {marginal:.0f} B per agent added from half the nodes polling"
    )
    if rh_per_agent is not None:
        print(
            f"relay host memory  : {rh_per_agent:7.0f} B per agent ({len(f.rh_pids)} hosts, RSS "
            f"{base_rh / 2**20:.0f} -> {half_rh / 2**20:.0f} -> {full_rh / 2**20:.0f} MiB); "
            f"{rh_marginal:.0f} B per agent added; at least {parked_min} of {f.sim} polls "
            "parked at their relay as memory was read"
        )
    # Events: every simulated agent's window, 10 events in one report, all at once.
    ray.get([h.prepare_window.remote(sid, view.save_dir) for h in f.agent_hosts])
    spy = PySpy(args.py_spy, "events", {"coordinator": f.cpid, "relay_host": f.rh_pids[:1]})
    cpu2 = f.cpu(relay_pids)
    t_ev = time.perf_counter()
    sent = ray.get([h.send_window.remote() for h in f.agent_hosts])
    ev_s = time.perf_counter() - t_ev
    spy.stop()
    cpu3 = f.cpu(relay_pids)
    total = sum(n for n, _, _ in sent)
    not_known = sum(u for _, u, _ in sent)
    retries = sum(r for _, _, r in sent)
    events_per_s = total / ev_s
    final = ray.get(coord.get_session.remote(sid))
    states: dict[str, int] = {}
    for p in final.targets:
        states[p.state.value] = states.get(p.state.value, 0) + 1
    traces = len(final.traces)
    status = ray.get(coord.status.remote())
    copies = int(ray.get(coord.metrics.remote()).get("duplicate_events_total", 0))
    rstats = ray.get([h.stats.remote() for h in f.relay_hosts])

    print(
        f"events             : {events_per_s:9.0f} /s  ({total} in {ev_s:.2f} s, "
        f"{EVENTS_PER_REPORT} per report; target >= 20000); {not_known} reports not known, "
        f"{retries} sent again after a failure (the relay's report_many timing out), "
        f"{copies} events dropped by the coordinator as copies"
    )
    print(f"  CPU s            : {_cpu_line(cpu2, cpu3)}")
    print(f"parts              : {states}; {traces} traces indexed")
    if rh_per_agent is not None:
        print(
            f"relays             : {args.delivery}: shared polls (or syncs) "
            f"{sum(s['shared_polls'] for s in rstats)}, pushes "
            f"{sum(s['pushes'] for s in rstats)}, "
            f"event batches {sum(s['reports'] for s in rstats)}, coordinator errors "
            f"{sum(s['errors'] for s in rstats)}"
        )
    print(
        f"polls unknown {unknown}, failed {poll_errors}; state writes failed: "
        f"{status.state_write_failures} (SQLite in {f.state_dir})"
    )
    if states.get("partial", 0) != f.sim or traces != f.sim * (WINDOW_STEPS - 1) or not_known:
        print("FAILED: not every window's events were applied", file=sys.stderr)
        return 1
    missed = [
        name
        for name, bad in (
            ("fanout", fanout_ms > TARGET_FANOUT_MS),
            ("events", events_per_s < TARGET_EVENTS_PER_S),
            ("memory", bytes_per_agent > TARGET_BYTES_PER_AGENT),
        )
        if bad
    ]
    hop_part = (
        f"agent_hop={args.agent_hop} delivery={args.delivery} "
        f"relay_forward_min={args.relay_forward_min} "
        if args.mode == "relay"
        else ""
    )
    fanout_cpu = cpu1["coordinator"] - cpu0["coordinator"]
    relay_part = "" if relay_fanout_ms is None else f"relay_fanout_ms={relay_fanout_ms:.0f} "
    rh_part = "" if rh_per_agent is None else f"relay_host_bytes_per_agent={rh_per_agent:.0f} "
    print(
        f"RESULT agents={args.agents} nodes={args.nodes} mode={args.mode} {hop_part}"
        f"fanout_ms={fanout_ms:.0f} {relay_part}coordinator_fanout_cpu_s={fanout_cpu:.1f} "
        f"events_per_s={events_per_s:.0f} "
        f"bytes_per_agent={bytes_per_agent:.0f} marginal_bytes_per_agent={marginal:.0f} "
        f"{rh_part}plans_delivered={got} real_agents={args.real_agents} "
        f"register_s={register_s:.1f} create_ms={create_ms:.0f} report_retries={retries} "
        f"duplicates_dropped={copies} "
        f"targets={'met' if not missed else 'missed:' + ','.join(missed)} "
        f"load_start={load_start:.2f} load={os.getloadavg()[0]:.2f}"
    )
    return 0


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
