"""Step and stage durations, measured on the training thread and shipped from the reporter.

Every step and stage mark records its duration: one monotonic clock read when the mark is
entered and one when it is left, the difference written into a preallocated slot of a ring
(a list of :data:`RING` floats) by index. Nothing else happens on the training thread: no
RPC, no lock, no list growing. The agent's reporter thread (:mod:`profd.agent.channel`)
drains the rings about once a second into a :class:`~profd.core.protocol.MarkDurations`
event that rides the agent's ordinary event reports.

One ring per label (the step, and each stage label), single producer (the training thread)
and single consumer (the reporter): the producer writes the slot, then moves ``head``; the
consumer reads up to the ``head`` it saw and, because the producer may lap it meanwhile,
keeps only the slots that ``head`` had not come back to when it finished reading. A ring
that fills (a stalled reporter, no coordinator, marks faster than ``RING`` per report)
overwrites its oldest samples; the next report counts them as ``lost``.

Each sample also keeps when it ended (the clock read the duration was taken from, stored
in a second preallocated ring), and the step mark keeps its step number: the reporter
places each stage sample in the step it ended in and ships ``(step, start, end)`` on the
coordinator's wall clock (``LabelDurations.spans``), so straggler triggers can compare one
step's stage ends across ranks. A stage is placed once its step is over (SPMD). A worker
that marks no step (it follows its driver's steps) ships its samples unplaced (step
``None``): the coordinator, which hears every step the driver announces, places them in the
step that began last before each sample did (the agent hears of the driver's steps only
while a session needs them).

An exception leaving a mark is offered to ``on_error`` (the agent's out-of-memory check):
one ``is not None`` test when there is none.

Known limits, for the price of one attribute store per enter: a label nested inside itself,
or marked from two threads at once, measures from the latest enter. Stage labels beyond
:data:`MAX_LABELS` are not timed (logged once).
"""

from __future__ import annotations

import logging
import math
import operator
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from profd.core.protocol import LabelDurations, MarkDurations

__all__ = [
    "ENTER_NOTHING",
    "MASK",
    "MAX_LABELS",
    "MAX_LOOKUPS",
    "NO_SPANS",
    "RING",
    "STEP_LABEL",
    "UNTIMED",
    "SpanStageTimer",
    "StageTimer",
    "TimedRange",
    "Timings",
    "drain",
    "mark_clock",
]

log = logging.getLogger(__name__)

#: Slots per label (a power of two: the slot of sample ``i`` is ``i & (RING - 1)``).
RING = 256
MASK = RING - 1
#: Stage labels timed per agent; the ones beyond are not timed.
MAX_LABELS = 32
#: Names (stage name, role) looked up in one lookup, timed or not; beyond, a first-mark
#: path each time (stage names made up per call, ``f"layer{i}"``, never grow memory).
MAX_LOOKUPS = 1024
#: The label of the step's durations (carried apart from stages, so no stage collides).
STEP_LABEL = "step"

#: The clock of every mark boundary (monotonic; a module global: the cheapest lookup).
mark_clock = time.perf_counter


#: The timers' ``__enter__``: ``NoneType()`` returns ``None`` without a Python frame (a
#: staticmethod, so ``with`` calls it with no argument). The mark's own function
#: (``agent.stage`` / ``agent.step``) has read the clock: a frame less per mark.
ENTER_NOTHING = staticmethod(type(None))


def _ignore(exc: BaseException, label: str | None) -> None:
    """The default ``on_error``: nothing to tell."""


#: ``on_error(exc, label)``: an exception left a mark (``label`` None: the step mark).
OnError = Callable[[BaseException, "str | None"], None]


#: ``span_from`` of a timer that keeps no ends (no straggler trigger watches its role).
NO_SPANS = 1 << 62


class StageTimer:
    """Times one stage label: what an idle ``agent.stage(name)`` returns (one per label,
    reused by every call: no allocation). ``agent.stage`` sets :attr:`t0`. While a straggler
    trigger watches the role it is a :class:`SpanStageTimer` (same slots; the poller swaps
    the class, :meth:`Timings.set_spans`), which also keeps when each sample ended."""

    __slots__ = ("ends", "head", "label", "on_error", "ring", "span_from", "t0", "tail")

    __enter__ = ENTER_NOTHING

    def __init__(self, label: str, on_error: OnError = _ignore) -> None:
        self.label = label
        self.ring: list[float] = [0.0] * RING
        self.ends: list[float] = [0.0] * RING  # when each sample ended (span mode only)
        #: The first sample whose end was written (span mode since then).
        self.span_from = NO_SPANS
        self.head = 0  # samples written (training thread)
        self.tail = 0  # samples taken (reporter thread)
        self.t0 = 0.0
        self.on_error = on_error

    def __exit__(self, et: Any, ev: Any, tb: Any) -> bool:
        i = self.head
        self.ring[i & MASK] = mark_clock() - self.t0
        self.head = i + 1
        if et is not None:  # re-raised: the mark never swallows it
            self.on_error(ev, self.label)
        return False


