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


def test_events_for_unknown_agents_or_after_the_end_are_ignored_but_its_files() -> None:
    """After a part ended only its files still count: a cancel stops a window at the
    agent's next mark, so the file of what it recorded comes after; the session's traces
    and its parts' listed 21 and 18 on a live job."""
    s = make(agents=("a",))
    s.resolve_steps((3,))
    s.apply("zzz", trace("t", [3]))
    s.cancel("x")
    run(s)
    s.apply("a", ev(EventKind.ERROR, message="late"))
    assert not s.targets["a"].ended_by_agent
    s.apply("a", ev(EventKind.PART_DONE, payload=PartDone((3,))))
    s.apply("a", trace("t", [3]))
    part = s.targets["a"]
    assert part.traces == ["t"] and part.errors == [] and part.state is PartState.CANCELLED
    assert part.recorded == {3}
    # its end still counts: nothing more will come (what `profd cancel` waits for)
    assert part.ended_by_agent and "a" in s.dirty_parts
    from profd.actors.reporting import session_view

    assert session_view(s, {}, []).targets[0].agent_done
    # an agent that closed while its file was still being written: the step was missed,
    # the file comes after; recorded, and no longer missed
    closed = make(agents=("a",))
    closed.resolve_steps((3,))
    closed.apply("a", ev(EventKind.CLOSED))
    assert closed.targets["a"].missed == {3} and closed.targets["a"].state.is_terminal
    closed.apply("a", trace("t", [3]))
    assert (closed.targets["a"].recorded, closed.targets["a"].missed) == ({3}, set())
    assert s.state is SessionState.CANCELLED and run(s) == []


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


def _scanned(s: Session) -> tuple[bool, bool, bool]:
    """What advance asks, found by looking at every part (the rule its counts stand for)."""
    parts = list(s.targets.values())
    return (
        all(p.state.is_terminal for p in parts),
        any(p.recorded or p.state not in (PartState.PENDING, PartState.ARMED) for p in parts),
        any(p.state in (PartState.PENDING, PartState.ARMED, PartState.RECORDING) for p in parts),
    )


def _counted(s: Session) -> tuple[bool, bool, bool]:
    t, n = s._tally, len(s.targets)
    waiting = t[PartState.PENDING] + t[PartState.ARMED]
    return (
        sum(c for st, c in t.items() if st.is_terminal) == n,
        s._recorded_any or waiting < n,
        waiting + t[PartState.RECORDING] > 0,
    )


def test_advance_counts_parts_by_state_through_every_change() -> None:
    """advance reads counts by state, kept as parts change (a fleet's 10,000 parts are not
    scanned after every report): they agree with a scan of every part after events in any
    order, a lost agent, a part added late or replaced, a restore and a cancel; and a
    session of 300 parts finishing one by one ends exactly when the last one does."""
    import random

    rng = random.Random(7)
    agents = [f"a{i}" for i in range(300)]
    s = make(tuple(agents), steps=(3,))
    s.resolve_steps((3,))
    assert run(s) == [SessionState.ARMED]
    kinds = [EventKind.ARMED, EventKind.RECORDING, EventKind.COLLECTING]
    for i, a in enumerate(rng.sample(agents, len(agents))):
        for k in kinds[: rng.randrange(4)]:
            s.apply(a, ev(k, step=3))
        if i % 50 == 0:
            s.apply(a, trace(f"t-{a}", [3]))  # a trace before any progress event
        assert _counted(s) == _scanned(s)
        s.advance(1.0)
    s.mark_lost("a1", "gone")
    s.add_part(Part("late", "actor", 999, "*"))  # a late agent of an open session
    s.add_part(Part("a2", "actor", 2, "*", state=PartState.RECORDING))  # replaced
    assert _counted(s) == _scanned(s)
    again = Session.from_dict(s.to_dict())  # restored: counted from its parts
    assert _counted(again) == _scanned(again) and again._tally == s._tally
    order = rng.sample(list(s.targets), len(s.targets))
    for a in order:
        if s.targets[a].state.is_terminal:
            continue
        s.apply(a, trace(f"t2-{a}", [3]))
        s.apply(a, ev(EventKind.PART_DONE, payload=PartDone()))
        assert _counted(s) == _scanned(s)
        ended = s.advance(1.0)
        while ended is not None and not s.state.is_terminal:
            ended = s.advance(1.0)
        assert s.state.is_terminal == all(p.state.is_terminal for p in s.targets.values())
    assert s.state is SessionState.PARTIAL  # a1 lost
    c = make(("x", "y"))
    c.resolve_steps((3, 4))
    c.add_part(Part("z", "actor", 2, "*"))
    c.cancel("stop")
    assert run(c) == [SessionState.CANCELLED]
    assert _counted(c) == _scanned(c) and c._tally[PartState.CANCELLED] == 3
