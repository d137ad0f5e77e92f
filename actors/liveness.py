"""Noticing dead workers before their heartbeat runs out.

An agent whose process died without ``close()`` (killed, crashed, OOM-killed) falls silent;
the heartbeat timeout (30 s) would keep it a target that long. The coordinator asks instead,
every few seconds, what the machines know: Ray's list of live nodes (an agent on a node that
left the cluster is gone), and on each node that hosts agents, whether each agent's process
still exists — the same pid *and* the same start time, so a reused pid is not mistaken for
the worker. Only agents that reported their process's start time are checked (real agents
do; simulated ones in benchmarks and tests do not).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from profd.core.ray_env import process_start

__all__ = ["Gone", "Periodic", "ProcessProbe", "exited", "find_gone"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessProbe:
    """One agent's process as its node should still have it."""

    agent_id: str
    pid: int
    start: int


def exited(probes: Iterable[ProcessProbe]) -> list[str]:
    """On the node: the agents whose process is gone (or is another process now)."""
    if not Path("/proc/self/stat").exists():
        return []  # cannot tell here
    return [p.agent_id for p in probes if process_start(p.pid) != p.start]


@dataclass(frozen=True)
class Gone:
    agent_id: str
    reason: str


async def find_gone(agents: Iterable[Any], runner: Any, timeout_s: float = 10.0) -> list[Gone]:
    """Which of ``agents`` (registry records) are known dead: their node left the cluster, or
    their process exited. Nodes are asked at once; a node that does not answer in
    ``timeout_s`` says nothing (the heartbeat timeout still applies)."""
    by_node: dict[str | None, list[Any]] = {}
    for rec in agents:
        if rec.info.pid_start is not None:
            by_node.setdefault(rec.info.node_id, []).append(rec)
    if not by_node:
        return []
    live = await _live_node_ids(runner)
    if live is not None and any(n is not None and n not in live for n in by_node):
        live = await _live_node_ids(runner, max_age_s=0)  # a node that just joined is no loss
    gone: list[Gone] = []
    asked = []
    for node_id, recs in by_node.items():
        if node_id is not None and live is not None and node_id not in live:
            why = f"its node {node_id[:12]} left the Ray cluster"
            gone += [Gone(r.info.agent_id, why) for r in recs]
        else:
            asked.append((node_id, recs))
    answers = await asyncio.gather(
        *(_ask(runner, node_id, recs, timeout_s) for node_id, recs in asked)
    )
    for (_, recs), dead in zip(asked, answers, strict=True):
        by_id = {r.info.agent_id: r for r in recs}
        for aid in dead:
            r = by_id[aid]
            gone.append(Gone(aid, f"its process (pid {r.info.pid} on {r.info.hostname}) exited"))
    return gone


async def _ask(runner: Any, node_id: str | None, recs: list[Any], timeout_s: float) -> list[str]:
    probes = [ProcessProbe(r.info.agent_id, r.info.pid, r.info.pid_start) for r in recs]
    ask = getattr(runner, "exited", None)  # without a Ray task, where the runner can
    call = ask(node_id, probes) if ask is not None else runner.run(node_id, exited, probes)
    try:
        return await asyncio.wait_for(call, timeout_s)
    except Exception as exc:  # the node is busy or going away: ask again next time
        log.debug("liveness check on node %s failed: %r", node_id, exc)
        return []


async def _live_node_ids(runner: Any, max_age_s: float | None = None) -> set[str] | None:
    nodes = getattr(runner, "nodes", None)
    if nodes is None:
        return None
    try:
        found = await (nodes() if max_age_s is None else nodes(max_age_s=max_age_s))
    except Exception as exc:  # unknown: no agent is declared gone on this pass
        log.warning("liveness: could not list Ray's nodes: %r", exc)
        return None
    return None if found is None else {n.node_id for n in found}


class Periodic:
    """Runs ``job`` (a coroutine function) at most every ``every_s`` and never twice at once;
    the coordinator's tick kicks it. ``every_s`` 0 turns it off. A failed run is logged."""

    def __init__(
        self, every_s: float, job: Callable[[], Awaitable[None]], clock: Callable[[], float]
    ) -> None:
        self.every_s = every_s
        self._job = job
        self._last = clock()
        self._task: asyncio.Task | None = None

    def kick(self, now: float) -> None:
        if self.every_s <= 0 or now - self._last < self.every_s:
            return
        if self._task is not None and not self._task.done():
            return
        self._last = now
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            await self._job()
        except Exception:
            log.exception("periodic %s failed", getattr(self._job, "__name__", "job"))