class SpanStageTimer(StageTimer):
    __slots__ = ()

    def __exit__(self, et: Any, ev: Any, tb: Any) -> bool:
        t1 = mark_clock()
        i = self.head
        j = i & MASK
        self.ring[j] = t1 - self.t0
        self.ends[j] = t1
        self.head = i + 1
        if et is not None:  # re-raised: the mark never swallows it
            self.on_error(ev, self.label)
        return False


StageTimer.SPAN_CLASSES = (StageTimer, SpanStageTimer)  # type: ignore[attr-defined]


class _Untimed:
    """What a stage label gets that is not timed (beyond :data:`MAX_LABELS`, or after a
    fault): a shared no-op the marks treat as a timer (it takes ``t0``, keeps nothing)."""

    __slots__ = ("t0",)

    __enter__ = ENTER_NOTHING

    def __exit__(self, et: Any, ev: Any, tb: Any) -> bool:
        return False


UNTIMED = _Untimed()


class TimedRange:
    """A stage while a window records: the profiler's range, timed as well (this path
    allocates anyway)."""

    __slots__ = ("_cm", "_timer")

    def __init__(self, timer: StageTimer, cm: AbstractContextManager[Any]) -> None:
        self._timer = timer
        self._cm = cm

    def __enter__(self) -> Any:
        self._timer.t0 = mark_clock()
        return self._cm.__enter__()

    def __exit__(self, et: Any, ev: Any, tb: Any) -> bool:
        if et is not None:  # before the range closes: a torch_memory collection is still open
            self._timer.on_error(ev, self._timer.label)
        try:
            return bool(self._cm.__exit__(et, ev, tb))
        finally:
            self._timer.__exit__(None, None, None)


def _take(timer: Any, *rings: str) -> tuple[int, int, list[list[Any]]] | None:
    """Reporter thread: (lost, index of the first sample, one list per ring named) of
    ``timer``'s samples since the last take, or ``None`` when there are none."""
    head = timer.head
    tail = timer.tail
    if head == tail:
        return None
    start = max(tail, head - RING)
    cols = []
    for name in rings:
        ring = getattr(timer, name)
        cols.append([ring[j & MASK] for j in range(start, head)])
    # the training thread may have lapped the slots read first: keep the ones it had not
    valid = max(start, timer.head - RING)
    timer.tail = head
    return valid - tail, valid, [c[valid - start :] for c in cols]


def drain(timer: Any) -> LabelDurations | None:
    """Reporter thread: the samples of ``timer`` (a :class:`StageTimer` or the step mark)
    since the last drain, or ``None`` when there are none."""
    got = _take(timer, "ring")
    if got is None:
        return None
    lost, _, (seconds,) = got
    return LabelDurations(timer.label, tuple(seconds), lost=lost)


#: What a slot's end holds until a span-keeping exit writes it.
_UNSET = [math.nan] * RING


def _span(timer: Any, on: bool) -> None:
    """Swap ``timer`` (a stage timer or the timed step mark: classes naming their
    ``SPAN_CLASSES``, plain and span-keeping) to the one or the other. Turning it on, every
    end is first unset (NaN): a sample whose exit was under way under the old class keeps
    that, and is never taken for one with an end."""
    classes = getattr(type(timer), "SPAN_CLASSES", None)
    if classes is None:  # the untimed step mark: nothing to keep
        return
    if on:
        timer.ends[:] = _UNSET  # the same list: the training thread holds it
    timer.__class__ = classes[1] if on else classes[0]
    timer.span_from = timer.head if on else NO_SPANS


def _step_number(step: Any) -> int | None:
    """A step as an int (numpy's ints too), or None for one that is not a number."""
    if isinstance(step, bool):
        return None
    try:
        return operator.index(step)
    except TypeError:
        return None


def _spanned(timer: Any, first: int, samples: Iterable[Any]) -> Iterator[Any]:
    """The samples (from index ``first``; each with its end second) whose end was written:
    from ``span_from`` on, ends set."""
    skip = timer.span_from - first
    for k, sample in enumerate(samples):
        if k >= skip and sample[1] == sample[1]:  # NaN: not written
            yield sample


#: Step intervals the reporter keeps to place stage samples.
KEPT_STEPS = 2 * RING


