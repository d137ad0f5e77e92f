"""Where the coordinator runs work that belongs to a node: hooks, uploads, file reads.

:class:`RayNodeRunner` runs a plain function as a Ray task pinned to the node that holds the
files (no shared filesystem assumed). :class:`LocalRunner` runs it on a thread of this
process (a coordinator used in-process, on one machine).

:func:`locate` decides where a file the trace index knows is read: Ray node ids change with
every new cluster (``profd down`` then ``profd up``), so a node id the cluster does not know
falls back to the node's address and host name. :class:`TraceLocator` feeds it the live
nodes (``ray.nodes()`` through the runner).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from profd.core.ray_env import ray_up

__all__ = [
    "LocalRunner",
    "NodeAddress",
    "NodeRunner",
    "Placement",
    "RayNodeRunner",
    "TraceLocator",
    "default_runner",
    "locate",
]

log = logging.getLogger(__name__)


class NodeRunner(Protocol):
    async def run(self, node_id: str | None, fn: Callable[..., Any], *args: Any) -> Any: ...


@dataclass(frozen=True)
class NodeAddress:
    """A node of the cluster as Ray reports it."""

    node_id: str
    node_ip: str | None = None
    hostname: str | None = None


@dataclass(frozen=True)
class Placement:
    """Where to read a file: here, on a live node (``node_id``), or nowhere (``reason``)."""

    local: bool
    node_id: str | None = None
    reason: str | None = None

    @property
    def found(self) -> bool:
        return self.reason is None


HERE = Placement(local=True)


def locate(
    node_id: str | None,
    node_ip: str | None,
    hostname: str | None,
    *,
    here_id: str | None,
    here_ips: Sequence[str] = (),
    here_hostname: str | None = None,
    live: Sequence[NodeAddress] | None = None,
) -> Placement:
    """Where to read a file written on node ``node_id`` (address ``node_ip``, host
    ``hostname``), seen from the node ``here_id`` (addresses ``here_ips``, host
    ``here_hostname``) of a cluster whose live nodes are ``live`` (None: unknown).

    In order: no node ids (no Ray) or the same node: here. A live node id: that node. The
    writer's address is this node's: here (a node id of an earlier cluster); a live node's:
    that node. Only without a recorded address (or with this node's address unknown) does the
    host name decide — containers on different nodes may share one. Otherwise the file is
    on no node of this cluster (``reason`` says which node it was).
    """
    if not node_id or not here_id or node_id == here_id:
        return HERE
    if live is None or any(n.node_id == node_id for n in live):
        return Placement(local=False, node_id=node_id)
    # the address first: containers on different nodes may share a host name
    if node_ip:
        if node_ip in here_ips:
            return HERE
        for n in live:
            if n.node_ip == node_ip:
                return Placement(local=False, node_id=n.node_id)
        if here_ips:  # this node's address is known and is another one
            return _nowhere(node_id, node_ip, hostname)
    if hostname and hostname == here_hostname:
        return HERE
    return _nowhere(node_id, node_ip, hostname)


def _nowhere(node_id: str | None, node_ip: str | None, hostname: str | None) -> Placement:
    return Placement(
        local=False,
        reason=f"it was written on node {node_ip or 'with no address'} ({hostname or '?'}), "
        f"which is not in this Ray cluster (its node id {node_id} is unknown here, and no "
        "live node has its address)",
    )


class LocalRunner:
    async def run(self, node_id: str | None, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    async def exited(self, node_id: str | None, probes: list[Any]) -> list[str]:
        from profd.actors.liveness import exited

        return await asyncio.to_thread(exited, probes)

    async def nodes(self, max_age_s: float | None = None) -> list[NodeAddress] | None:
        """Unknown: without Ray there are no other nodes to run on."""
        return None


def ray_nodes() -> list[NodeAddress]:
    """The live nodes of the connected Ray cluster (a blocking GCS call)."""
    import ray

    return [
        NodeAddress(n["NodeID"], n.get("NodeManagerAddress"), n.get("NodeManagerHostname"))
        for n in ray.nodes()
        if n.get("Alive")
    ]


class RayNodeRunner:
    #: How long a listing of the live nodes is reused (downloads come in bursts).
    NODES_TTL_S = 5.0
    #: A node without a relay is checked by a Ray task (a worker process started for it) at
    #: most this often: the heartbeat timeout is the bound there.
    TASK_CHECK_S = 30.0

    def __init__(self) -> None:
        self._remote: dict[Callable[..., Any], Any] = {}
        self._nodes: tuple[float, list[NodeAddress]] | None = None
        self._here: str | None = None  # this process's node, once asked
        self._relays: dict[str, Any] = {}
        self._tasked: dict[str, float] = {}  # node -> its last liveness task

    async def exited(self, node_id: str | None, probes: list[Any]) -> list[str]:
        """The liveness check of ``probes`` on node ``node_id``, without a Ray task: here
        when the node is this one, else by the node's relay (an actor already running
        there). A task (a worker process started for it, every few seconds: the job's steps
        felt each one) only for a node without a relay, at most every ``TASK_CHECK_S``."""
        from profd.actors.liveness import exited
        from profd.actors.relay import relay_name
        from profd.core.ray_env import find_actor

        if self._here is None:
            self._here = _this_node()
        if node_id is None or node_id == self._here:
            return await asyncio.to_thread(exited, probes)
        relay = self._relays.get(node_id)
        if relay is None:
            relay = await asyncio.to_thread(find_actor, relay_name(node_id))
        if relay is not None:
            try:
                got = await relay.exited.remote(probes)
                self._relays[node_id] = relay
                return got
            except Exception as exc:  # dead or restarting: found again next time
                self._relays.pop(node_id, None)
                log.debug("liveness: the relay of node %s did not answer: %r", node_id, exc)
                return []
        now = time.monotonic()
        if now - self._tasked.get(node_id, -self.TASK_CHECK_S) < self.TASK_CHECK_S:
            return []  # asked by a task lately: the heartbeat timeout covers the meantime
        self._tasked[node_id] = now
        return await self.run(node_id, exited, probes)

    async def nodes(self, max_age_s: float | None = None) -> list[NodeAddress] | None:
        """The cluster's live nodes (a listing at most ``max_age_s`` old, by default
        ``NODES_TTL_S``); None when Ray cannot say."""
        now = time.monotonic()
        ttl = self.NODES_TTL_S if max_age_s is None else max_age_s
        if self._nodes is not None and now - self._nodes[0] < ttl:
            return self._nodes[1]
        try:
            found = await asyncio.to_thread(ray_nodes)
        except Exception as exc:  # the GCS is busy or going away: "unknown", asked again later
            log.warning("could not list Ray's nodes: %r", exc)
            return None
        self._nodes = (now, found)
        return found

    async def run(self, node_id: str | None, fn: Callable[..., Any], *args: Any) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        remote = self._remote.get(fn)
        if remote is None:
            remote = self._remote[fn] = ray.remote(fn)
        opts: dict[str, Any] = {"num_cpus": 0, "max_retries": 0}
        if node_id:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return await remote.options(**opts).remote(*args)


def _this_node() -> str | None:
    import ray

    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:  # not in Ray after all: every node is "elsewhere"
        return ""


class TraceLocator:
    """Places trace files (anything with ``node_id``, ``node_ip`` and ``hostname``) from the
    sidecar's node ``here_id``, with the runner's view of the live nodes."""

    def __init__(
        self, runner: NodeRunner, here_id: str | None, hostname: str | None = None
    ) -> None:
        self.runner = runner
        self.here_id = here_id
        self.hostname = hostname if hostname is not None else socket.gethostname()

    async def place_all(self, traces: Sequence[Any]) -> list[Placement]:
        """One placement per trace; the live nodes are asked for at most once."""
        if all(not t.node_id or not self.here_id or t.node_id == self.here_id for t in traces):
            return [HERE for _ in traces]
        nodes = getattr(self.runner, "nodes", None)
        live = await nodes() if nodes is not None else None
        ips = [n.node_ip for n in live or () if n.node_id == self.here_id and n.node_ip]
        return [
            locate(
                t.node_id,
                t.node_ip,
                t.hostname,
                here_id=self.here_id,
                here_ips=ips,
                here_hostname=self.hostname,
                live=live,
            )
            for t in traces
        ]

    async def place(self, trace: Any) -> Placement:
        return (await self.place_all([trace]))[0]


def default_runner() -> NodeRunner:
    """Ray tasks when this process is part of a Ray cluster, else threads."""
    return RayNodeRunner() if ray_up() else LocalRunner()
