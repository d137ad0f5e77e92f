"""Several agents of one process share one long-poll (profd.agent.multiplex)."""

from __future__ import annotations

import torch

from profd.agent import ProfilerAgent
from profd.agent.multiplex import Multiplexer

from helpers import wait_armed, wait_terminal, wait_until


class CountingCaller:
    def __init__(self, owner) -> None:
        self.owner = owner
        self.calls: dict[str, int] = {}

    def call(self, method: str, *args, timeout: float):
        self.calls[method] = self.calls.get(method, 0) + 1
        return self.owner.call(method, *args, timeout=timeout)


def test_agents_share_one_poll_and_record(local_coordinator) -> None:
    caller = CountingCaller(local_coordinator)
    mux = Multiplexer(lambda: caller, poll_timeout_s=1.0)
    agents = [
        ProfilerAgent("rollout", r, 3, find_link=mux.find_link, poll_timeout_s=1.0).start()
        for r in range(3)
    ]
    wait_until(lambda: all(a.connected for a in agents), 10, what="registration")
    for a in agents:
        with a.step(0):
            pass
    view = local_coordinator.call(
        "create_session", {"steps": [1], "roles": {"rollout": {"all_ranks": True}}}
    )
    for a in agents:
        wait_armed(a, view.session_id)
    for s in (1, 2):
        for a in agents:  # one at a time: torch allows one profiler per process
            with a.step(s), a.stage("generate"):
                torch.ones(4).sum()
    view = wait_terminal(local_coordinator, view.session_id)
    assert mux.polled == {a.agent_id for a in agents}
    for a in agents:
        a.close()
    # closed agents are unknown to the coordinator: the shared poll drops them
    wait_until(lambda: not mux.polled, 10, what="closed agents' slots gone")
    mux.close()
    assert view.state.value == "done", view.reason
    assert sorted(t.rank for t in view.traces) == [0, 1, 2]
    assert caller.calls.get("poll", 0) == 0 and caller.calls["poll_many"] >= 1
    assert caller.calls["register"] == 3


def test_poll_many_reports_unknown_agents(local_coordinator) -> None:
    replies = local_coordinator.call("poll_many", {"ghost": 0}, {"ghost": None}, 1.0)
    assert replies["ghost"].known is False and replies["ghost"].plan is None
