"""An agent that closes stays closed: told "unknown" while it closes (its relay dropped it
once the coordinator had its ``closed`` event), it does not register again."""

from __future__ import annotations

import threading
from typing import Any

from profd.agent import ProfilerAgent
from profd.core.protocol import AgentEvent, EventKind, PollReply
from profd.core.states import AgentState
from profd.testing.coordinator import LocalLink

from helpers import wait_until


class ClosingRaceLink(LocalLink):
    """Once the coordinator has applied the agent's ``closed`` event, its poll is answered
    "unknown" at once (a relay told to drop the agent wakes its parked poll so), and the
    answer to that report waits until the poller has acted on it: the window in which the
    agent's ``close()`` has not stopped its channel yet."""

    def __init__(self, owner: Any) -> None:
        super().__init__(owner)
        self.closed_applied = threading.Event()
        self.registered_again = threading.Event()
        self.poller: threading.Thread | None = None

    def register(self, info: Any, step: int | None) -> Any:
        if self.closed_applied.is_set():
            self.registered_again.set()
        return super().register(info, step)

    def poll(self, agent_id: str, version: int, step: int | None, timeout: float) -> PollReply:
        if self.closed_applied.wait(timeout):
            return PollReply(plan=None, known=False)
        return super().poll(agent_id, version, step, timeout)

    def report(self, agent_id: str, events: list[AgentEvent]) -> bool:
        known = super().report(agent_id, events)
        if any(ev.kind is EventKind.CLOSED for ev in events):
            self.closed_applied.set()
            poller = self.poller
            assert poller is not None
            wait_until(
                lambda: self.registered_again.is_set() or not poller.is_alive(),
                10,
                0.01,
                what="the poller to act on the unknown answer",
            )
        return known


def test_an_agent_told_unknown_while_it_closes_does_not_register_again(
    local_coordinator,
) -> None:
    owner = local_coordinator
    link = ClosingRaceLink(owner)
    agent = ProfilerAgent("actor", 0, 1, find_link=lambda: link, mark_times=False).start()
    wait_until(lambda: agent.connected, 10, what="registration")
    link.poller = next(t for t in agent._channel._threads if t.name == "profd-poller")
    assert agent.close(timeout=10)
    assert link.closed_applied.is_set() and not link.registered_again.is_set()
    view = next(a for a in owner.call("list_agents") if a.agent_id == agent.agent_id)
    assert view.state is AgentState.CLOSED
