"""The hosts of ``bench/coordinator_scale.py``'s fleet, each a Ray actor: relay hosts (many
real :class:`~profd.actors.relay.NodeRelay` s in one process, each serving its own socket),
hosts of simulated agents (each agent's own long-poll over its relay's socket, and its
window's events), and the real agents' nodes (real ``ProfilerAgent`` s behind a real relay)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from typing import Any

#: Events one simulated agent reports at once: its window, as a real agent sends it.
EVENTS_PER_REPORT = 10
#: The window's steps (far ahead: the real agents never reach them, they only arm).
FIRST_STEP = 10**9
WINDOW_STEPS = 6
ROLE = "trainer"


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
        from profd.core.ray_env import ray_context
        from profd.core.request import ToolKind

        caps = {t.value: None for t in ToolKind}
        # One fleet, one Ray job: the real agents' (in this job's actors) and these alike
        # (the coordinator never merges one role's agents across two jobs).
        job = ray_context().job_id
        self.mode = mode
        self.target = target
        self.agents = []
        for node, host, rank in agents:
            info = AgentInfo(
                f"{node}-r{rank}", ROLE, rank, world, {"local_rank": rank % 8}, node,
                os.getpid(), node_id=node, node_ip="127.0.0.1", capabilities=caps, job_id=job,
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
