"""What a collection is called and what it carries inside (stem and trace metadata)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from profd.agent.clock_sync import ClockEstimate
from profd.backends.base import CollectionSpec
from profd.core.naming import trace_stem
from profd.core.protocol import AgentInfo, WindowPlan

__all__ = ["build_spec", "trace_metadata"]


def trace_metadata(
    info: AgentInfo,
    window: WindowPlan,
    scope: str,
    step: int | None,
    group: Sequence[int],
    clock: ClockEstimate | None = None,
) -> dict[str, Any]:
    """``distributedInfo`` (rank, world size: read by HTA) and profd's own keys, with this
    process's offset to the coordinator's clock when it was measured (``profd.clock``)."""
    from profd.core.constants import __version__

    dist: dict[str, Any] = {"rank": info.rank}
    if info.world_size:
        dist["world_size"] = info.world_size
    return {
        "distributedInfo": dist,
        "profd": {
            "version": __version__,
            "session_id": window.session_id,
            "agent_id": info.agent_id,
            "role": info.role,
            "rank": info.rank,
            "world_size": info.world_size,
            "topology": dict(info.topology),
            "scope": scope,
            "step": step,
            "group": list(group),
            "tool": window.tool,
            "hostname": info.hostname,
            "node_id": info.node_id,
            "pid": os.getpid(),
            "duration_s": window.duration_s,
            **({"clock": clock.metadata()} if clock is not None else {}),
        },
    }


def build_spec(
    info: AgentInfo,
    window: WindowPlan,
    scope: str,
    step: int | None,
    group: Sequence[int] = (),
    schedule: Mapping[str, int] | None = None,
    name_mini_batches: bool = False,
    clock: ClockEstimate | None = None,
) -> CollectionSpec:
    stem = trace_stem(
        prefix=info.role,
        scope=scope,
        step=step,
        rank=info.rank,
        world_size=info.world_size,
        topology=info.topology,
        pid=os.getpid(),
        when=datetime.now(),
    )
    return CollectionSpec(
        save_dir=Path(window.save_dir),
        stem=stem,
        metadata=trace_metadata(info, window, scope, step, group, clock),
        schedule=schedule,
        name_mini_batches=name_mini_batches,
        thread_id=info.thread_id,
    )
