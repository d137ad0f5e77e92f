"""The coordinator restarts with its state; agents keep recording through the outage."""

from __future__ import annotations

from pathlib import Path

import torch

from profd.actors.coordinator import ProfileCoordinator
from profd.agent import ProfilerAgent
from profd.agent.local import InProcessCoordinator

from helpers import coordinator_settings, wait_armed, wait_terminal, wait_until


def step(agent: ProfilerAgent, n: int) -> None:
    with agent.step(n), agent.stage("update"):
        torch.ones(4).sum()


def test_restart_keeps_sessions_and_traces_and_agents_carry_on(tmp_path: Path) -> None:
    settings = coordinator_settings(tmp_path, state_dir=str(tmp_path / "state"))
    holder = {"owner": InProcessCoordinator(ProfileCoordinator(settings))}
    agent = ProfilerAgent("actor", 0, 1, find_link=lambda: holder["owner"].link()).start()
    wait_until(lambda: agent.connected, 10)
    step(agent, 0)
    view = holder["owner"].call("create_session", {"steps": [1, 2, 3]})
    sid = view.session_id
    wait_armed(agent, sid)
    step(agent, 1)
    wait_until(lambda: holder["owner"].call("list_traces", sid), 10, what="first trace")

    # the coordinator dies; the agent records step 2 while it is gone
    holder["owner"].down = True
    holder["owner"].close()
    wait_until(lambda: not agent.connected, 10, what="agent notices")
    step(agent, 2)

    holder["owner"] = InProcessCoordinator(ProfileCoordinator(settings))  # restarted
    restored = holder["owner"].call("get_session", sid)
    assert restored.state.value == "recording" and len(restored.traces) == 1
    wait_until(lambda: agent.connected, 15, what="re-registration")
    step(agent, 3)
    step(agent, 4)
    view = wait_terminal(holder["owner"], sid)
    agent.close()
    holder["owner"].close()
    assert view.state.value == "done", view.reason
    assert sorted(t.steps[0] for t in view.traces) == [1, 2, 3]  # step 2 reported after restart
    assert all(Path(t.path).is_file() for t in view.traces)


def test_agent_that_never_returns_after_a_restart_is_lost(tmp_path: Path) -> None:
    settings = coordinator_settings(
        tmp_path, state_dir=str(tmp_path / "state"), heartbeat_timeout_s=1.5
    )
    owner = InProcessCoordinator(ProfileCoordinator(settings))
    agent = ProfilerAgent("actor", 0, 1, find_link=owner.link).start()
    wait_until(lambda: agent.connected, 10)
    step(agent, 0)
    sid = owner.call("create_session", {"steps": [5]}).session_id
    owner.down = True
    owner.close()
    agent.close(timeout=1)  # the worker is gone for good

    again = InProcessCoordinator(ProfileCoordinator(settings))
    view = wait_terminal(again, sid, timeout=15)
    again.close()
    assert view.state.value == "failed"
    assert view.targets[0].state.value == "lost"
    assert "did not come back after a coordinator restart" in view.targets[0].reason


def test_finished_sessions_survive_a_restart(tmp_path: Path) -> None:
    settings = coordinator_settings(tmp_path, state_dir=str(tmp_path / "state"))
    owner = InProcessCoordinator(ProfileCoordinator(settings))
    agent = ProfilerAgent("actor", 0, 1, find_link=owner.link).start()
    wait_until(lambda: agent.connected, 10)
    step(agent, 0)
    sid = owner.call("create_session", {"steps": [1]}).session_id
    wait_armed(agent, sid)
    step(agent, 1)
    step(agent, 2)
    before = wait_terminal(owner, sid)
    agent.close()
    owner.close()
    again = InProcessCoordinator(ProfileCoordinator(settings))
    after = again.call("get_session", sid)
    listed = again.call("list_traces", sid)
    again.close()
    assert after.state == before.state and after.reason == before.reason
    assert [t.trace_id for t in listed] == [t.trace_id for t in before.traces]
    assert (tmp_path / "state" / "coordinator.sqlite3").stat().st_mode & 0o777 == 0o600


def test_a_failed_state_write_is_counted_never_raised(tmp_path: Path) -> None:
    from profd.actors.store import SqliteStore

    store = SqliteStore(tmp_path / "state" / "coordinator.sqlite3")
    store.save_session("bad", {"step": 2**70})  # orjson cannot encode it
    store.save_session("good", {"step": 3})
    assert store.failed_writes == 1 and "bad" in (store.last_error or "")
    assert store.load()["sessions"] == [{"step": 3}]
