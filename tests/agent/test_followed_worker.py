"""A single-controller worker follows its driver's steps through the coordinator (it marks
stages, never steps). What used to go wrong on a live job: a cancelled session's window, or
one open while the coordinator was down, kept the worker's profiler running until some
other plan reached it (seconds to minutes of profiler cost folded into one "step"). Here the
real torch backend records; the coordinator is a link whose plans and outages the test sets.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from profd.agent import ProfilerAgent
from profd.agent.channel import LinkDown
from profd.agent.recorder import CUT, UNFOLLOWED
from profd.core.protocol import AgentEvent, AgentPlan, EventKind, PollReply, WindowPlan

from helpers import wait_until


@dataclass
class Reg:
    plan: AgentPlan
    poll_timeout_s: float = 0.2


class Link:
    """The coordinator as a worker sees it: plans by long-poll, events, and outages."""

    def __init__(self) -> None:
        self.plan = AgentPlan(version=1)
        self.events: list = []
        self.down = False
        self.registrations = 0
        self._cond = threading.Condition()

    def set_plan(self, **kw) -> None:
        with self._cond:
            self.plan = AgentPlan(version=self.plan.version + 1, **kw)
            self._cond.notify_all()

    def go_down(self) -> None:
        """The coordinator goes away: the parked poll returns and finds the link down."""
        self.down = True
        with self._cond:
            self._cond.notify_all()

    def announce(self, agent: ProfilerAgent, plan: dict, step: int) -> None:
        """The driver begins ``step``: a plan that says so, held by the agent."""
        self.set_plan(**plan, controller_step=step)
        wait_until(lambda: agent.plan.controller_step == step, 10, what=f"step {step}")

    def _reachable(self) -> None:
        if self.down:
            raise LinkDown("coordinator gone")

    def register(self, info, step) -> Reg:
        self._reachable()
        self.registrations += 1
        return Reg(self.plan)

    def poll(self, agent_id, version, step, timeout) -> PollReply:
        self._reachable()
        with self._cond:
            if self.plan.version == version:
                self._cond.wait(timeout)
        self._reachable()
        return PollReply(plan=self.plan if self.plan.version != version else None)

    def report(self, agent_id, events) -> bool:
        self._reachable()
        self.events.extend(events)
        return True

    def clock_ns(self) -> int:
        self._reachable()
        return time.time_ns()

    def said(self, kind: EventKind) -> list:
        return [e for e in list(self.events) if e.kind is kind and e.session_id == "s1"]


def window(tmp_path: Path, steps: tuple[int, ...], groups) -> WindowPlan:
    return WindowPlan("s1", "torch", steps, groups, False, {}, str(tmp_path), "*")


def work(agent: ProfilerAgent) -> None:
    """One call of the driver into the worker: a stage, some torch."""
    with agent.stage("update_critic"):
        torch.ones(32).sum()


def test_a_cancelled_window_stops_at_the_workers_next_stage(tmp_path: Path) -> None:
    """The driver goes on announcing steps, but not to this worker (its window is gone): the
    collection is stopped at its next stage mark and what it recorded is written."""
    link = Link()
    agent = ProfilerAgent("critic", 0, 1, find_link=lambda: link, poll_timeout_s=0.2).start()
    try:
        wait_until(lambda: agent.connected, 10, what="registered")
        link.set_plan(windows=(window(tmp_path, tuple(range(3, 11)), (tuple(range(3, 11)),)),),
                      controller_step=3)  # fmt: skip
        wait_until(lambda: agent.plan.windows, 10, what="plan")
        work(agent)
        assert agent.recording and agent.current_step == 3
        link.set_plan(controller_step=3)  # cancelled: the window leaves, no new step
        wait_until(lambda: not agent.plan.windows, 10, what="the cancel")
        work(agent)
        assert not agent.recording
        wait_until(lambda: link.said(EventKind.PART_DONE), 30, what="part done")
        (trace,) = link.said(EventKind.TRACE)
        assert Path(trace.payload.path).exists()
        (missed,) = link.said(EventKind.MISSED)
        assert missed.payload.steps == tuple(range(3, 11))
        assert "the session ended before these steps" in missed.message
    finally:
        agent.close(10)


def test_a_coordinator_outage_cuts_the_followed_step_and_names_the_gap(
    tmp_path: Path, monkeypatch
) -> None:
    """The coordinator goes away during step 3 of a continuous group (``profd down``, a
    crash): the worker cannot see step 3 end, so once the outage has lasted (CUT_AFTER_S) it
    is cut at the next stage (written, counted missed, saying why); steps the worker could
    not follow are missed for that reason, not "never entered"; once the coordinator is
    back the group's next announced step records again, in a trace of its own."""
    from profd.agent import agent as agent_mod

    monkeypatch.setattr(agent_mod, "CUT_AFTER_S", 0.3)
    link = Link()
    agent = ProfilerAgent("critic", 0, 1, find_link=lambda: link, poll_timeout_s=0.2).start()
    try:
        wait_until(lambda: agent.connected, 10, what="registered")
        plan = dict(windows=(window(tmp_path, (3, 4, 5, 6), ((3, 4, 5, 6),)),))
        link.set_plan(**plan, controller_step=3)
        wait_until(lambda: agent.plan.windows, 10, what="plan")
        work(agent)
        assert agent.recording
        link.go_down()
        wait_until(lambda: not agent.connected, 10, what="the outage seen")
        work(agent)
        assert agent.recording  # a blip is not an outage: not cut at once
        wait_until(lambda: work(agent) or not agent.recording, 10, what="the cut")
        link.down = False
        wait_until(lambda: link.registrations == 2, 20, what="registered again")
        link.announce(agent, plan, 5)
        work(agent)
        assert agent.recording and agent.current_step == 5
        for step in (6, 7):
            link.announce(agent, plan, step)
            work(agent)
        wait_until(lambda: link.said(EventKind.PART_DONE), 30, what="part done")
        missed = {e.payload.steps: e.message for e in link.said(EventKind.MISSED)}
        assert missed == {(3,): CUT, (4,): UNFOLLOWED}
        done = link.said(EventKind.PART_DONE)[0].payload
        assert (done.recorded, done.missed) == ((5, 6), (3, 4))
        traces = sorted(tuple(e.payload.steps) for e in link.said(EventKind.TRACE))
        assert traces == [(), (5, 6)]  # step 3's trace as far as it went, kept, holding no
        # whole step (its index entry claims none); the group went on from step 5
        assert any("step5" in e.payload.path for e in link.said(EventKind.TRACE))
    finally:
        agent.close(10)


