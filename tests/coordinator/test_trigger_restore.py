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
