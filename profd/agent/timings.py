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

Known limits, for the price of one attribute store per enter: a label nested inside itself,
or marked from two threads at once, measures from the latest enter. Stage labels beyond
:data:`MAX_LABELS` are not timed (logged once).
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from typing import Any

from profd.core.protocol import LabelDurations, MarkDurations

__all__ = [
    "ENTER_NOTHING",
    "MASK",
    "MAX_LABELS",
    "MAX_LOOKUPS",
    "RING",
    "STEP_LABEL",
    "UNTIMED",
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


class StageTimer:
    """Times one stage label: what an idle ``agent.stage(name)`` returns (one per label,
    reused by every call: no allocation). ``agent.stage`` sets :attr:`t0`."""

    __slots__ = ("head", "label", "ring", "t0", "tail")

    __enter__ = ENTER_NOTHING

    def __init__(self, label: str) -> None:
        self.label = label
        self.ring: list[float] = [0.0] * RING
        self.head = 0  # samples written (training thread)
        self.tail = 0  # samples taken (reporter thread)
        self.t0 = 0.0

    def __exit__(self, et: Any, ev: Any, tb: Any) -> bool:
        i = self.head
        self.ring[i & MASK] = mark_clock() - self.t0
        self.head = i + 1
        return False


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
        try:
            return bool(self._cm.__exit__(et, ev, tb))
        finally:
            self._timer.__exit__(None, None, None)


def drain(timer: Any) -> LabelDurations | None:
    """Reporter thread: the samples of ``timer`` (a :class:`StageTimer` or the step mark)
    since the last drain, or ``None`` when there are none."""
    head = timer.head
    tail = timer.tail
    if head == tail:
        return None
    start = max(tail, head - RING)
    ring = timer.ring
    seconds = [ring[j & MASK] for j in range(start, head)]
    # the training thread may have lapped the slots read first: keep the ones it had not
    valid = max(start, timer.head - RING)
    timer.tail = head
    return LabelDurations(timer.label, tuple(seconds[valid - start :]), lost=valid - tail)


class Timings:
    """The stage timers of one agent, and what its reporter takes from them."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        #: label -> timer, for ``stage(name)`` without a role (the training thread's lookup)
        self.plain: dict[str, StageTimer | _Untimed] = {}
        #: role -> name -> timer, for ``stage(name, role=...)``
        self.by_role: dict[str, dict[str, StageTimer | _Untimed]] = {}
        self._timers: list[StageTimer] = []
        self._by_label: dict[str, StageTimer | _Untimed] = {}
        self._lookups = 0
        self._warned = False

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
                timer = StageTimer(label)
                self._timers.append(timer)  # one append per label, ever (bounded)
            if self._lookups < MAX_LOOKUPS:
                self._by_label[label] = timer
        if self._lookups < MAX_LOOKUPS:
            self._lookups += 1
            if role is None:
                self.plain[name] = timer
            else:
                self.by_role.setdefault(role, {})[name] = timer
        return timer

    def relabel(self) -> None:
        """The agent's roles changed (labels get role prefixes): look labels up again."""
        self.plain = {}
        self.by_role = {}
        self._by_label = {label: t for label, t in self._by_label.items() if t is not UNTIMED}
        self._lookups = 0

    def take(self, step_mark: Any) -> MarkDurations | None:
        """Reporter thread: everything measured since the last call, or ``None``."""
        step = drain(step_mark) if self.enabled else None
        stages = tuple(d for t in list(self._timers) if (d := drain(t)) is not None)
        if step is None and not stages:
            return None
        return MarkDurations(step=step, stages=stages)
