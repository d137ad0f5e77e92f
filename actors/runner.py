"""Where the coordinator runs work that belongs to a node: hooks, uploads, file reads.

:class:`RayNodeRunner` runs a plain function as a Ray task pinned to the node that holds the
files (no shared filesystem assumed). :class:`LocalRunner` runs it on a thread of this
process (a coordinator used in-process, on one machine).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["LocalRunner", "NodeRunner", "RayNodeRunner", "default_runner"]


class NodeRunner(Protocol):
    async def run(self, node_id: str | None, fn: Callable[..., Any], *args: Any) -> Any: ...


class LocalRunner:
    async def run(self, node_id: str | None, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)


class RayNodeRunner:
    def __init__(self) -> None:
        self._remote: dict[Callable[..., Any], Any] = {}

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


def default_runner() -> NodeRunner:
    """Ray tasks when this process is part of a Ray cluster, else threads."""
    try:
        import ray

        if ray.is_initialized():
            return RayNodeRunner()
    except Exception:
        pass
    return LocalRunner()