def test_a_blip_is_not_an_outage(tmp_path: Path) -> None:
    """The link drops and the agent registers again at once (a relay restarting), the
    driver still in the same step: nothing is cut; the step records whole."""
    link = Link()
    agent = ProfilerAgent("critic", 0, 1, find_link=lambda: link, poll_timeout_s=0.2).start()
    try:
        wait_until(lambda: agent.connected, 10, what="registered")
        plan = dict(windows=(window(tmp_path, (3,), ((3,),)),))
        link.set_plan(**plan, controller_step=3)
        wait_until(lambda: agent.plan.windows, 10, what="plan")
        work(agent)
        link.go_down()
        wait_until(lambda: not agent.connected, 10, what="the blip seen")
        link.down = False
        wait_until(lambda: agent.connected, 20, what="registered again")
        work(agent)
        assert agent.recording  # the same step, still recording
        link.announce(agent, plan, 4)
        work(agent)
        wait_until(lambda: link.said(EventKind.PART_DONE), 30, what="part done")
        assert link.said(EventKind.PART_DONE)[0].payload.recorded == (3,)
        assert link.said(EventKind.MISSED) == []
    finally:
        agent.close(10)


def test_a_short_loss_with_the_driver_steps_on_cuts_the_step_it_spans(tmp_path: Path) -> None:
    """The coordinator killed and restarted by Ray in a second or two: no cut while away
    (a blip, for all the worker knows), but the driver went on meanwhile (its next
    announced step is three on). The step in progress ended long ago: its trace would hold
    the steps since, so it is cut; the two between were run but not followed (they used to
    be "never entered", and the first step's trace counted them in)."""
    link = Link()
    agent = ProfilerAgent("critic", 0, 1, find_link=lambda: link, poll_timeout_s=0.2).start()
    try:
        wait_until(lambda: agent.connected, 10, what="registered")
        plan = dict(windows=(window(tmp_path, (3, 4, 5, 6), ((3,), (4,), (5,), (6,))),))
        link.set_plan(**plan, controller_step=3)
        wait_until(lambda: agent.plan.windows, 10, what="plan")
        work(agent)
        link.go_down()
        wait_until(lambda: not agent.connected, 10, what="the loss seen")
        work(agent)  # the driver's steps 4 and 5 run; the worker cannot tell
        link.down = False
        wait_until(lambda: agent.connected, 20, what="registered again")
        work(agent)
        assert agent.recording  # nothing cut yet: back within CUT_AFTER_S
        link.announce(agent, plan, 6)
        work(agent)
        assert agent.current_step == 6 and agent.recording
        link.announce(agent, plan, 7)
        work(agent)
        wait_until(lambda: link.said(EventKind.PART_DONE), 30, what="part done")
        missed = {e.payload.steps: e.message for e in link.said(EventKind.MISSED)}
        assert missed == {(3,): CUT, (4, 5): UNFOLLOWED}
        done = link.said(EventKind.PART_DONE)[0].payload
        assert (done.recorded, done.missed) == ((6,), (3, 4, 5))
    finally:
        agent.close(10)


