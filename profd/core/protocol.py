"""Messages between agents and the coordinator: small frozen dataclasses, cheap to pickle.

The agent never waits on these on the training thread: its background threads send
:class:`AgentInfo` and :class:`AgentEvent` and receive :class:`AgentPlan`.
"""

from __future__ import annotations

import dataclasses
import operator
import pickle
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from profd.core.states import ControllerPhase

__all__ = [
    "EMPTY_PLAN",
    "AgentEvent",
    "AgentInfo",
    "AgentPlan",
    "DriverAck",
    "EventKind",
    "EventPayload",
    "Ignored",
    "IncompleteFile",
    "LabelDurations",
    "MarkDurations",
    "OutOfMemory",
    "Packed",
    "PartDone",
    "PhaseDone",
    "PollReply",
    "ReplicaInfo",
    "StackFrame",
    "StackSample",
    "StepsMissed",
    "TraceWritten",
    "WindowPlan",
    "fast_pickle",
]


_T = TypeVar("_T", bound=type)


class Packed:
    """A value that crosses a Ray call as one stdlib pickle and arrives as the value itself.

    Ray pickles a call's arguments with cloudpickle, whose Python hook runs for every object:
    a relay's batch of a node's events, or a push of its agents' plans, costs several times
    what the C pickler takes. Wrapped, cloudpickle sees one object holding bytes, and the
    receiver's unpickling calls :func:`pickle.loads` on them: it gets the plain value, so
    the callee's signature is unchanged (an older peer takes it as before)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return (pickle.loads, (pickle.dumps(self.value, protocol=pickle.HIGHEST_PROTOCOL),))


def fast_pickle(cls: _T) -> _T:
    """Pickle a frozen dataclass as its constructor and its fields' values (read in C):
    a slotted frozen dataclass's own state functions look its fields up in Python for every
    object, about 3x slower to pickle and 2x to unpickle; thousands of events and plans
    cross the relays each second. Every field must be an ``__init__`` argument."""
    fields = dataclasses.fields(cls)
    if not all(f.init for f in fields):
        raise TypeError(f"{cls.__name__}: every field must be an __init__ argument")
    get = operator.attrgetter(*(f.name for f in fields))
    if len(fields) == 1:
        cls.__reduce__ = lambda self: (cls, (get(self),))  # type: ignore[method-assign]
    else:
        cls.__reduce__ = lambda self: (cls, get(self))  # type: ignore[method-assign]
    return cls


@fast_pickle
@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """What a rollout replica's agent says about its replica (``None`` on training agents)."""

    #: GPUs of the replica (its tp × pp × dp ...).
    world_size: int
    #: The global GPU ranks it owns: ``range(global_rank_start, global_rank_stop)``.
    global_rank_start: int
    global_rank_stop: int
    #: It shares its GPUs with training: its windows close before training stages run.
    colocated: bool = False
    #: Seconds it may take after a window to hand in its files (engine stop, then flush).
    collect_budget_s: int = 0


@fast_pickle
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
    #: Set by rollout replicas' agents only.
    replica: ReplicaInfo | None = None
    #: The native id of the thread that attached (the training thread): ``profd stacks``
    #: picks it out of py-spy's dump of the process.
    thread_id: int | None = None


@fast_pickle
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


@fast_pickle
@dataclass(frozen=True, slots=True)
class AgentPlan:
    version: int
    windows: tuple[WindowPlan, ...] = ()
    #: The step a single-controller driver announced (``profd.controller().step(n)``);
    #: agents whose workers never call ``step()`` follow it.
    controller_step: int | None = None
    #: Where the driver is inside that step, for rollout agents.
    controller_phase: ControllerPhase | None = None
    #: The newest stack request (``GET /stacks``) the agent should answer; 0 when none.
    #: The agent's poller answers each number once with a ``stack`` event.
    stacks: int = 0
    #: A straggler trigger watches this agent's role: its marks keep when they ended (and
    #: the step mark its step), so stage ends can be compared across ranks. Off, an idle
    #: mark writes its duration only.
    spans: bool = False


