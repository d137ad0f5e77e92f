"""What a rollout agent registers and what its windows report (plain, frozen records).

:meth:`WindowOutcome.events` turns an outcome into the coordinator's agent events, so wiring a
rollout agent to the coordinator's event protocol needs no translation code. No Ray import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from profd.core.naming import trace_id_for
from profd.core.protocol import (
    AgentEvent,
    AgentInfo,
    EventKind,
    IncompleteFile,
    PartDone,
    ReplicaInfo,
    TraceWritten,
)
from profd.core.states import PartState
from profd.rollout.relocate import RelocatedFile
from profd.rollout.replicas import ROLLOUT_ROLE

__all__ = ["RolloutAgentInfo", "WindowMode", "WindowOutcome", "WindowStart"]


class WindowMode(StrEnum):
    """The session's mode for the role; both are profiled, it is only recorded."""

    CONTINUOUS = "continuous"
    DISCRETE = "discrete"


@dataclass(frozen=True, slots=True)
class RolloutAgentInfo:
    """What a rollout agent registers with the coordinator."""

    replica_index: int
    world_size: int
    parallelism: dict[str, int]
    #: Global GPU ranks ``[start, stop)`` owned by the replica.
    global_ranks: tuple[int, int]
    engine_kind: str
    engine_flavor: str
    endpoint: str
    trace_dir: str | None
    #: tool → ``None`` when the replica can run it, else the reason it cannot.
    capabilities: dict[str, str | None]
    role: str = ROLLOUT_ROLE

    def to_agent_info(
        self,
        agent_id: str,
        hostname: str,
        pid: int,
        node_id: str | None = None,
        node_ip: str | None = None,
        replicas: int | None = None,
        colocated: bool = False,
        collect_budget_s: int = 0,
    ) -> AgentInfo:
        """As the coordinator's :class:`AgentInfo`: rank = replica index, world size = the
        number of replicas (when known); the layout goes into ``topology``, the replica's size,
        rank range and timing into ``replica``."""
        replica = ReplicaInfo(
            world_size=self.world_size,
            global_rank_start=self.global_ranks[0],
            global_rank_stop=self.global_ranks[1],
            colocated=colocated,
            collect_budget_s=collect_budget_s,
        )
        return AgentInfo(
            agent_id=agent_id,
            role=self.role,
            rank=self.replica_index,
            world_size=replicas,
            topology=dict(self.parallelism),
            replica=replica,
            hostname=hostname,
            pid=pid,
            node_id=node_id,
            node_ip=node_ip,
            capabilities=dict(self.capabilities),
            labels={
                "engine_kind": self.engine_kind,
                "engine_flavor": self.engine_flavor,
                "endpoint": self.endpoint,
                **({"trace_dir": self.trace_dir} if self.trace_dir else {}),
            },
        )


@dataclass(frozen=True, slots=True)
class WindowStart:
    session_id: str
    replica_index: int
    ok: bool
    reason: str = ""
    #: Directory the engine writes this window's files to.
    trace_dir: str = ""
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class WindowOutcome:
    """One replica's share of a session, after its window."""

    session_id: str
    replica_index: int
    state: PartState
    reason: str
    mode: WindowMode
    #: Files brought up into the session directory (requested ranks, or unidentified ones).
    traces: tuple[RelocatedFile, ...] = ()
    #: tp peers, kept in ``<session>/rollout-replica<n>/``.
    kept_in_subdir: tuple[RelocatedFile, ...] = ()
    #: Files the engine had not finished writing when the wait ended; left where they are.
    incomplete: tuple[IncompleteFile, ...] = ()
    #: Files the engine wrote beside its traces (``*.profiler_out.txt``), kept in
    #: ``<session>/rollout-replica<n>/``; never indexed as traces.
    side_files: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    started_at: float | None = None
    finished_at: float | None = None

    def events(
        self, tool: str, steps: Sequence[int] = (), node_id: str | None = None
    ) -> list[AgentEvent]:
        """The outcome as coordinator events: one ``trace`` per surfaced file, an ``error``
        with the reason when partial, then ``part_done`` carrying peers, incomplete files and
        warnings."""
        first = steps[0] if steps else None
        out = [
            AgentEvent(
                EventKind.TRACE,
                self.session_id,
                first,
                payload=TraceWritten(
                    trace_id=trace_id_for(node_id, f.path),
                    path=f.path,
                    bytes=f.bytes,
                    steps=tuple(steps),
                    scope=ROLLOUT_ROLE,
                    tool=tool,
                    replica=f.replica,
                    global_rank=f.global_rank,
                ),
            )
            for f in self.traces
        ]
        if self.state is not PartState.DONE:
            out.append(AgentEvent(EventKind.ERROR, self.session_id, first, self.reason))
        summary = PartDone(
            replica=self.replica_index,
            kept_in_subdir=tuple(f.path for f in self.kept_in_subdir),
            incomplete=self.incomplete,
            warnings=self.warnings,
        )
        out.append(AgentEvent(EventKind.PART_DONE, self.session_id, first, payload=summary))
        return out
