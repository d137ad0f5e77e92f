"""The coordinator restarts with its state; agents keep recording through the outage."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from profd.actors.coordinator import ProfileCoordinator
from profd.agent import ProfilerAgent
from profd.testing.coordinator import InProcessCoordinator

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
    # the agent's own end is kept: `profd cancel` after a restart does not wait for it
    assert before.targets[0].agent_done and after.targets[0].agent_done
    assert [t.trace_id for t in listed] == [t.trace_id for t in before.traces]
    assert (tmp_path / "state" / "coordinator.sqlite3").stat().st_mode & 0o777 == 0o600


def test_a_failed_state_write_is_counted_never_raised(tmp_path: Path) -> None:
    from profd.actors.store import SqliteStore

    store = SqliteStore(tmp_path / "state" / "coordinator.sqlite3")
    store.save_session("bad", {"session_id": "bad"}, {"a": {"step": 2**70}})  # not JSON-able
    store.save_session("good", {"session_id": "good"}, {"a": {"step": 3}})
    assert store.failed_writes == 1 and "bad" in (store.last_error or "")
    # the failed write left nothing half-written: neither the header nor the part
    assert store.load()["sessions"] == [{"session_id": "good", "targets": {"a": {"step": 3}}}]


def test_sessions_persist_one_row_per_changed_part(tmp_path: Path) -> None:
    """An event rewrites one part, not the session's 10,000; an idle tick writes nothing;
    a restart puts the parts back together."""
    from profd.actors.store import SqliteStore

    settings = coordinator_settings(tmp_path)
    coord = ProfileCoordinator(settings)
    writes: list[tuple[str, list[str]]] = []
    real_save = coord._store.save_session

    def counting_save(session_id, data, parts):
        writes.append((session_id, sorted(parts)))
        return real_save(session_id, data, parts)

    coord._store.save_session = counting_save
    owner = InProcessCoordinator(coord)
    agents = [ProfilerAgent("actor", r, 3, find_link=owner.link).start() for r in range(3)]
    try:
        wait_until(lambda: all(a.connected for a in agents), 10, what="agents registered")
        for a in agents:
            step(a, 0)
        view = owner.call("create_session", {"steps": [2], "roles": {"actor": {"all_ranks": True}}})
        wait_until(lambda: writes, 5, what="first save")
        assert len(writes[0][1]) == 3  # a new session writes every part once
        wait_until(lambda: all(a.plan.windows for a in agents), 10, what="armed")
        time.sleep(1.0)  # armed events arrive; then ticks with nothing new
        writes.clear()
        time.sleep(1.0)  # five ticks of 0.2 s
        assert writes == []
        step(agents[0], 1)
        step(agents[0], 2)
        wait_until(lambda: writes, 5, what="a save after agent 0's events")
        assert {aid for _, parts in writes for aid in parts} == {agents[0].agent_id}
        for a in agents[1:]:
            step(a, 1)
            step(a, 2)
        for a in agents:
            step(a, 3)
        assert wait_terminal(owner, view.session_id).state.value == "done"
    finally:
        for a in agents:
            a.close()
        owner.close()
    restored = SqliteStore(Path(settings.state_dir) / "coordinator.sqlite3").load()["sessions"]
    (saved,) = restored
    assert {p["state"] for p in saved["targets"].values()} == {"done"}
    assert len(saved["targets"]) == 3


def test_parts_of_a_failed_write_are_written_again(tmp_path: Path) -> None:
    """A write that failed (disk full) keeps its parts marked: the next save carries them."""
    settings = coordinator_settings(tmp_path)
    coord = ProfileCoordinator(settings)
    real_save, calls = coord._store.save_session, []

    def flaky_save(session_id, data, parts):
        calls.append(sorted(parts))
        if len(calls) == 2:  # the write after the agent's events fails
            return False
        return real_save(session_id, data, parts)

    coord._store.save_session = flaky_save
    owner = InProcessCoordinator(coord)
    agent = ProfilerAgent("actor", 0, 1, find_link=owner.link).start()
    try:
        wait_until(lambda: agent.connected, 10, what="registered")
        step(agent, 0)
        view = owner.call("create_session", {"steps": [1]})
        wait_until(lambda: len(calls) >= 3, 10, what="a failed write and the next one")
        assert calls[1] == [agent.agent_id] and calls[2] == [agent.agent_id]
        for n in (1, 2):
            step(agent, n)
        assert wait_terminal(owner, view.session_id).state.value == "done"
    finally:
        agent.close()
        owner.close()
    from profd.actors.store import SqliteStore

    (saved,) = SqliteStore(Path(settings.state_dir) / "coordinator.sqlite3").load()["sessions"]
    assert [p["state"] for p in saved["targets"].values()] == ["done"]
