"""A window's state on one agent, shared by the recorder and the scopes that record it.

Kept apart from both so neither imports the other: the recorder creates scopes, and scopes
call back into the recorder only through :class:`ScopeHost`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from profd.backends.base import Collection
from profd.core.protocol import AgentPlan, WindowPlan

__all__ = [
    "ANY_STEP",
    "IDLE",
    "NO_STEP",
    "ArmedPlan",
    "FinishedIds",
    "RecordingScope",
    "ScopeHost",
    "Ticket",
    "WindowState",
]

#: :meth:`WindowState.wake_step` when no step mark has work for the window, and when every
#: one has. Ints beyond any planned step (at most 2**53 - 1): a mark compares its int step with
#: them, which is faster than with a float infinity.
NO_STEP = 1 << 62
ANY_STEP = -NO_STEP


#: Finished sessions an agent remembers (their windows may still be in the plan it holds).
KEPT_FINISHED = 1024


class FinishedIds:
    """The sessions whose windows an agent finished, so a plan that still lists one does not
    start it again; the newest ``keep`` (a job profiled every few minutes for weeks would
    otherwise keep every id). Callers serialise ``add``; ``in`` may race it."""

    def __init__(self, keep: int = KEPT_FINISHED) -> None:
        self._ids: dict[str, None] = {}
        self._keep = keep

    def add(self, session_id: str) -> None:
        self._ids[session_id] = None
        if len(self._ids) > self._keep:
            del self._ids[next(iter(self._ids))]

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)


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
    #: A collection of it could not be stopped: it ends only once the fault is told...
    stop_failed: bool = False
    #: ...that is, its error event is out (the coordinator drops one after the end).
    fault_told: bool = False
    #: Timed windows: the window opened, ran and closed (or could not open at all).
    timed_done: bool = False

    @property
    def all_handled(self) -> bool:
        if self.window.duration_s is not None:
            return self.timed_done
        return self.handled >= set(self.window.steps)

    def wake_step(self) -> int:
        """The first step whose mark has work for this window: its first unresolved step
        (a step mark past it reports it missed). :data:`ANY_STEP`: every mark (a timed window
        checks its deadline); :data:`NO_STEP`: none."""
        if self.window.duration_s is not None:
            return NO_STEP if self.timed_done else ANY_STEP
        return min((s for s in self.window.steps if s not in self.handled), default=NO_STEP)


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
    #: Steps the collection ended inside (a cancel, a timed window's deadline, a failure):
    #: their start is in its file, their end is not, so the file does not hold them whole.
    partial: set[int] = field(default_factory=set)
    #: A schedule saves its windows; ``stage_windows``: a discrete stage's, a few
    #: mini-batches each, so no file of it holds its step whole.
    scheduled: bool = False
    stage_windows: bool = False
    #: A timed window opened inside this step (its exit came before any step's entry): the
    #: file holds the rest of it (header ``profd.began_in_step``).
    began_in: int | None = None
    #: Seconds the training thread spent on this collection's export: stopping it, and at its
    #: start waiting for an earlier window's export (the export stall).
    stall_s: float = 0.0


class ScopeHost(Protocol):
    """The recorder, as the scopes see it."""

    def open_collection(
        self, ws: WindowState, label: str, step: int | None, update_loop: bool = False
    ) -> tuple[Collection, Ticket]: ...

    def submit(self, ticket: Ticket, outputs: list[Any], final: bool = False) -> None: ...

    def close_ticket(self, ticket: Ticket, collection: Collection) -> None: ...

    def close_timed(self, ws: WindowState) -> None: ...

    def fault(self, ws: WindowState, exc: BaseException) -> None: ...
