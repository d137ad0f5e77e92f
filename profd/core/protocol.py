"""Messages between agents and the coordinator: small frozen dataclasses, cheap to pickle.

The agent never waits on these on the training thread: its background threads send
:class:`AgentInfo` and :class:`AgentEvent` and receive :class:`AgentPlan`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = [
    "EMPTY_PLAN",
    "AgentEvent",
    "AgentInfo",
    "AgentPlan",
    "EventKind",
    "PollReply",
    "WindowPlan",
]


@dataclass(frozen=True, slots=True)
class AgentInfo:
    """Who an agent is and what it can run. ``capabilities`` maps a tool to ``None`` when the
    tool can run in this process, else to the reason it cannot."""

    agent_id: str
    role: str
    rank: int
    world_size: int | None
    topology: dict[str, int]
    hostname: str
    pid: int
    node_id: str | None = None
    node_ip: str | None = None
    capabilities: dict[str, str | None] = field(default_factory=dict)
    #: Free-form descriptions (a rollout replica's engine kind, endpoint, trace directory).
    labels: dict[str, str] = field(default_factory=dict)
    #: When the process started (clock ticks since boot): the coordinator checks that this
    #: process still runs, so a dead worker stops being a target within seconds.
    pid_start: int | None = None
    #: The Ray job the process belongs to: its single-controller driver's steps are its steps
    #: (two jobs on one cluster each have their own driver).
    job_id: str | None = None


@dataclass(frozen=True, slots=True)
class WindowPlan:
    """One session's window as seen by one agent."""

    session_id: str
    tool: str
    steps: tuple[int, ...]
    #: Steps grouped into collections (one trace each in continuous mode).
    groups: tuple[tuple[int, ...], ...]
    discrete: bool
    #: The session tool's options for this agent's role, as plain data.
    tool_config: dict[str, Any]
    save_dir: str
    #: The request key that governed this agent (``actor`` for ``actor_rollout_ref``, ``*``).
    role_block: str
    #: Time-based window (no steps): record for this many seconds.
    duration_s: float | None = None
    #: Rollout replicas: the global GPU ranks whose engine files come up into the session
    #: directory (``None``: all of them).
    keep_global_ranks: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class AgentPlan:
    version: int
    windows: tuple[WindowPlan, ...] = ()
    #: The step a single-controller driver announced (``profd.controller().step(n)``);
    #: agents whose workers never call ``step()`` follow it.
    controller_step: int | None = None
    #: Where the driver is inside that step, for rollout agents: ``step_begin``,
    #: ``rollout_begin``, ``rollout_end`` or ``step_end``.
    controller_phase: str | None = None


EMPTY_PLAN = AgentPlan(version=0)


class EventKind(StrEnum):
    ARMED = "armed"  # the agent holds a plan containing the window
    RECORDING = "recording"  # a collection of the window started
    COLLECTING = "collecting"  # the window's recording is over, files are being written
    TRACE = "trace"  # a file was written (data: path, bytes, steps, scope)
    MISSED = "missed"  # steps that could not be recorded (message says why)
    ERROR = "error"  # a backend / export failure (message says what)
    PART_DONE = "part_done"  # every step of the window is resolved and every file written
    CLOSED = "closed"  # the agent shut down
    PHASE = "phase"  # a rollout agent handled a controller phase (data: step, phase)


@dataclass(frozen=True, slots=True)
class AgentEvent:
    kind: EventKind
    session_id: str | None = None
    step: int | None = None
    message: str = ""
    data: dict[str, Any] | None = None
    time: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class PollReply:
    """``plan`` is ``None`` when unchanged; ``known`` is False when the coordinator has no
    record of the agent (it restarted without state) and the agent must register again."""

    plan: AgentPlan | None
    known: bool = True
