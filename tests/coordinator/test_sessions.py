"""The session state machine: transitions driven by agent events and the clock."""

from __future__ import annotations

from profd.actors.sessions import Part, Session
from profd.core.protocol import AgentEvent, EventKind, PartDone, StepsMissed, TraceWritten
from profd.core.request import SessionRequest
from profd.core.states import PartState, SessionState


def make(agents=("a", "b"), steps=(3, 4), deadline=1000.0) -> Session:
    s = Session(
        session_id="s1",
        request=SessionRequest.model_validate({"steps": list(steps)}),
        save_dir="/tmp/x/s1",
        created_at=0.0,
        targets={a: Part(a, "actor", i, "*") for i, a in enumerate(agents)},
        ignored=[],
        deadline=deadline,
    )
    return s


def ev(kind: EventKind, **kw) -> AgentEvent:
    return AgentEvent(kind, "s1", **kw)


def trace(trace_id: str, steps: list[int]) -> AgentEvent:
    written = TraceWritten(trace_id, "/p", 1, tuple(steps), "train", "torch")
    return ev(EventKind.TRACE, payload=written)


def run(s: Session, now: float = 1.0) -> list[SessionState]:
    seen = []
    while (st := s.advance(now)) is not None:
        seen.append(st)
    return seen


def test_happy_path_walks_every_state() -> None:
    s = make()
    assert s.state is SessionState.PENDING
    assert run(s) == []  # steps unknown yet
    s.resolve_steps((3, 4))
    assert run(s) == [SessionState.ARMED]
    for a in ("a", "b"):
        s.apply(a, ev(EventKind.ARMED))
    s.apply("a", ev(EventKind.RECORDING, step=3))
    assert run(s) == [SessionState.RECORDING]
    s.apply("b", ev(EventKind.RECORDING, step=3))
    for a in ("a", "b"):
        s.apply(a, ev(EventKind.COLLECTING))
    assert run(s) == [SessionState.COLLECTING]
    for a in ("a", "b"):
        s.apply(a, trace(f"t-{a}-3", [3]))
        s.apply(a, trace(f"t-{a}-4", [4]))
        s.apply(a, ev(EventKind.PART_DONE, payload=PartDone()))
    assert run(s) == [SessionState.DONE]
    assert s.finished_at == 1.0 and "4 trace(s) from 2 target(s)" in s.reason
    assert all(p.state is PartState.DONE for p in s.targets.values())
    assert run(s) == []  # terminal: nothing moves


def test_missed_step_makes_the_part_and_session_partial() -> None:
    s = make()
    s.resolve_steps((3, 4))
    s.apply("a", trace("t1", [3]))
    s.apply("a", trace("t2", [4]))
    s.apply("a", ev(EventKind.PART_DONE, payload=PartDone()))
    s.apply("b", ev(EventKind.MISSED, message="plan arrived late", payload=StepsMissed((3,))))
    s.apply("b", trace("t3", [4]))
    s.apply("b", ev(EventKind.PART_DONE, payload=PartDone()))
    run(s)
    assert s.state is SessionState.PARTIAL
    b = s.targets["b"]
    assert b.state is PartState.PARTIAL and b.missed == {3} and "plan arrived late" in b.reason
    assert "actor rank 1: partial" in s.reason


def test_nothing_recorded_anywhere_fails() -> None:
    s = make(agents=("a",))
    s.resolve_steps((3, 4))
    s.apply("a", ev(EventKind.ERROR, message="export failed: disk full"))
    s.apply("a", ev(EventKind.PART_DONE, payload=PartDone()))
    run(s)
    assert s.state is SessionState.FAILED
    assert s.targets["a"].state is PartState.FAILED and "disk full" in s.reason


def test_agent_closing_early_resolves_its_steps_as_missed() -> None:
    s = make(agents=("a",))
    s.resolve_steps((3, 4))
    s.apply("a", trace("t1", [3]))
    s.apply("a", ev(EventKind.CLOSED))
    run(s)
    part = s.targets["a"]
    assert part.state is PartState.PARTIAL and part.missed == {4}
    assert "job ended" in part.reason
    assert s.state is SessionState.PARTIAL


def test_lost_agent_and_cancel_and_deadline() -> None:
    s = make()
    s.resolve_steps((3,))
    s.mark_lost("a", "no heartbeat for 30 s")
    s.cancel("operator said so")
    run(s)
    assert s.state is SessionState.CANCELLED and s.reason == "operator said so"
    assert s.targets["a"].state is PartState.LOST
    assert s.targets["b"].state is PartState.CANCELLED

    late = make(deadline=5.0)
    late.resolve_steps((3,))
    run(late, now=1.0)
    assert run(late, now=6.0) == [SessionState.EXPIRED]
    assert all(p.state is PartState.EXPIRED for p in late.targets.values())


def test_events_for_unknown_agents_or_after_the_end_are_ignored() -> None:
    s = make(agents=("a",))
    s.resolve_steps((3,))
    s.apply("zzz", trace("t", [3]))
    s.cancel("x")
    run(s)
    s.apply("a", trace("t", [3]))
    assert s.targets["a"].traces == []


def test_progress_counts_recorded_steps_and_stays_short_when_cancelled() -> None:
    from profd.actors.reporting import progress_of

    s = make()
    s.resolve_steps((3, 4))
    assert progress_of(s).fraction == 0.0 and progress_of(s).planned_steps == 4
    s.apply("a", trace("t1", [3]))
    s.apply("b", ev(EventKind.MISSED, message="late", payload=StepsMissed((3,))))
    p = progress_of(s)
    assert (p.recorded_steps, p.missed_steps, p.fraction) == (1, 1, 0.25)
    s.apply("a", trace("t2", [4]))
    s.apply("a", ev(EventKind.PART_DONE, payload=PartDone()))
    p = progress_of(s)
    assert (p.recorded_steps, p.targets_finished, p.fraction) == (2, 1, 0.5)
    s.cancel("cancelled by user")
    run(s)
    assert s.state is SessionState.CANCELLED and progress_of(s).fraction == 0.5  # not a full bar