EMPTY_PLAN = AgentPlan(version=0)


class EventKind(StrEnum):
    ARMED = "armed"  # the agent holds a plan containing the window
    RECORDING = "recording"  # a collection of the window started
    COLLECTING = "collecting"  # the window's recording is over, files are being written
    TRACE = "trace"  # a file was written (payload: TraceWritten)
    MISSED = "missed"  # steps that could not be recorded (payload: StepsMissed; message: why)
    ERROR = "error"  # a backend / export failure (message says what)
    PART_DONE = "part_done"  # every step resolved, every file written (payload: PartDone)
    CLOSED = "closed"  # the agent shut down
    PHASE = "phase"  # a rollout agent handled a controller phase (payload: PhaseDone)
    TIMES = "times"  # step and stage durations since the last one (payload: MarkDurations)
    STACK = "stack"  # the training thread's Python stack, answering a request (StackSample)
    OOM = "oom"  # a CUDA out-of-memory error raised through a mark (payload: OutOfMemory)


@fast_pickle
@dataclass(frozen=True, slots=True)
class TraceWritten:
    """One file an agent wrote for a session."""

    trace_id: str
    path: str
    bytes: int
    steps: tuple[int, ...]
    #: ``train`` (one trace per step or group), a stage label, or ``rollout``.
    scope: str
    tool: str
    warnings: tuple[str, ...] = ()
    #: Seconds the training thread spent stopping the collection (the export stall).
    stall_s: float = 0.0
    #: Rollout replicas: the replica and the global GPU rank the engine file came from.
    replica: int | None = None
    global_rank: int | None = None


@fast_pickle
@dataclass(frozen=True, slots=True)
class StepsMissed:
    """Steps that could not be recorded (empty for a timed window that never saw a mark)."""

    steps: tuple[int, ...] = ()


@fast_pickle
@dataclass(frozen=True, slots=True)
class IncompleteFile:
    """An engine file still being written when collection ended; left where it is."""

    path: str
    reason: str
    bytes: int = 0


@fast_pickle
@dataclass(frozen=True, slots=True)
class PartDone:
    """The agent's share of the window is over: what it recorded and what it missed."""

    recorded: tuple[int, ...] = ()
    missed: tuple[int, ...] = ()
    #: Rollout replicas: which replica, engine files kept in a subdirectory, files that
    #: were still incomplete when collection ended, and what else the user should know.
    replica: int | None = None
    kept_in_subdir: tuple[str, ...] = ()
    incomplete: tuple[IncompleteFile, ...] = ()
    warnings: tuple[str, ...] = ()


@fast_pickle
@dataclass(frozen=True, slots=True)
class PhaseDone:
    """A rollout agent handled the driver's phase ``phase`` of step ``step``."""

    step: int
    phase: ControllerPhase


@fast_pickle
@dataclass(frozen=True, slots=True)
class LabelDurations:
    """Durations of one mark (the step, or one stage label) measured since the agent's
    previous report, oldest first."""

    label: str
    seconds: tuple[float, ...]
    #: Samples the agent's ring overwrote before they could be sent (its reporter was
    #: stalled or disconnected, or marks came faster than the ring holds between reports).
    lost: int = 0
    #: ``(step, start, end)`` of stage samples placed in a step, seconds on the
    #: coordinator's wall clock (the agent's clock offset applied): straggler triggers
    #: compare one step's stage ends across a role's ranks. Placed once the step is over,
    #: so they may come a report after their durations; empty from older agents. Step
    #: ``None``: a worker that marks no step (it follows its driver); the coordinator
    #: places the sample by its driver's announced steps (``DriverTable.step_at``).
    spans: tuple[tuple[int | None, float, float], ...] = ()


