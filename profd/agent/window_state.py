"""A window's state on one agent, shared by the recorder and the scopes that record it.

Kept apart from both so neither imports the other: the recorder creates scopes, and scopes
call back into the recorder only through :class:`ScopeHost`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from profd.backends.base import Collection
from profd.core.protocol import AgentPlan, WindowPlan

__all__ = ["IDLE", "ArmedPlan", "RecordingScope", "ScopeHost", "Ticket", "WindowState"]


class RecordingScope(Protocol):
    """What records a window's steps (:mod:`profd.agent.scopes`)."""

    def enter_step(self, step: int) -> None: ...


@dataclass(frozen=True, slots=True)
class ArmedPlan:
    """An installed plan, as the training thread sees it (swapped atomically, never mutated)."""

    plan: AgentPlan
    #: The agent's step when the plan arrived (explains missed steps).
    received_at_step: int | None = None

    @property
    def windows(self) -> tuple[WindowPlan, ...]:
        return self.plan.windows


IDLE = ArmedPlan(AgentPlan(version=0))


@dataclass
class WindowState:
    window: WindowPlan
    group_of: dict[int, tuple[int, ...]]
    received_at_step: int | None
    handled: set[int] = field(default_factory=set)  # no collection will take these any more
    recorded: set[int] = field(default_factory=set)  # a written file holds them
    missed: set[int] = field(default_factory=set)
    open_tickets: int = 0  # collections whose files are not all written yet
    scope: RecordingScope | None = None
    recording_sent: bool = False
    collecting_sent: bool = False
    done_sent: bool = False
    #: Timed windows: the window opened, ran and closed (or could not open at all).
    timed_done: bool = False

    @property
    def all_handled(self) -> bool:
        if self.window.duration_s is not None:
            return self.timed_done
        return self.handled >= set(self.window.steps)


@dataclass
class Ticket:
    """One collection's way through the exporter."""

    ws: WindowState
    label: str
    steps: list[int]
    pending: int = 0
    files: int = 0
    errors: list[str] = field(default_factory=list)
    closed: bool = False
    settled: bool = False
    #: Seconds the training thread spent stopping the collection (the export stall).
    stall_s: float = 0.0


class ScopeHost(Protocol):
    """The recorder, as the scopes see it."""

    def open_collection(
        self, ws: WindowState, label: str, step: int | None, update_loop: bool = False
    ) -> tuple[Collection, Ticket]: ...

    def submit(self, ticket: Ticket, outputs: list[Any]) -> None: ...

    def close_ticket(self, ticket: Ticket, collection: Collection) -> None: ...

    def close_timed(self, ws: WindowState) -> None: ...

    def fault(self, ws: WindowState, exc: BaseException) -> None: ...