def test_a_stale_unknown_to_a_report_does_not_undo_a_newer_registration(tmp_path: Path) -> None:
    """The coordinator restarts: a report is answered "unknown" by it before the poller
    registers again, and the answer lands after. It used to clear the new registration for
    good (the poller, answered "known" from then on, never set it again): the agent stayed
    "not connected" and its events never went. Now it is recognised as stale."""

    class StaleLink(Link):
        forgot = False  # the next poll says "unknown" (a coordinator that restarted)
        stale = False  # the next report's "unknown" lands after the new registration

        def poll(self, agent_id, version, step, timeout) -> PollReply:
            if self.forgot:
                self.forgot = False
                return PollReply(plan=None, known=False)
            return super().poll(agent_id, version, step, timeout)

        def report(self, agent_id, events) -> bool:
            if self.stale:
                self.stale = False
                wait_until(lambda: self.registrations == 2, 20, what="registered again")
                return False
            return super().report(agent_id, events)

    link = StaleLink()
    agent = ProfilerAgent("critic", 0, 1, find_link=lambda: link, poll_timeout_s=0.2).start()
    try:
        wait_until(lambda: agent.connected, 10, what="registered")
        link.set_plan(windows=(window(tmp_path, (3,), ((3,),)),), controller_step=3)
        wait_until(lambda: link.said(EventKind.ARMED), 10, what="armed")
        link.stale = link.forgot = True
        agent._emit(AgentEvent(EventKind.ERROR, "s1", None, "first"))
        wait_until(lambda: link.registrations == 2, 20, what="registered again")
        agent._emit(AgentEvent(EventKind.ERROR, "s1", None, "second"))
        wait_until(
            lambda: [e.message for e in link.said(EventKind.ERROR)] == ["first", "second"],
            20,
            what="both events delivered",
        )
        assert agent.connected
    finally:
        agent.close(10)


def test_a_jump_in_the_drivers_steps_cuts_the_step_it_spans_without_any_loss(tmp_path) -> None:
    """Seen by hand on a real job: a coordinator killed and restarted by Ray was re-synced
    by the node's relay, so the worker never lost its registration; the driver's next step
    reached it six steps on and the one in progress (4.8 s long) counted as recorded. Any
    jump of more than a step cuts it now, saying why."""
    from profd.agent.recorder import CUT_SKIPPED, UNANNOUNCED

    link = Link()
    agent = ProfilerAgent("critic", 0, 1, find_link=lambda: link, poll_timeout_s=0.2).start()
    try:
        wait_until(lambda: agent.connected, 10, what="registered")
        plan = dict(windows=(window(tmp_path, (3, 4, 5, 6), ((3,), (4,), (5,), (6,))),))
        link.announce(agent, plan, 3)
        work(agent)
        link.announce(agent, plan, 6)
        work(agent)
        link.announce(agent, plan, 7)
        work(agent)
        wait_until(lambda: link.said(EventKind.PART_DONE), 30, what="part done")
        missed = {e.payload.steps: e.message for e in link.said(EventKind.MISSED)}
        assert missed == {(3,): CUT_SKIPPED, (4, 5): UNANNOUNCED}
        assert link.said(EventKind.PART_DONE)[0].payload.recorded == (6,)
    finally:
        agent.close(10)