@fast_pickle
@dataclass(frozen=True, slots=True)
class MarkDurations:
    """What an agent's marks measured since its previous report (``TIMES`` events). ``step``
    is ``None`` on workers that never mark a step (single-controller jobs)."""

    step: LabelDurations | None
    stages: tuple[LabelDurations, ...] = ()


@fast_pickle
@dataclass(frozen=True, slots=True)
class StackFrame:
    """One frame of a Python stack, innermost first in a :class:`StackSample`."""

    function: str
    file: str
    line: int


@fast_pickle
@dataclass(frozen=True, slots=True)
class StackSample:
    """An agent's answer to stack request ``request``: its training thread's frames, innermost
    first, read by the agent's own poller thread (``method`` ``"agent"``)."""

    request: int
    frames: tuple[StackFrame, ...]
    thread: str = ""
    method: str = "agent"
    error: str | None = None


@fast_pickle
@dataclass(frozen=True, slots=True)
class OutOfMemory:
    """A CUDA out-of-memory error that left a step or stage mark (``OOM`` events, one per
    error however many marks it crosses); the mark re-raises it, the job decides what
    happens next."""

    #: The error, as ``"<class name>: <message>"`` (the message cut at 2,000 characters).
    error: str
    #: The innermost stage mark it left (its label as traces name it); None: a step mark.
    stage: str | None = None
    #: A ``torch_memory`` snapshot written when it happened, if one was taken.
    snapshot_path: str | None = None


EventPayload = (
    TraceWritten | StepsMissed | PartDone | PhaseDone | MarkDurations | StackSample | OutOfMemory
)
#: The payload each kind carries; the kinds not listed carry none.
_PAYLOAD_OF: dict[EventKind, type] = {
    EventKind.TRACE: TraceWritten,
    EventKind.MISSED: StepsMissed,
    EventKind.PART_DONE: PartDone,
    EventKind.PHASE: PhaseDone,
    EventKind.TIMES: MarkDurations,
    EventKind.STACK: StackSample,
    EventKind.OOM: OutOfMemory,
}


@fast_pickle
@dataclass(frozen=True, slots=True)
class AgentEvent:
    kind: EventKind
    session_id: str | None = None
    step: int | None = None
    message: str = ""
    payload: EventPayload | None = None
    time: float = field(default_factory=time.time)
    #: The agent's number for the event (1, 2, ... in the order sent; 0: unnumbered). The
    #: coordinator applies a numbered event once, so events sent again after a report timed
    #: out (their first copy only late, not lost) are not counted twice.
    seq: int = 0

    def __post_init__(self) -> None:
        want = _PAYLOAD_OF.get(self.kind)
        if (want is None) != (self.payload is None) or (
            want is not None and not isinstance(self.payload, want)
        ):
            needs = want.__name__ if want is not None else "no payload"
            got = type(self.payload).__name__
            raise TypeError(f"a {self.kind.value} event carries {needs}, not {got}")


@fast_pickle
@dataclass(frozen=True, slots=True)
class DriverAck:
    """The coordinator's answer to a driver's step or phase: how many agents follow the job,
    which did not confirm in time, whether any is a rollout replica."""

    step: int
    agents: int = 0
    slow: tuple[str, ...] = ()
    rollout: bool = False
    phase: ControllerPhase | None = None


@fast_pickle
@dataclass(frozen=True, slots=True)
class PollReply:
    """``plan`` is ``None`` when unchanged; ``known`` is False when the coordinator has no
    record of the agent (it restarted without state) and the agent must register again."""

    plan: AgentPlan | None
    known: bool = True


@fast_pickle
@dataclass(frozen=True, slots=True)
class Ignored:
    """A requested target that was not used, with the reason."""

    role: str
    rank: int | None
    reason: str
    #: The request's dotted field the reason is about (named by a 422 when nothing matched).
    field: str = "roles"