class Timings:
    """The stage timers of one agent, and what its reporter takes from them (each stage
    sample placed in its step, see the module docstring)."""

    def __init__(self, enabled: bool = True, on_error: OnError = _ignore) -> None:
        self.enabled = enabled
        self.on_error = on_error
        #: label -> timer, for ``stage(name)`` without a role (the training thread's lookup)
        self.plain: dict[str, StageTimer | _Untimed] = {}
        #: role -> name -> timer, for ``stage(name, role=...)``
        self.by_role: dict[str, dict[str, StageTimer | _Untimed]] = {}
        self._timers: list[StageTimer] = []
        self._by_label: dict[str, StageTimer | _Untimed] = {}
        self._lookups = 0
        self._warned = False
        #: Whether the marks keep their ends (:meth:`set_spans`).
        self.spans = False
        self._spans_changed = False
        # reporter thread only: what places stage samples in steps
        self._intervals: list[tuple[float, float, int]] = []  # (end, start, step), by end
        self._pending: dict[str, list[tuple[float, float]]] = {}  # label -> (start, end)

    def timer(self, name: str, role: str | None, label: str) -> StageTimer | _Untimed:
        """Training thread, first mark of a (name, role): its timer, kept for the next
        marks; :data:`UNTIMED` once the labels are used up (kept too, up to
        :data:`MAX_LOOKUPS` names, so an untimed mark stays one lookup)."""
        timer = self._by_label.get(label)
        if timer is None:
            if len(self._timers) >= MAX_LABELS:
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "profd: more than %d stage labels; %r and later ones are not timed",
                        MAX_LABELS,
                        label,
                    )
                timer = UNTIMED
            else:
                timer = StageTimer(label, self.on_error)
                # listed before the mode is read: a set_spans meanwhile swaps it, or this does
                self._timers.append(timer)  # one append per label, ever (bounded)
                if self.spans:
                    _span(timer, True)
            if self._lookups < MAX_LOOKUPS:
                self._by_label[label] = timer
        if self._lookups < MAX_LOOKUPS:
            self._lookups += 1
            if role is None:
                self.plain[name] = timer
            else:
                self.by_role.setdefault(role, {})[name] = timer
        return timer

    def set_spans(self, on: bool, step_mark: Any) -> None:
        """Poller thread: keep stage ends (and the step mark's ends and numbers) from now on,
        or stop: a straggler trigger watches the agent's role. Idle marks without one write
        the duration only."""
        if on == self.spans:
            return
        self.spans = on
        for timer in [*self._timers, step_mark]:
            _span(timer, on)
        self._spans_changed = True  # the reporter drops what it holds to place (its lists)

    def relabel(self) -> None:
        """The agent's roles changed (labels get role prefixes): look labels up again."""
        self.plain = {}
        self.by_role = {}
        self._by_label = {label: t for label, t in self._by_label.items() if t is not UNTIMED}
        self._lookups = 0

    def take(self, step_mark: Any, wall_base: float | None = None) -> MarkDurations | None:
        """Reporter thread: everything measured since the last call, or ``None``.
        ``wall_base``: add it to a :data:`mark_clock` reading to get the coordinator's wall
        clock (None while the offset is unknown: stage samples wait to be placed)."""
        if self._spans_changed:  # span mode turned on or off since the last take
            self._spans_changed = False
            if not self.spans:
                self._pending.clear()
                self._intervals.clear()
        # the step mark first: a stage sample read after it either ended in a step it shows
        # over, or waits for its step (never a step judged without its last calls)
        step = None
        got_step = _take(step_mark, "ring", "ends", "steps") if self.enabled else None
        raw = [(t, got) for t in list(self._timers) if (got := _take(t, "ring", "ends"))]
        if (got := got_step) is not None:
            lost, first, (seconds, ends, numbers) = got
            step = LabelDurations(step_mark.label, tuple(seconds), lost=lost)
            for d, end, n in _spanned(step_mark, first, zip(seconds, ends, numbers, strict=True)):
                if (number := _step_number(n)) is not None:
                    self._intervals.append((end, end - d, number))
            del self._intervals[:-KEPT_STEPS]
        marks_steps = bool(self._intervals) or getattr(step_mark, "t0", 0.0) != 0.0
        stages = []
        for timer, (lost, first, (seconds, ends)) in raw:
            label = timer.label
            waiting = self._pending.setdefault(label, [])
            waiting.extend(
                (end - d, end) for d, end in _spanned(timer, first, zip(seconds, ends, strict=True))
            )
            spans = self._place(label, marks_steps, wall_base)
            stages.append(LabelDurations(label, tuple(seconds), lost=lost, spans=spans))
        for label in self._pending.keys() - {t.label for t, _ in raw}:  # older ones
            if (spans := self._place(label, marks_steps, wall_base)) and wall_base is not None:
                stages.append(LabelDurations(label, (), spans=spans))
        if step is None and not stages:
            return None
        return MarkDurations(step=step, stages=tuple(stages))

    def _place(
        self, label: str, marks_steps: bool, wall_base: float | None
    ) -> tuple[tuple[int | None, float, float], ...]:
        """The waiting samples of ``label`` that can be placed in a step now, as spans; the
        others wait (their step is not over yet) or, outside every step, go. Without step
        marks (a worker following its driver) every sample goes unplaced, step ``None``."""
        waiting = self._pending.get(label)
        if not waiting or wall_base is None:
            if waiting:
                del waiting[:-RING]
            return ()
        out, keep = [], []
        if marks_steps:  # SPMD: the step whose interval holds the end, once it is over
            ends = self._intervals
            newest = ends[-1][0] if ends else None
            for start, end in waiting:
                if newest is None or end > newest:
                    keep.append((start, end))
                    continue
                i = bisect_left(ends, (end, float("-inf"), 0))
                if i < len(ends) and ends[i][1] <= end:
                    out.append((ends[i][2], start + wall_base, end + wall_base))
        else:  # following a driver: the coordinator knows when each of its steps began
            out = [(None, start + wall_base, end + wall_base) for start, end in waiting]
        self._pending[label] = keep[-RING:]
        return tuple(out)
