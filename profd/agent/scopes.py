"""What stage / mini-batch marks talk to while a window is active (training thread).

A *scope* exists while a window records on an agent: :class:`ContinuousScope` holds one
collection for a group of steps (stages are ranges in it); :class:`DiscreteScope` opens a
collection per stage. Both route mini-batch marks to the collection's schedule. Every range
goes through :class:`SafeRange`, which never raises into user code and never swallows the
user's own exceptions.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Any

from profd.agent.window_state import ScopeHost, Ticket, WindowState
from profd.backends.base import NULL_RANGE, Collection
from profd.core.naming import CONTINUOUS_SCOPE, TIMED_SCOPE

__all__ = [
    "CONTINUOUS_SCOPE",
    "TIMED_SCOPE",
    "ContinuousScope",
    "DiscreteScope",
    "SafeRange",
    "Scope",
    "TimedScope",
]


def mark_partial(scope: Scope, ticket: Ticket | None) -> None:
    """The collection closing now ends inside the scope's step in progress, if any: its
    file does not hold that step whole."""
    if ticket is not None and (step := scope.step_in_progress()) is not None:
        ticket.partial.add(step)


class SafeRange:
    """A profiler range that never raises into user code and never swallows its exceptions."""

    __slots__ = ("_cm", "_on_exit", "_scope")

    def __init__(self, scope: Scope, cm: AbstractContextManager[Any], on_exit=None) -> None:
        self._scope = scope
        self._cm: AbstractContextManager[Any] | None = cm
        self._on_exit = on_exit

    def __enter__(self) -> None:
        try:
            self._cm.__enter__()  # type: ignore[union-attr]
        except Exception as exc:
            self._cm = None
            self._scope.fault(exc)

    def __exit__(self, *exc_info: Any) -> bool:
        try:
            if self._cm is not None:
                self._cm.__exit__(*exc_info)
            if self._on_exit is not None:
                self._on_exit()
        except Exception as exc:
            self._scope.fault(exc)
        return False


class Scope:
    """What stage / mini-batch marks talk to while a window is active on this agent."""

    def __init__(self, recorder: ScopeHost, ws: WindowState) -> None:
        self.recorder = recorder
        self.ws = ws
        self.in_update_loop = False
        #: The collection ranges go to (continuous: the group's; discrete: the stage's).
        self.current: Collection | None = None
        self.ticket: Ticket | None = None

    def fault(self, exc: BaseException) -> None:
        self.recorder.fault(self.ws, exc)

    def ranged(self, label: str, on_exit=None) -> AbstractContextManager[Any]:
        """A range in the current collection; a failure to create it ends the window."""
        if self.current is None:
            return NULL_RANGE
        try:
            cm = self.current.annotate(label)
        except Exception as exc:
            self.fault(exc)
            return NULL_RANGE
        return SafeRange(self, cm, on_exit)

    def stage(self, label: str, update_loop: bool) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def step_in_progress(self) -> int | None:
        """The step a close now would end inside (its file then does not hold it whole)."""
        return None

    def _after_mini_batch(self) -> None:
        if self.in_update_loop and self.current is not None and self.ticket is not None:
            self.current.step()
            self.recorder.submit(self.ticket, self.current.take_ready())

    def mini_batch(self, index: int) -> AbstractContextManager[Any]:
        return self.ranged(f"mini_batch{index}", self._after_mini_batch)

    def micro_batch(self, index: int) -> AbstractContextManager[Any]:
        return self.ranged(f"micro_batch{index}")


class ContinuousScope(Scope):
    """One collection for a group of consecutive steps; stages are ranges inside it."""

    def __init__(self, recorder: ScopeHost, ws: WindowState, group: tuple[int, ...]) -> None:
        super().__init__(recorder, ws)
        self.group = group
        self.done: list[int] = []
        self.current, self.ticket = recorder.open_collection(ws, CONTINUOUS_SCOPE, group[0])
        self._step_range: SafeRange | None = None
        self._in_step: int | None = None

    def enter_step(self, step: int) -> None:
        self.ticket.steps.append(step)  # type: ignore[union-attr]
        self._in_step = step
        rng = self.ranged(f"step{step}")
        rng.__enter__()
        self._step_range = rng if isinstance(rng, SafeRange) else None

    def exit_step(self, step: int) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        self._in_step = None
        self.done.append(step)

    def step_in_progress(self) -> int | None:
        return self._in_step

    def _end_update_loop(self) -> None:
        self.in_update_loop = False

    def stage(self, label: str, update_loop: bool) -> AbstractContextManager[Any]:
        if update_loop:
            self.in_update_loop = True
            return self.ranged(label, self._end_update_loop)
        return self.ranged(label)

    def close(self) -> None:
        if self._step_range is not None:  # closing mid-step (cancel, job end)
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        collection, ticket = self.current, self.ticket
        mark_partial(self, ticket)
        self._in_step = None
        self.current = None
        self.recorder.close_ticket(ticket, collection)  # type: ignore[arg-type]


class DiscreteStage:
    """A stage that opens its own collection (discrete mode); the stage is a range inside."""

    __slots__ = ("_label", "_range", "_scope", "_update_loop")

    def __init__(self, scope: DiscreteScope, label: str, update_loop: bool) -> None:
        self._scope = scope
        self._label = label
        self._update_loop = update_loop
        self._range: SafeRange | None = None

    def __enter__(self) -> None:
        scope = self._scope
        try:
            scope.current, scope.ticket = scope.recorder.open_collection(
                scope.ws, self._label, scope.step, update_loop=self._update_loop
            )
        except Exception as exc:
            scope.fault(exc)
            return
        scope.in_update_loop = self._update_loop
        rng = scope.ranged(self._label)
        rng.__enter__()
        self._range = rng if isinstance(rng, SafeRange) else None

    def __exit__(self, *exc_info: Any) -> bool:
        scope = self._scope
        if self._range is not None:
            self._range.__exit__(*exc_info)
        collection, ticket = scope.current, scope.ticket
        scope.current = scope.ticket = None
        scope.in_update_loop = False
        if collection is not None and ticket is not None:
            try:
                scope.recorder.close_ticket(ticket, collection)
                scope.stages += 1
            except Exception as exc:
                scope.fault(exc)
        return False


class DiscreteScope(Scope):
    """A profiled step in discrete mode: every stage inside it is its own collection."""

    def __init__(self, recorder: ScopeHost, ws: WindowState, step: int) -> None:
        super().__init__(recorder, ws)
        self.step = step
        self.stages = 0

    def stage(self, label: str, update_loop: bool) -> AbstractContextManager[Any]:
        if self.current is not None:  # nested stage: a range in the enclosing collection
            return self.ranged(label)
        return DiscreteStage(self, label, update_loop)

    def step_in_progress(self) -> int | None:
        return self.step if self.current is not None else None  # inside a stage's window


class TimedScope(ContinuousScope):
    """A timed window (``duration_s``) of a thread-bound backend: opened at a mark, closed at
    the first mark after its deadline. Steps seen meanwhile become ``step<n>`` ranges."""

    def __init__(
        self, recorder: ScopeHost, ws: WindowState, duration_s: float, in_step: Any = None
    ) -> None:
        """``in_step``: the step the loop marked last when the window opened at a mark that
        is not a step's; the window began inside it if its exit comes before any step's
        entry (:meth:`left`), else it had ended (a stage between steps)."""
        Scope.__init__(self, recorder, ws)
        self.group = ()
        self.done = []
        self.current, self.ticket = recorder.open_collection(ws, TIMED_SCOPE, None)
        # counted from when the profiler runs (the first start can take a second)
        self.deadline = time.monotonic() + duration_s
        self._step_range = None
        self._in_step = None
        self._maybe_in = in_step

    def enter_step(self, step: int) -> None:
        self._maybe_in = None  # a step begins: the one marked before had ended
        super().enter_step(step)

    def left(self, step: Any) -> None:
        """A step that began before the window ended: if it is the one the loop marked last
        at the window's start, the window began inside it (the file holds its rest)."""
        if self._maybe_in is not None and step == self._maybe_in:
            self.ticket.began_in = step  # type: ignore[union-attr]
        self._maybe_in = None

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def stage(self, label: str, update_loop: bool) -> AbstractContextManager[Any]:
        if self.expired():
            self.recorder.close_timed(self.ws)
            return NULL_RANGE
        return super().stage(label, update_loop)
