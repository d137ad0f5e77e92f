"""Every state machine's states, and the driver's phases, as enums (values are the strings the
HTTP API and the state directory carry)."""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "AgentLink",
    "AgentState",
    "ControllerPhase",
    "HookState",
    "PartState",
    "SessionState",
    "UploadState",
]


class SessionState(StrEnum):
    PENDING = "pending"
    ARMED = "armed"
    RECORDING = "recording"
    COLLECTING = "collecting"
    DONE = "done"
    PARTIAL = "partial"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL_SESSION


_TERMINAL_SESSION = {
    SessionState.DONE,
    SessionState.PARTIAL,
    SessionState.FAILED,
    SessionState.CANCELLED,
    SessionState.EXPIRED,
}


class PartState(StrEnum):
    """One target agent's share of a session."""

    PENDING = "pending"  # plan not yet delivered
    ARMED = "armed"  # agent holds the plan, waiting for the first step
    RECORDING = "recording"
    COLLECTING = "collecting"  # recording over, files being written
    DONE = "done"  # every step recorded and written
    PARTIAL = "partial"  # some steps recorded, some missed
    MISSED = "missed"  # nothing could be recorded
    FAILED = "failed"  # a backend or export failure
    LOST = "lost"  # the agent vanished
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL_PART


_TERMINAL_PART = {
    PartState.DONE,
    PartState.PARTIAL,
    PartState.MISSED,
    PartState.FAILED,
    PartState.LOST,
    PartState.CANCELLED,
    PartState.EXPIRED,
}


class AgentState(StrEnum):
    ALIVE = "alive"
    LOST = "lost"  # its process is gone, or it went silent
    CLOSED = "closed"  # it shut down


class AgentLink(StrEnum):
    """How an agent's plans reach it: its own long-poll at the coordinator, its node's relay,
    or one poll shared by the agents of its process."""

    DIRECT = "direct"
    RELAY = "relay"
    SHARED = "shared"


class ControllerPhase(StrEnum):
    """Where a single-controller driver is inside its step (``profd.controller()``)."""

    STEP_BEGIN = "step_begin"
    ROLLOUT_BEGIN = "rollout_begin"
    ROLLOUT_END = "rollout_end"
    STEP_END = "step_end"


class UploadState(StrEnum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class HookState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    TIMED_OUT = "timed_out"

    @property
    def is_terminal(self) -> bool:
        return self not in (HookState.PENDING, HookState.RUNNING)
