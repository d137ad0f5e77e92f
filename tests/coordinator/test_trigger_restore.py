"""Triggers are part of the coordinator's state: a coordinator restarted from its state
directory (Ray restarting it, or `profd up` after the coordinator was killed) watches the
same triggers, with the same ids and requests; a deleted one stays deleted, and a straggler
trigger's role is timed with its ends again (its agents' plans say so)."""

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
        assert first.call("flush_state", 5.0)
    finally:
        first.close()

    again = _owner(tmp_path)
    try:
        (back,) = again.call("list_triggers")
        assert back.trigger_id == late.trigger_id and back.name == "late-update"
        assert back.request == late.request and back.created_at == late.created_at
        assert back.fired == 0 and back.firings == []  # its counts start again
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
