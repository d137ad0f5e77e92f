"""The fleet of ``bench/coordinator_scale.py``: its processes started (the coordinator,
relay hosts, agent hosts and real nodes of :mod:`_fleet_hosts`) and how their memory and CPU
are read (see that bench's docstring for what is measured)."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from _fleet_hosts import AgentHost, RealNode, RelayHost, node_id_of


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

        self.args = args
        self.per_node = args.agents // args.nodes
        self.real_nodes = args.real_agents // self.per_node
        self.sim = args.agents - args.real_agents
        self.coord = self._coordinator()
        self.cpid = ray.get(self.coord.pid.remote())
        # nodes [0, real_nodes) hold the real agents, the others simulated ones
        self.sim_nodes = list(range(self.real_nodes, args.nodes))
        self.relay_of: dict[int, int] = {}
        self.sockets: dict[str, str] = {}
        self.relay_hosts: list[Any] = []
        self.rh_pids: list[int] = []
        chunks: list[list[int]] = []
        if args.mode == "relay":
            chunks = self._start_relay_hosts()
        if args.mode == "relay" and args.agent_hop == "local":
            self.ah_nodes = chunks
            self.agent_hosts = self.relay_hosts
            calls = [
                h.host_agents.remote(self._agents_of(c), args.agents)
                for h, c in zip(self.relay_hosts, chunks, strict=True)
            ]
            ray.get(calls)
            self.ah_pids: list[int] = []
        else:
            self._start_agent_hosts()
        self.real: list[Any] = []
        self.real_pids: list[int] = []

    def _coordinator(self) -> Any:
        """The real coordinator actor, persisting to SQLite in a state directory of its own
        (as ``profd up`` does), with the settings ``profd up`` reads from the environment."""
        from profd.actors import get_or_create_coordinator
        from profd.core.settings import ProfdSettings

        args = self.args
        self.state_dir = tempfile.mkdtemp(prefix="profd-bench-state-")
        # what `profd up` reads from PROFD_POLL_TIMEOUT_S, PROFD_HEARTBEAT_TIMEOUT_S, ...
        settings = ProfdSettings(
            poll_timeout_s=args.poll_timeout_s,
            heartbeat_timeout_s=args.heartbeat_timeout_s,
            relay_forward_min=args.relay_forward_min,
            gc_young_objects=args.gc_young,
        ).coordinator()
        update = {"state_dir": self.state_dir}
        coord, _ = get_or_create_coordinator(settings.model_copy(update=update), detached=False)
        return coord

    def _start_relay_hosts(self) -> list[list[int]]:
        """``--relay-hosts`` processes, each hosting its share of the simulated nodes' relays;
        the nodes of each."""
        import ray

        k = self.args.relay_hosts
        chunks = [self.sim_nodes[i::k] for i in range(k)]
        for h, chunk in enumerate(chunks):
            self.relay_of.update({n: h for n in chunk})
        rh_cls = ray.remote(RelayHost).options(num_cpus=0, max_concurrency=100_000)
        pushed = self.args.delivery == "push"
        self.relay_hosts = [rh_cls.remote([node_id_of(n) for n in c], pushed) for c in chunks]
        sockets = self.args.agent_hop == "socket"
        started = ray.get([h.start.remote(sockets) for h in self.relay_hosts])
        self.rh_pids = [pid for pid, _ in started]
        self.sockets = {n: path for _, paths in started for n, path in paths.items()}
        return chunks

    def _start_agent_hosts(self) -> None:
        """``--agent-hosts`` processes of simulated agents, each agent calling its relay (its
        socket, or its relay host) or the coordinator."""
        import ray

        args = self.args
        m = args.agent_hosts
        self.ah_nodes = [self.sim_nodes[i::m] for i in range(m)]
        ah_cls = ray.remote(AgentHost).options(num_cpus=0, max_concurrency=1000)
        hop = "socket" if args.mode == "relay" and args.agent_hop == "socket" else args.mode
        target = {"socket": self.sockets, "relay": self.relay_hosts}.get(hop, self.coord)
        self.agent_hosts = [
            ah_cls.remote(hop, target, self._agents_of(nodes), args.agents)
            for nodes in self.ah_nodes
        ]
        self.ah_pids = ray.get([h.pid.remote() for h in self.agent_hosts])

    def _agents_of(self, nodes: list[int]) -> list[tuple[str, int, int]]:
        """The simulated agents of ``nodes``: (node id, relay host index, agent index)."""
        per = self.per_node
        return [
            (node_id_of(n), self.relay_of.get(n, 0), n * per + p) for n in nodes for p in range(per)
        ]

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
