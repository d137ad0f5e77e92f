"""Triggers are part of the coordinator's state: a coordinator restarted from its state
directory (Ray restarting it, or `profd up` after the coordinator was killed) watches the
same triggers, with the same ids and requests; a deleted one stays deleted, a straggler
trigger's role is timed with its ends again (its agents' plans say so), and the sessions a
trigger started are its firings again (cooldown and the hourly cap count them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from helpers import coordinator_settings, start_agents

STRAGGLER = {
    "name": "late-update",
    "when": {"kind": "straggler", "role": "actor", "stage": "update", "min_ms": 50},
    "cooldown_s": 120,
}
OOM = {"name": "actor-oom", "when": {"kind": "oom", "role": "actor"}}


def _owner(tmp_path: Path) -> Any:
    from profd.actors.coordinator import ProfileCoordinator
    from profd.testing.coordinator import InProcessCoordinator

    return InProcessCoordinator(ProfileCoordinator(coordinator_settings(tmp_path)))


def test_a_restarted_coordinator_watches_the_same_triggers(tmp_path: Path) -> None:
    first = _owner(tmp_path)
    try:
        late = first.call("add_trigger", STRAGGLER)
        oom = first.call("add_trigger", OOM)
        first.call("delete_trigger", oom.trigger_id)
        edit = {**STRAGGLER, "when": {**STRAGGLER["when"], "min_ms": 80}}
        late = first.call("replace_trigger", late.trigger_id, edit)  # saved as changed
        assert first.call("flush_state", 5.0)
    finally:
        first.close()

    again = _owner(tmp_path)
    try:
        (back,) = again.call("list_triggers")
        assert back.trigger_id == late.trigger_id and back.name == "late-update"
        assert back.request == late.request and back.created_at == late.created_at
        assert back.request["when"]["min_ms"] == 80
        assert back.fired == 0 and back.firings == []  # it started no session
        (agent,) = start_agents(again, 1, "actor")
        assert agent._timings.spans  # the straggler trigger's role keeps its marks' ends
        again.call("delete_trigger", late.trigger_id)
        assert again.call("flush_state", 5.0)
        agent.close(5)
    finally:
        again.close()

    third = _owner(tmp_path)
    try:
        assert third.call("list_triggers") == []
    finally:
        third.close()


def test_saved_rows_this_version_cannot_read_are_skipped(tmp_path: Path) -> None:
    owner = _owner(tmp_path)
    try:
        desk = owner.coordinator._triggers
        good = {"trigger_id": "trg-1", "request": STRAGGLER, "created_at": 5.0}
        rows = [{"trigger_id": "trg-0", "request": {"name": "x"}}, {"request": OOM},
                {**good, "trigger_id": "trg-2", "created_at": "soon"}, good]  # fmt: skip
        assert owner.run(desk.restore, rows) == 1
        (t,) = owner.call("list_triggers")
        assert (t.trigger_id, t.created_at) == ("trg-1", 5.0)
    finally:
        owner.close()


def test_a_times_event_moves_the_step_on_only_forward_and_only_for_numbers() -> None:
    from profd.actors.agent_desk import _fresher

    assert _fresher(None, 4) == 4 and _fresher(3, 4) == 4 and _fresher(5, 4) == 5
    assert _fresher(3, None) == 3 and _fresher(3, "warmup") == 3 and _fresher("a", 2) == "a"


def _oom(owner: Any, agent: Any, step: int) -> None:
    from profd.core.protocol import AgentEvent, EventKind, OutOfMemory

    event = AgentEvent(EventKind.OOM, step=step, payload=OutOfMemory("OutOfMemoryError: x"))
    assert owner.call("report", agent.agent_id, [event])


def test_a_restarted_coordinator_keeps_a_triggers_firings_cooldown_and_cap(
    tmp_path: Path,
) -> None:
    """A coordinator that crash-loops must not start a trigger's sessions again each time:
    the sessions a trigger started are its firings after a restart (same ids, same
    sessions), its cooldown holds, and new firings are numbered after them."""
    from helpers import wait_until

    request = {**OOM, "session": {"next_steps": 1}, "cooldown_s": 600, "max_per_hour": 2}
    first = _owner(tmp_path)
    try:
        agents = start_agents(first, 2, "actor")
        tid = first.call("add_trigger", request).trigger_id
        _oom(first, agents[0], 3)
        view = wait_until(
            lambda: (v := first.call("get_trigger", tid)).fired == 1 and v, 10, what="fired"
        )
        (firing,) = view.firings
        for step in range(4, 400):  # the loop goes on: its session records the next step
            for a in agents:
                with a.step(step):
                    pass
            if first.call("get_session", firing.session_id).state.is_terminal:
                break
        # over (its steps went by before its plan: missed), so no live session holds the ranks
        assert first.call("get_session", firing.session_id).state.is_terminal
        assert first.call("flush_state", 5.0)
        for a in agents:
            a.close(5)
    finally:
        first.close()

    again = _owner(tmp_path)
    try:
        back = again.call("get_trigger", tid)
        assert back.fired == 1
        (kept,) = back.firings
        assert (kept.firing_id, kept.session_id, kept.state) == (
            firing.firing_id, firing.session_id, "fired",
        )  # fmt: skip
        assert kept.evidence["rank"] == 0 and kept.evidence["kind"] == "oom"
        session = again.call("get_session", firing.session_id)
        assert session.trigger_id == tid
        agents = start_agents(again, 2, "actor")
        _oom(again, agents[1], 9)  # within the cooldown the first incarnation started
        after = wait_until(
            lambda: (v := again.call("get_trigger", tid)).suppressed and v, 10, what="suppressed"
        )
        assert after.suppressed == {"cooldown": 1} and after.fired == 1
        assert len(again.call("list_sessions")) == 1  # no second session
        # a firing made now (the cooldown lifted) is numbered after the restored one
        book = again.coordinator._triggers.book
        book.get(tid).request = book.get(tid).request.model_copy(update={"cooldown_s": 0})
        _oom(again, agents[1], 10)
        later = wait_until(
            lambda: (v := again.call("get_trigger", tid)).fired == 2 and v, 10, what="refired"
        )
        newest, oldest = later.firings
        assert oldest.firing_id == firing.firing_id
        assert int(newest.firing_id.rpartition(".")[2]) > int(firing.firing_id.rpartition(".")[2])
        _oom(again, agents[0], 11)  # the hourly cap (2) counts the restored firing
        capped = wait_until(
            lambda: (v := again.call("get_trigger", tid)).suppressed.get("max_per_hour") and v,
            10,
            what="capped",
        )
        assert capped.fired == 2
        for a in agents:
            a.close(5)
    finally:
        again.close()


def test_a_due_firing_outlives_a_coordinator_crash(tmp_path: Path) -> None:
    """A firing that waits for busy ranks when the coordinator dies is due again after the
    restart (same id, same time) and starts its session once the ranks are free; a hand
    test lost one (only the trigger's request was kept), and the rank, slow for good by
    then, no longer stood out against a baseline full of its own slow steps."""
    from profd.actors.coordinator import ProfileCoordinator
    from profd.agent import ProfilerAgent
    from profd.testing.coordinator import InProcessCoordinator

    from helpers import wait_until

    settings = coordinator_settings(tmp_path)
    holder = {"owner": InProcessCoordinator(ProfileCoordinator(settings))}
    agents = [
        ProfilerAgent("actor", r, 2, find_link=lambda: holder["owner"].link()).start()
        for r in range(2)
    ]
    try:
        wait_until(lambda: all(a.connected for a in agents), 10, what="agents registered")
        first = holder["owner"]
        busy = first.call("create_session", {"steps": [100000]}).session_id  # holds the ranks
        tid = first.call("add_trigger", {**OOM, "session": {"next_steps": 1}}).trigger_id
        _oom(first, agents[0], 3)
        due = wait_until(
            lambda: (f := first.call("get_trigger", tid).firings) and f[0].state == "due" and f[0],
            10,
            what="a due firing",
        )
        assert first.call("flush_state", 5.0)
        first.down = True  # dies: no goodbye
        first.close()
        wait_until(lambda: not any(a.connected for a in agents), 10, what="agents notice")

        holder["owner"] = again = InProcessCoordinator(ProfileCoordinator(settings))
        (back,) = again.call("get_trigger", tid).firings
        assert (back.firing_id, back.at, back.state) == (due.firing_id, due.at, "due")
        # the ranks are free before their agents are back: it waits for them, not fails
        again.call("cancel_session", busy)
        fired = wait_until(
            lambda: (v := again.call("get_trigger", tid)).fired == 1 and v, 15, what="fired"
        )
        (f,) = fired.firings
        assert (f.firing_id, f.at) == (due.firing_id, due.at)
        assert again.call("get_session", f.session_id).trigger_id == tid
        assert again.call("flush_state", 5.0)
        again.close()

        holder["owner"] = third = InProcessCoordinator(ProfileCoordinator(settings))
        (kept,) = third.call("get_trigger", tid).firings  # fired, not due again
        assert (kept.firing_id, kept.at, kept.state) == (due.firing_id, due.at, "fired")
        assert len(third.call("list_sessions")) == 2  # the busy one and the firing's
    finally:
        for a in agents:
            a.close(5)
        holder["owner"].close()


def test_a_trigger_changed_while_its_session_is_made_is_kept_as_changed(tmp_path: Path) -> None:
    """A PUT lands while a firing's session is being made (an await): what is kept after
    the firing is the trigger as changed, not the one read before the await."""
    from helpers import wait_until

    request = {**OOM, "session": {"next_steps": 1}, "cooldown_s": 600}
    first = _owner(tmp_path)
    try:
        agents = start_agents(first, 2, "actor")
        tid = first.call("add_trigger", request).trigger_id
        desk = first.coordinator._triggers
        real = desk._admission.admit

        async def admit_with_a_put_meanwhile(session: Any, origin: Any) -> Any:
            desk.replace(tid, {**request, "cooldown_s": 7})
            return await real(session, origin)

        desk._admission.admit = admit_with_a_put_meanwhile
        _oom(first, agents[0], 3)
        wait_until(lambda: first.call("get_trigger", tid).fired == 1, 10, what="fired")
        assert first.call("flush_state", 5.0)
        for a in agents:
            a.close(5)
    finally:
        first.close()

    again = _owner(tmp_path)
    try:
        back = again.call("get_trigger", tid)
        assert back.request["cooldown_s"] == 7 and back.fired == 1
        assert [f.state for f in back.firings] == ["fired"]
    finally:
        again.close()


def test_a_failed_firing_is_kept_and_its_number_not_given_again_after_a_restart(
    tmp_path: Path,
) -> None:
    """A firing that failed made no session to bring it back: the trigger keeps it (its id,
    when, why), and a restarted coordinator numbers new firings after it, so one id never
    names two."""
    from helpers import wait_until

    first = _owner(tmp_path)
    try:
        agents = start_agents(first, 2, "actor")
        first.call("create_session", {"steps": [100000]})  # holds the ranks: firings wait
        tid = first.call("add_trigger", {**OOM, "session": {"next_steps": 1}}).trigger_id
        _oom(first, agents[0], 3)
        due = wait_until(lambda: first.call("get_trigger", tid).firings, 10, what="due")[0]
        changed = {**OOM, "when": {"kind": "oom", "role": "critic"}}
        (failed,) = first.call("replace_trigger", tid, changed).firings  # condition changed
        assert (failed.firing_id, failed.state) == (due.firing_id, "failed")
        assert first.call("flush_state", 5.0)
        for a in agents:
            a.close(5)
    finally:
        first.close()

    again = _owner(tmp_path)
    try:
        (kept,) = again.call("get_trigger", tid).firings
        assert kept.model_dump() == failed.model_dump()
        (critic,) = start_agents(again, 1, "critic")
        _oom(again, critic, 4)
        fresh = wait_until(lambda: again.call("get_trigger", tid).firings[:-1], 10, what="new")
        assert again.call("get_trigger", tid).firings[-1].firing_id == failed.firing_id
        number = int(fresh[0].firing_id.rpartition(".")[2])  # (newest first)
        assert number > int(due.firing_id.rpartition(".")[2]), (fresh, due)
        critic.close(5)
    finally:
        again.close()
