"""Step and stage durations: the rings marks write on the training thread, what the reporter
takes from them, and how failures stay out of the loop (no coordinator, no Ray)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from profd.agent import ProfilerAgent
from profd.agent.channel import Channel
from profd.agent.timings import MAX_LABELS, RING, StageTimer, drain
from profd.backends import NULL_RANGE
from profd.backends.base import NoopBackend
from profd.core.protocol import (
    EMPTY_PLAN,
    AgentEvent,
    AgentInfo,
    AgentPlan,
    EventKind,
    MarkDurations,
    PollReply,
    WindowPlan,
)

from helpers import wait_until


def inert(**kw: Any) -> ProfilerAgent:
    return ProfilerAgent("actor", 0, 1, find_link=lambda: None, **kw)


def by_label(times: MarkDurations) -> dict[str, Any]:
    return {d.label: d for d in times.stages}


def test_marks_record_every_step_and_stage_duration() -> None:
    agent = inert()
    for step in range(3):
        with agent.step(step):
            with agent.stage("load"):
                time.sleep(0.005)
            with agent.stage("update", role="ref"):
                pass
    times = agent._take_times()
    assert times is not None and times.step is not None
    assert len(times.step.seconds) == 3 and times.step.lost == 0
    stages = by_label(times)
    assert sorted(stages) == ["load", "ref_update"]
    assert len(stages["load"].seconds) == 3
    for d in (times.step, *stages.values()):  # every one timed from its own start
        assert max(d.seconds) < 0.5, d
    assert min(stages["load"].seconds) >= 0.005
    assert all(s >= 0.005 for s in times.step.seconds)  # a step holds its stages
    assert agent._take_times() is None  # nothing new since
    with agent.stage("load"):
        pass
    again = agent._take_times()
    assert again.step is None and [d.label for d in again.stages] == ["load"]
    assert agent.close(5)


def test_a_full_ring_keeps_the_newest_and_counts_the_rest_lost() -> None:
    agent = inert()
    for step in range(RING + 10):
        with agent.step(step):
            if step >= 10:  # the newest RING steps take longer than the first 10
                time.sleep(0.0002)
    times = agent._take_times()
    assert times.step.lost == 10 and len(times.step.seconds) == RING
    assert min(times.step.seconds) >= 0.0002  # the first 10 are the ones lost
    assert agent.close(5)


class _Lapping(list):
    """A ring the training thread writes ``n`` more samples into while it is being read."""

    def __init__(self, timer: StageTimer, n: int) -> None:
        super().__init__(timer.ring)
        self.timer, self.n = timer, n

    def __getitem__(self, i: Any) -> Any:
        if self.n:
            for _ in range(self.n):
                list.__setitem__(self, self.timer.head % RING, -1.0)  # the new samples
                self.timer.head += 1
            self.n = 0
        return list.__getitem__(self, i)


def test_a_ring_lapped_while_read_keeps_only_slots_not_overwritten() -> None:
    timer = StageTimer("load")
    for i in range(RING):  # full: samples 0..RING-1, each its own value
        timer.ring[i] = float(i)
    timer.head = RING
    timer.ring = _Lapping(timer, 5)  # samples RING..RING+4 overwrite slots 0..4 mid-read
    got = drain(timer)
    assert got.lost == 5 and got.seconds == tuple(float(i) for i in range(5, RING))
    nxt = drain(timer)
    assert nxt.seconds == (-1.0,) * 5 and nxt.lost == 0


def test_without_mark_times_the_marks_are_the_shared_noop() -> None:
    agent = inert(mark_times=False)
    assert agent.stage("load") is NULL_RANGE
    with agent.step(1), agent.stage("load"):
        pass
    assert agent.current_step == 1 and agent._take_times() is None
    assert agent.close(5)


def test_labels_beyond_the_cap_go_untimed_and_a_fault_never_reaches_the_loop(caplog) -> None:
    agent = inert()
    with caplog.at_level(logging.WARNING, logger="profd.agent.timings"):
        for _ in range(2):
            for i in range(MAX_LABELS + 5):
                with agent.stage(f"s{i}"):
                    pass
    assert len(agent._take_times().stages) == MAX_LABELS
    assert sum("not timed" in r.getMessage() for r in caplog.records) == 1

    def broken(*args: Any) -> Any:
        raise RuntimeError("boom")

    agent._timings.timer = broken  # a fault in timing a new label
    with caplog.at_level(logging.ERROR, logger="profd.agent.agent"), agent.stage("new"):
        ran = True
    assert ran and any("timing stage 'new' failed" in r.getMessage() for r in caplog.records)
    assert agent.close(5)


def test_colocated_roles_time_stages_under_their_trace_labels() -> None:
    agent = inert()
    with agent.stage("load"):
        pass
    agent.add_role("ref")  # from now on every label names its role
    with agent.stage("load"):
        pass
    with agent.stage("load", role="ref"):
        pass
    assert sorted(by_label(agent._take_times())) == ["actor_load", "load", "ref_load"]
    assert agent.close(5)


def test_stages_are_timed_while_a_window_records(tmp_path) -> None:
    agent = ProfilerAgent(
        "actor", 0, 1, find_link=lambda: None, backend_factory=lambda k, o: NoopBackend()
    )
    window = WindowPlan("s", "torch", (1,), ((1,),), False, {}, str(tmp_path), "*")
    agent._install_plan(AgentPlan(version=1, windows=(window,)))
    with agent.step(1):
        assert agent.recording
        with agent.stage("load"):
            time.sleep(0.005)
    times = agent._take_times()
    assert by_label(times)["load"].seconds[0] >= 0.005 and len(times.step.seconds) == 1
    assert agent.close(5)


class _Link:
    """A coordinator that takes reports (and parks polls briefly)."""

    def __init__(self) -> None:
        self.events: list[AgentEvent] = []
        self.lock = threading.Lock()

    def register(self, info: AgentInfo, step: int | None) -> Any:
        return type("Reg", (), {"plan": EMPTY_PLAN, "poll_timeout_s": 0.05})()

    def poll(self, agent_id: str, version: int, step: int | None, timeout: float) -> PollReply:
        time.sleep(timeout)
        return PollReply(plan=None)

    def report(self, agent_id: str, events: list[AgentEvent]) -> bool:
        with self.lock:
            self.events.extend(events)
        return True

    def clock_ns(self) -> int:
        return time.time_ns()


def test_the_reporter_ships_times_and_a_failing_take_only_stops_them(caplog) -> None:
    """A take that fails is tried again (a race or a passing fault must not end live times
    for the process); only MAX_TIMES_FAILURES in a row stop them, and nothing else."""
    from profd.agent.channel import MAX_TIMES_FAILURES

    info = AgentInfo("a-0", "actor", 0, 1, {}, "host", 1)
    link, calls = _Link(), []
    fail_from = [2, 3]  # call 2 fails once; from call 4 on every call fails

    def take() -> MarkDurations | None:
        calls.append(1)
        n = len(calls)
        if n == fail_from[0] or n >= fail_from[1] + 1:
            raise RuntimeError("boom")
        return MarkDurations(step=None)

    ch = Channel(info, lambda: link, lambda: None, lambda p: None, take_times=take,
                 times_every_s=0.0)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="profd.agent.channel"):
        ch.start()
        wait_until(lambda: ch._take_times is None, 10, what="times stopped")
        ch.send(AgentEvent(EventKind.ARMED, "s"))
        assert ch.flush(10)
        ch.stop()
    kinds = [e.kind for e in link.events]
    # calls 1 and 3 shipped (3 after 2 failed), then MAX_TIMES_FAILURES failures in a row
    assert kinds == [EventKind.TIMES, EventKind.TIMES, EventKind.ARMED], kinds
    assert len(calls) == 3 + MAX_TIMES_FAILURES
    messages = [r.getMessage() for r in caplog.records]
    assert sum("step and stage times failed; trying again" in m for m in messages) == 1
    assert sum("they stop here" in m for m in messages) == 1


def test_a_plan_installed_while_the_recorder_runs_is_adopted_at_the_next_step(tmp_path) -> None:
    """The timed step mark compares one copy of when it has work (``wake``); a plan the
    poller installs while the training thread is inside the recorder must still be adopted
    at the next step, not at the old plan's window."""
    agent = ProfilerAgent(
        "actor", 0, 1, find_link=lambda: None, backend_factory=lambda k, o: NoopBackend()
    )

    def plan(version: int, sid: str, at: int) -> AgentPlan:
        w = WindowPlan(sid, "torch", (at,), ((at,),), False, {}, str(tmp_path), "*")
        return AgentPlan(version=version, windows=(w,))

    agent._install_plan(plan(1, "late", 1000))
    recorder, real_enter = agent._recorder, agent._recorder.enter_step

    def enter_with_a_racing_poller(step: int, armed: Any) -> None:
        real_enter(step, armed)  # adopts "late" (wake_at 1000) ...
        agent._install_plan(plan(2, "soon", 3))  # ... while the poller installs a new plan

    recorder.enter_step = enter_with_a_racing_poller
    with agent.step(1):
        pass
    recorder.enter_step = real_enter
    assert recorder.seen is not agent._armed  # not adopted yet: the next step must call in
    with agent.step(2):
        pass
    assert recorder.seen is agent._armed and recorder.wake_at == 3
    with agent.step(3):
        assert agent.recording  # the new plan's window, on time
    assert agent.close(5)
