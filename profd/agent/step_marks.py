"""The step mark: what ``with agent.step(n):`` enters, one object per agent, reused.

:class:`TimedStepMark` (the default) also records each step's duration into its ring
(:mod:`profd.agent.timings`); :class:`StepMark` is the mark of an agent made with
``mark_times=False``. Both only call into the recorder when a step has work: a plan not
adopted yet, or a step some window waits for. Each holds its ``ProfilerAgent`` (typed
``Any`` here: this module is imported by ``profd.agent.agent``, never the other way).

While a straggler trigger watches, the timed mark also keeps, per sample, when the step
ended and its number (two more slots of preallocated rings: the reporter places stage
samples in their step with them); otherwise it writes the duration only. An
exception leaving either mark goes to the agent's ``_mark_error`` (its out-of-memory check)
and on into the loop: the mark never swallows it.
"""

from __future__ import annotations

from typing import Any

from profd.agent.timings import ENTER_NOTHING, MASK, NO_SPANS, RING, STEP_LABEL, mark_clock
from profd.agent.window_state import NO_STEP

__all__ = ["ADOPT", "StepMark", "TimedStepMark"]

#: A step mark's ``wake`` while the poller installed a plan the recorder has not adopted:
#: below every step, so the next step mark calls in and adopts it.
ADOPT = -(1 << 62)


class StepMark:
    """``with agent.step(n):`` — reused for every step (no allocation). Not timed: the mark
    of an agent made with ``mark_times=False``."""

    __slots__ = ("_agent", "wake", "wake_exit")  # the wake copies are unused here

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.wake = self.wake_exit = NO_STEP

    def __enter__(self) -> None:
        agent = self._agent
        step = agent._next_step
        agent._current_step = step
        agent._steps_marked = True
        armed = agent._armed
        recorder = agent._recorder
        # O(1) on every mark: a plan not adopted yet, or a step some window waits for
        try:
            due = armed is not recorder.seen or step >= recorder.wake_at
        except TypeError:  # a step that is not a number: nothing can be due at it
            due = False
        if due:
            agent._enter_step(step, armed)

    def __exit__(self, et: Any, ev: Any, tb: Any) -> bool:
        agent = self._agent
        step = agent._current_step
        if et is not None:  # before a window's stop: a torch_memory collection is still open
            agent._mark_error(ev, None)
        try:
            due = step >= agent._recorder.wake_at
        except TypeError:
            due = False
        if due:
            agent._exit_step(step)
        return False


class TimedStepMark:
    """``with agent.step(n):`` of an agent that times its marks (the default): each step's
    duration goes into this mark's ring (:mod:`profd.agent.timings`).

    ``agent.step(n)`` does the enter's work (window check, first clock read) and
    ``__enter__`` is a C no-op: a Python frame less per step, a tenth of an idle mark.
    While a straggler trigger watches the agent's role the mark is a :class:`SpanStepMark`
    (the poller swaps its class, see :meth:`Timings.set_spans`)."""

    __slots__ = (
        "_agent", "ends", "head", "label", "ring", "span_from", "steps", "t0", "tail", "wake",
        "wake_exit",
    )  # fmt: skip

    __enter__ = ENTER_NOTHING

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.label = STEP_LABEL
        self.ring: list[float] = [0.0] * RING
        self.ends: list[float] = [0.0] * RING  # when each step ended (span mode only)
        self.steps: list[Any] = [None] * RING  # which step it was (span mode only)
        #: The first sample whose end and step were written (span mode since then).
        self.span_from = NO_SPANS
        self.head = 0
        self.tail = 0
        self.t0 = 0.0  # 0.0 until the first step (perf_counter never reads 0)
        #: The first step at which entering (``wake``) or leaving (``wake_exit``) a step has
        #: work: the recorder's ``wake_at``, and ``ADOPT`` for a plan it has not adopted yet
        #: (ProfilerAgent._sync_wake): one comparison per boundary, as for an idle agent.
        self.wake = NO_STEP
        self.wake_exit = NO_STEP

    def __exit__(self, et: Any, ev: Any, tb: Any) -> bool:
        elapsed = mark_clock() - self.t0  # before a window's stop: not the step's own time
        i = self.head
        self.ring[i & MASK] = elapsed
        self.head = i + 1
        step = self._agent._current_step
        if et is not None:  # before a window's stop: a torch_memory collection is still open
            self._agent._mark_error(ev, None)
        try:
            due = step >= self.wake_exit
        except TypeError:
            due = False
        if due:
            self._agent._exit_step(step)
        return False


class SpanStepMark(TimedStepMark):
    """The step mark while a straggler trigger watches: it also keeps when each step ended
    and its number, so the reporter can place stage samples in their step."""

    __slots__ = ()

    def __exit__(self, et: Any, ev: Any, tb: Any) -> bool:
        t1 = mark_clock()  # before a window's stop: not the step's own time
        agent = self._agent
        step = agent._current_step
        i = self.head
        j = i & MASK
        self.ring[j] = t1 - self.t0
        self.ends[j] = t1
        self.steps[j] = step
        self.head = i + 1
        if et is not None:  # before a window's stop: a torch_memory collection is still open
            agent._mark_error(ev, None)
        try:
            due = step >= self.wake_exit
        except TypeError:
            due = False
        if due:
            agent._exit_step(step)
        return False


TimedStepMark.SPAN_CLASSES = (TimedStepMark, SpanStepMark)  # type: ignore[attr-defined]
