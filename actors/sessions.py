"""Sessions as explicit state machines (pure logic; the coordinator drives them).

A session moves ``pending → armed → recording → collecting`` and ends in exactly one terminal
state (``done``, ``partial``, ``failed``, ``cancelled``, ``expired``). Every target agent has a
*part* with its own state. Agent events update parts (:meth:`Session.apply`); one transition
function (:meth:`Session.advance`) derives the session state from the parts and the clock, so
the state is never spread across flags.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from profd.core.protocol import (
    AgentEvent,
    EventKind,
    Ignored,
    PartDone,
    PhaseDone,
    StepsMissed,
    TraceWritten,
)
from profd.core.request import SessionRequest
from profd.core.schedule import group_steps
from profd.core.settings import CoordinatorSettings
from profd.core.states import HookState, PartState, SessionState, UploadState

__all__ = ["HookRecord", "Part", "Session", "UploadRecord", "new_session_id", "session_dir"]


def new_session_id(now: float, taken: Iterable[str]) -> str:
    taken = set(taken)
    while True:
        sid = time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + "-" + secrets.token_hex(2)
        if sid not in taken:
            return sid


def session_dir(req: SessionRequest, settings: CoordinatorSettings, session_id: str) -> str:
    root = Path(req.save_path) if req.save_path else Path(settings.save_root)
    if not root.is_absolute():
        root = Path(settings.base_dir) / root
    return str(root / session_id)


@dataclass(frozen=True, slots=True)
class UploadRecord:
    """One trace's copy to ``upload_uri``; persisted, so a restarted coordinator resumes it."""

    path: str
    bytes: int
    node_id: str | None
    node_ip: str | None = None
    hostname: str | None = None
    state: UploadState = UploadState.PENDING
    dest: str = ""
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "state": self.state.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> UploadRecord:
        return cls(**{**d, "state": UploadState(d["state"])})


@dataclass(frozen=True, slots=True)
class HookRecord:
    """One finish-hook run, on the node of one hook agent."""

    agent_id: str
    role: str
    rank: int
    node: str
    state: HookState = HookState.PENDING
    exit_code: int | None = None
    output: str = ""
    duration_s: float | None = None
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "state": self.state.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HookRecord:
        return cls(**{**d, "state": HookState(d["state"])})


