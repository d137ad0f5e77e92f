"""A report whose answer is lost is sent again, and the coordinator applies it once.

The case users meet at scale: a busy coordinator (or relay) takes an agent's report but
answers after the agent's call timed out, so the agent sends the same events again. Events
carry the agent's numbers (``AgentEvent.seq``) and the coordinator drops the copies."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import torch

from profd.agent import ProfilerAgent
from profd.core.protocol import AgentEvent, EventKind, StepsMissed
from profd.testing.coordinator import LocalLink

from helpers import start_agents, wait_armed, wait_terminal, wait_until

MODEL = torch.nn.Linear(16, 16)


def train_step(agent: ProfilerAgent, step: int) -> None:
    with agent.step(step), agent.stage("update", role="actor", update_loop=True):
        MODEL(torch.randn(4, 16)).sum().backward()


class LateAnswerLink(LocalLink):
    """Every report goes through, but the first answer to each batch holding an event of
    ``kind`` is lost (a Ray call that timed out while the coordinator still took it)."""

    def __init__(self, owner: Any, lost: list[tuple[str, int, int]], kind: EventKind) -> None:
        super().__init__(owner)
        self._lost = lost
        self._kind = kind
        self._lock = threading.Lock()

    def report(self, agent_id: str, events: list[AgentEvent]) -> bool:
        known = super().report(agent_id, events)
        batch = (agent_id, events[0].seq, len(events))
        if any(ev.kind is self._kind for ev in events):
            with self._lock:
                if batch not in self._lost:
                    self._lost.append(batch)
                    raise TimeoutError("report: no answer within 30 s")
        return known


def test_a_report_sent_again_after_a_lost_answer_is_applied_once(local_coordinator) -> None:
    owner = local_coordinator
    lost: list[tuple[str, int, int]] = []
    agents = late_answer_agents(owner, lost, EventKind.TRACE)
    for a in agents:
        train_step(a, 0)
    view = owner.call("create_session", {"steps": [2, 3], "roles": {"actor": {"all_ranks": True}}})
    for a in agents:
        wait_armed(a, view.session_id)
    for s in range(1, 5):
        for a in agents:
            train_step(a, s)
    view = wait_terminal(owner, view.session_id)
    assert view.state.value == "done", view.reason
    # one trace per step and rank, each listed once, each a file
    assert sorted((t.rank, t.steps) for t in view.traces) == [
        (0, [2]), (0, [3]), (1, [2]), (1, [3])
    ]  # fmt: skip
    assert len({t.trace_id for t in view.traces}) == 4
    assert all(Path(t.path).is_file() for t in view.traces)
    assert not view.warnings, view.warnings
    for part in view.targets:  # each part lists its two traces once, its steps once
        assert part.state.value == "done" and part.recorded_steps == [2, 3], part
        assert len(part.traces) == len(set(part.traces)) == 2, part
    assert view.progress is not None and view.progress.recorded_steps == 4
    wait_copies_dropped(owner, lost)  # the last ones arrive after the session's end
    assert len(owner.call("get_session", view.session_id).traces) == 4
    for a in agents:
        a.close()


def test_step_times_sent_again_are_counted_once(local_coordinator) -> None:
    """Live step times (what straggler triggers judge) are not doubled by a resend."""
    owner = local_coordinator
    lost: list[tuple[str, int, int]] = []
    agents = late_answer_agents(owner, lost, EventKind.TIMES)
    for s in range(5):
        for a in agents:
            train_step(a, s)

    def counts() -> list[int]:
        return [v.step_time.count if v.step_time else 0 for v in owner.call("list_agents")]

    wait_until(lambda: counts() == [5, 5], 10, what=f"5 step times per agent ({counts()})")
    wait_copies_dropped(owner, lost)
    assert counts() == [5, 5]
    for a in agents:
        a.close()


def late_answer_agents(owner: Any, lost: list[Any], kind: EventKind) -> list[ProfilerAgent]:
    agents = [
        ProfilerAgent("actor", r, 2, find_link=lambda: LateAnswerLink(owner, lost, kind)).start()
        for r in range(2)
    ]
    wait_until(lambda: all(a.connected for a in agents), 10, what="agents registered")
    return agents


def wait_copies_dropped(owner: Any, lost: list[tuple[str, int, int]]) -> None:
    """Until the coordinator dropped the copy of every batch whose answer was lost."""
    assert lost, "no report was sent again: the test did not exercise a resend"
    sent_again = sum(n for _, _, n in lost)
    wait_until(
        lambda: owner.call("metrics")["duplicate_events_total"] == sent_again, 10,
        what=f"{sent_again} events dropped as copies ({lost})",
    )  # fmt: skip


def test_the_coordinator_drops_copies_also_within_one_batch(local_coordinator) -> None:
    """A relay may carry both copies of an agent's events in one batch; unnumbered events
    (an older agent) all apply."""
    owner = local_coordinator
    (agent,) = start_agents(owner, 1)
    agent.close()
    info = dataclasses.replace(agent.info, agent_id="actor-0-copies")  # no event sent yet
    aid = info.agent_id
    owner.call("register", info, 0)
    before = owner.call("metrics")
    missed = StepsMissed(steps=(7,))

    def ev(seq: int) -> AgentEvent:
        return AgentEvent(EventKind.MISSED, "nosuch", 7, "late", missed, seq=seq)

    assert owner.call("report", aid, [ev(1), ev(2), ev(1), ev(2), ev(3)]) is True
    assert owner.call("report", aid, [ev(2), ev(3)]) is True  # all copies
    assert owner.call("report", aid, [ev(0), ev(0), ev(4)]) is True
    after = owner.call("metrics")
    assert after["events_total"] - before["events_total"] == 6  # 1, 2, 3, 0, 0, 4
    assert after["duplicate_events_total"] - before["duplicate_events_total"] == 4