@dataclass
class Part:
    """One target agent's share of a session."""

    agent_id: str
    role: str
    rank: int
    role_block: str
    state: PartState = PartState.PENDING
    reason: str = ""
    recorded: set[int] = field(default_factory=set)
    missed: set[int] = field(default_factory=set)
    traces: list[str] = field(default_factory=list)
    #: Backend / export failures.
    errors: list[str] = field(default_factory=list)
    #: Why steps were missed (plan arrived late, job ended, ...).
    notes: list[str] = field(default_factory=list)
    #: When the agent installed the plan (its clock), from its ``armed`` event.
    armed_at: float | None = None
    #: Rollout replicas: global ranks whose files come up (``None`` = all).
    keep_global_ranks: list[int] | None = None
    #: The last controller phase a rollout agent confirmed, as ``[step, phase]``.
    last_phase: list[Any] | None = None
    #: It ended by the agent's own word (its ``part_done``, or its end): the agent knows,
    #: so the window leaving its plan need not wake it, and ``profd cancel`` need not wait
    #: for it (persisted when set, so a restart does not make it wait again).
    ended_by_agent: bool = field(default=False, compare=False)

    def finish(self, state: PartState, reason: str = "") -> None:
        if not self.state.is_terminal:
            self.state = state
            self.reason = reason

    def to_dict(self) -> dict[str, Any]:
        # Written out by hand: dataclasses.asdict deep-copies and is 5x slower at 10k parts.
        return {
            "agent_id": self.agent_id,
            "role": self.role,
            "rank": self.rank,
            "role_block": self.role_block,
            "state": self.state.value,
            "reason": self.reason,
            "recorded": sorted(self.recorded),
            "missed": sorted(self.missed),
            "traces": list(self.traces),
            "errors": list(self.errors),
            "notes": list(self.notes),
            "armed_at": self.armed_at,
            "keep_global_ranks": self.keep_global_ranks,
            "last_phase": self.last_phase,
            **({"ended_by_agent": True} if self.ended_by_agent else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Part:
        d = dict(d)
        d["state"] = PartState(d["state"])
        d["recorded"], d["missed"] = set(d["recorded"]), set(d["missed"])
        return cls(**d)


def _part_state(part: Part) -> PartState:
    return part.__dict__["_state"]


def _set_part_state(part: Part, value: PartState) -> None:
    # Its session counts its parts by state (``Session.advance`` asks the counts, not 10,000
    # parts, after every report): every change of ``state`` moves the count.
    d = part.__dict__
    tally, old = d.get("_tally"), d.get("_state")
    if tally is not None and old is not value:
        tally[old] -= 1
        tally[value] += 1
    d["_state"] = value


# A property set on the class after the dataclass is built (its __init__ keeps the field and
# its default): only ``state`` goes through a function, where a __setattr__ override made
# every field of every part do so (10,000 new parts: 79 -> 31 ms).
Part.state = property(_part_state, _set_part_state)  # type: ignore[assignment]


@dataclass
class Session:
    session_id: str
    request: SessionRequest
    save_dir: str
    created_at: float
    targets: dict[str, Part]
    ignored: list[Ignored]
    #: Absolute deadline (unix time) after which unfinished parts expire.
    deadline: float
    steps: tuple[int, ...] | None = None
    state: SessionState = SessionState.PENDING
    reason: str = "waiting for targets to report their step"
    finished_at: float | None = None
    cancel_reason: str | None = None
    #: Things the user should know that do not change the state (no device events, ...).
    warnings: list[str] = field(default_factory=list)
    #: Launch-time sessions adopt agents that register later, until recording starts.
    open_targeting: bool = False
    #: trace id -> its upload (records are frozen: a change replaces the record).
    uploads: dict[str, UploadRecord] = field(default_factory=dict)
    #: hook agent id -> its finish-hook run, in the order they were planned.
    hooks: dict[str, HookRecord] = field(default_factory=dict)
    hooks_planned: bool = False
    #: What started it when not a request: {"trigger_id": ..., "evidence": {...}}.
    origin: dict[str, Any] | None = None

    def finish_pending(self) -> bool:
        """Uploads or finish hooks still to run before the session may end."""
        if any(u.state is UploadState.PENDING for u in self.uploads.values()):
            return True
        if self.request.finish_hook_cmd is None:
            return False
        return not self.hooks_planned or any(not h.state.is_terminal for h in self.hooks.values())

    history: list[tuple[float, SessionState, str]] = field(default_factory=list)
    #: Parts changed since the coordinator last persisted them (not itself persisted).
    dirty_parts: set[str] = field(default_factory=set, repr=False, compare=False)
    #: Parts finished since the coordinator last took them to update their agents' plans
    #: (a fleet's parts end one report at a time: each pass looks at those, not all 10,000).
    closed_parts: set[str] = field(default_factory=set, repr=False, compare=False)
    #: Its end was published (its window left every target's plan); once, even when the
    #: pass that ended it failed later.
    end_published: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.dirty_parts.update(self.targets)
        self._request_dump: dict[str, Any] | None = None
        self._recount()

    def _recount(self) -> None:
        """Count the parts by state (each part keeps the count up to date as it changes)
        and note whether any recorded a step."""
        tally: Counter[PartState] = Counter()
        for p in self.targets.values():
            p.__dict__["_tally"] = tally
            tally[p.state] += 1
        self._tally = tally
        self._recorded_any = any(p.recorded for p in self.targets.values())

    def _request_json(self) -> dict[str, Any]:
        if self._request_dump is None:  # the request is frozen: dump it once
            self._request_dump = self.request.model_dump(mode="json")
        return self._request_dump

    def add_part(self, part: Part) -> None:
        old = self.targets.get(part.agent_id)
        if old is not None:  # replaced: no longer counted here
            self._tally[old.state] -= 1
            old.__dict__.pop("_tally", None)
        self.targets[part.agent_id] = part
        part.__dict__["_tally"] = self._tally
        self._tally[part.state] += 1
        self._recorded_any = self._recorded_any or bool(part.recorded)
        self.dirty_parts.add(part.agent_id)

    def take_dirty_parts(self) -> dict[str, dict[str, Any]]:
        """The parts changed since the last call, as dicts; persisting one event costs one
        part, not the whole session (10,000 targets)."""
        out = {aid: self.targets[aid].to_dict() for aid in self.dirty_parts if aid in self.targets}
        self.dirty_parts.clear()
        return out

    def to_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild the session after a coordinator restart."""
        d = self.header_dict()
        d["targets"] = {k: p.to_dict() for k, p in self.targets.items()}
        return d

    def header_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` without the parts (stored one row per part)."""
        return {
            "session_id": self.session_id,
            "request": self._request_json(),
            "save_dir": self.save_dir,
            "created_at": self.created_at,
            "ignored": [[i.role, i.rank, i.reason] for i in self.ignored],
            "deadline": self.deadline,
            "steps": list(self.steps) if self.steps is not None else None,
            "state": self.state.value,
            "reason": self.reason,
            "finished_at": self.finished_at,
            "cancel_reason": self.cancel_reason,
            "history": [[t, st.value, r] for t, st, r in self.history],
            "warnings": list(self.warnings),
            "open_targeting": self.open_targeting,
            "uploads": {k: u.to_dict() for k, u in self.uploads.items()},
            "hooks": [h.to_dict() for h in self.hooks.values()],
            "hooks_planned": self.hooks_planned,
            "origin": self.origin,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Session:
        s = cls(
            session_id=d["session_id"],
            request=SessionRequest.model_validate(d["request"]),
            save_dir=d["save_dir"],
            created_at=d["created_at"],
            targets={k: Part.from_dict(p) for k, p in d["targets"].items()},
            ignored=[Ignored(role, rank, reason) for role, rank, reason in d["ignored"]],
            deadline=d["deadline"],
        )
        s.steps = tuple(d["steps"]) if d["steps"] is not None else None
        s.state = SessionState(d["state"])
        s.reason, s.finished_at, s.cancel_reason = d["reason"], d["finished_at"], d["cancel_reason"]
        s.history = [(t, SessionState(st), r) for t, st, r in d["history"]]
        s.warnings = list(d["warnings"])
        s.open_targeting = d["open_targeting"]
        s.uploads = {k: UploadRecord.from_dict(u) for k, u in d.get("uploads", {}).items()}
        hooks = (HookRecord.from_dict(h) for h in d.get("hooks", []))
        s.hooks = {h.agent_id: h for h in hooks}
        s.hooks_planned = bool(d.get("hooks_planned", False))
        s.origin = d.get("origin")
        return s

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        if self.steps is None:
            return ()
        return group_steps(self.steps, self.request.profile_continuous_steps)

    @property
    def is_live(self) -> bool:
        return not self.state.is_terminal

    def resolve_steps(self, steps: tuple[int, ...]) -> None:
        """Fix the profiled steps (at creation for ``steps``; after alignment for next_steps)."""
        self.steps = tuple(sorted(set(steps)))

    # -- events -------------------------------------------------------------------------
    def apply(self, agent_id: str, event: AgentEvent) -> None:
        """Update the part of ``agent_id`` from one of its events."""
        part = self.targets.get(agent_id)
        if part is None:
            return
        if part.state.is_terminal:
            # a file written after the part ended (a cancel stops a window at the agent's
            # next mark; a timed window's engine flushes late) is still the part's: the
            # session's traces and its parts' never disagree
            if isinstance(event.payload, TraceWritten):
                self.dirty_parts.add(agent_id)
                self._on_trace(part, event.payload)
                part.missed -= set(event.payload.steps)  # written late, but written
                self._recorded_any = self._recorded_any or bool(part.recorded)
            elif isinstance(event.payload, PartDone) or event.kind is EventKind.CLOSED:
                # nothing more will come from it (what `profd cancel` waits for)
                part.ended_by_agent = True
                self.dirty_parts.add(agent_id)
            return
        self.dirty_parts.add(agent_id)
        match event.payload:
            case TraceWritten() as trace:
                self._on_trace(part, trace)
            case StepsMissed(steps=steps):
                part.missed.update(steps)
                part.notes.append(event.message)
            case PhaseDone(step=step, phase=phase):
                part.last_phase = [step, phase.value]
            case PartDone() as done:
                self._on_part_done(part, done)
            case None:
                self._on_progress(part, event)
        if part.recorded:  # (only a trace or part_done adds recorded steps)
            self._recorded_any = True

    def _on_progress(self, part: Part, event: AgentEvent) -> None:
        """The events without a payload: the part's progress, errors, the agent's end."""
        kind = event.kind
        if kind is EventKind.ARMED:
            if part.armed_at is None:
                part.armed_at = event.time
            if part.state is PartState.PENDING:
                part.state = PartState.ARMED
        elif kind is EventKind.RECORDING:
            part.state = PartState.RECORDING
        elif kind is EventKind.COLLECTING:
            part.state = PartState.COLLECTING
        elif kind is EventKind.ERROR:
            part.errors.append(event.message)
        elif kind is EventKind.CLOSED:
            # An agent that shut down before finishing its window cannot finish it later.
            part.ended_by_agent = True
            self._close_part(part, unresolved_reason="the job ended before these steps")

    def _on_trace(self, part: Part, trace: TraceWritten) -> None:
        if trace.warnings:
            name = trace.path.rsplit("/", 1)[-1]
            who = f"{part.role} rank {part.rank} {name}"
            self.warnings.extend(f"{who}: {w}" for w in trace.warnings)
        part.recorded.update(trace.steps)
        if trace.trace_id not in part.traces:
            part.traces.append(trace.trace_id)

    def _on_part_done(self, part: Part, done: PartDone) -> None:
        part.recorded.update(done.recorded)
        part.missed.update(done.missed)
        part.missed -= part.recorded
        who = f"{part.role} replica {done.replica if done.replica is not None else part.rank}"
        self.warnings.extend(f"{who}: {w}" for w in done.warnings)
        self.warnings.extend(f"{who}: incomplete {i.path}: {i.reason}" for i in done.incomplete)
        part.ended_by_agent = True
        self._close_part(part)

    def refuse(self, agent_id: str, event: AgentEvent, error: Exception) -> None:
        """An event of the agent that could not be applied: its part says so, and an event
        that ends the part (``part_done``, the agent closing) still ends it, else the part
        would wait for an end that already came until the session's deadline."""
        part = self.targets.get(agent_id)
        if part is None or part.state.is_terminal:
            return
        self.dirty_parts.add(agent_id)
        part.errors.append(
            f"profd could not apply the agent's {event.kind.value} event "
            f"({type(error).__name__}: {error})"
        )
        if isinstance(event.payload, PartDone) or event.kind is EventKind.CLOSED:
            part.ended_by_agent = True
            self._close_part(part, unresolved_reason="not accounted for by the agent's end")

    def _close_part(self, part: Part, unresolved_reason: str = "not reached") -> None:
        unresolved = set(self.steps or ()) - part.recorded - part.missed
        part.missed |= unresolved
        reasons = list(dict.fromkeys(m for m in part.errors + part.notes if m))
        if unresolved:
            reasons.append(f"{unresolved_reason} (steps {sorted(unresolved)})")
        reason = "; ".join(reasons)
        self.closed_parts.add(part.agent_id)
        if part.traces and not part.missed and not part.errors:
            part.finish(PartState.DONE)
        elif part.traces:
            part.finish(PartState.PARTIAL, reason)
        elif part.errors:
            part.finish(PartState.FAILED, reason)
        else:
            part.finish(PartState.MISSED, reason or "nothing was recorded")

    def mark_lost(self, agent_id: str, reason: str) -> None:
        part = self.targets.get(agent_id)
        if part is not None:
            part.finish(PartState.LOST, reason)
            self.dirty_parts.add(agent_id)
            self.closed_parts.add(agent_id)

    def cancel(self, reason: str) -> None:
        if self.is_live:
            self.cancel_reason = reason

    # -- transitions --------------------------------------------------------------------
    def advance(self, now: float) -> SessionState | None:
        """Take at most one transition; return the new state, or ``None`` if unchanged."""
        if self.state.is_terminal:
            return None
        parts = self.targets.values()
        tally = self._tally
        if self.cancel_reason is not None:
            for p in parts:
                p.finish(PartState.CANCELLED, self.cancel_reason)
            self.dirty_parts.update(self.targets)
            return self._to(SessionState.CANCELLED, self.cancel_reason, now)
        if now >= self.deadline:
            for p in parts:
                p.finish(PartState.EXPIRED, "session deadline passed")
            self.dirty_parts.update(self.targets)
            if any(p.traces for p in parts):
                return self._to(SessionState.PARTIAL, "deadline passed; some traces written", now)
            return self._to(
                SessionState.EXPIRED, "deadline passed before anything was recorded", now
            )
        if self.state is SessionState.PENDING:
            if self.steps is None:
                return None
            if self.request.duration_s is not None:
                return self._to(SessionState.ARMED, "starting a timed window", now)
            return self._to(SessionState.ARMED, f"waiting for step {self.steps[0]}", now)
        if not parts:  # only launch-time sessions exist without targets
            if self.state is SessionState.ARMED and "agents" not in self.reason:
                self.reason = "waiting for agents to register"
            return None
        # From the counts by state: O(states), not O(parts), on every pass.
        if sum(n for st, n in tally.items() if st.is_terminal) == len(self.targets):
            if self.finish_pending():
                if self.state is SessionState.COLLECTING:
                    return None
                return self._to(SessionState.COLLECTING, "uploading traces / running hooks", now)
            return self._finish(list(parts), now)
        waiting = tally[PartState.PENDING] + tally[PartState.ARMED]
        started = self._recorded_any or waiting < len(self.targets)
        if self.state is SessionState.ARMED and started:
            self.open_targeting = False  # the window began: late agents cannot join any more
            return self._to(SessionState.RECORDING, "recording", now)
        still_recording = waiting + tally[PartState.RECORDING] > 0
        if self.state is SessionState.RECORDING and not still_recording:
            return self._to(SessionState.COLLECTING, "writing trace files", now)
        return None

    def _finish(self, parts: list[Part], now: float) -> SessionState:
        failed = [u for u in self.uploads.values() if u.state is UploadState.FAILED]
        done = [p for p in parts if p.state is PartState.DONE]
        if failed:
            detail = "; ".join(f"upload of {u.path} failed: {u.error}" for u in failed)
            return self._to(SessionState.PARTIAL, detail, now)
        if len(done) == len(parts):
            n = sum(len(p.traces) for p in parts)
            return self._to(SessionState.DONE, f"{n} trace(s) from {len(parts)} target(s)", now)
        bad = [p for p in parts if p.state is not PartState.DONE]
        detail = "; ".join(f"{p.role} rank {p.rank}: {p.state.value} ({p.reason})" for p in bad)
        if any(p.traces for p in parts):
            return self._to(SessionState.PARTIAL, detail, now)
        return self._to(SessionState.FAILED, detail, now)

    def _to(self, state: SessionState, reason: str, now: float) -> SessionState:
        self.state = state
        self.reason = reason
        self.history.append((now, state, reason))
        if state.is_terminal:
            self.finished_at = now
        return state
