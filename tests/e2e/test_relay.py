"""Per-node relays on the real two-node Ray of the test session: by default the job's workers
reach the coordinator through their node's relay (started by the node's first agent, which
registers directly meanwhile), over the relay's Unix socket; a relay's death never stops a
session, its agents go straight to the coordinator, and move back when it returns.
``PROFD_RELAY=0`` keeps a worker direct."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from helpers import wait_until

pytestmark = pytest.mark.slow

ENV = {"PROFD_RELAY_RETRY_S": "1"}  # relays are on without PROFD_RELAY
DIRECT = {"PROFD_RELAY": "0"}


def _workers(specs: list[tuple[str, int, int, bool]], env: dict[str, str] = ENV) -> list[Any]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from profd.demo.workload import DemoWorker

    head = ray.get_runtime_context().get_node_id()
    made = []
    for role, rank, world, on_b in specs:
        opts: dict[str, Any] = {"num_cpus": 0, "runtime_env": {"env_vars": env}}
        if on_b:
            opts["resources"] = {"node_b": 0.01}
        else:  # the head: the test process's node
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(head, soft=False)
        made.append(ray.remote(DemoWorker).options(**opts).remote(role, rank, world, seed=1))
    ray.get([w.ready.remote() for w in made], timeout=120)
    return made


def _agents(coord: Any) -> list[Any]:
    import ray

    return ray.get(coord.list_agents.remote(), timeout=30)


def _relays() -> dict[str, Any]:
    import ray

    from profd.actors.relay import RELAY_PREFIX
    from profd.core.constants import NAMESPACE

    out = {}
    for e in ray.util.list_named_actors(all_namespaces=True):
        if e["namespace"] != NAMESPACE or not e["name"].startswith(RELAY_PREFIX):
            continue
        try:
            out[e["name"]] = ray.get_actor(e["name"], namespace=NAMESPACE)
        except ValueError:  # listed, then dead by the lookup (a kill racing the listing)
            continue
    return out


def _parked(relay: Any, n: int) -> None:
    """Wait until ``n`` agents poll ``relay`` (registered, clock measured, parked there)."""
    import ray

    def parked() -> bool:
        s = ray.get(relay.stats.remote(), timeout=10)
        return s.agents == n and s.parked_polls == n

    wait_until(parked, 30, 0.05, what=f"{n} agents parked at {relay}")


def _links(coord: Any) -> list[str | None]:
    """How the relayed workers (role ``actor``) reach the coordinator."""
    return sorted(str(a.link) for a in _agents(coord) if a.state == "alive" and a.role == "actor")


def _session(coord: Any) -> Any:
    """A ``next_steps`` session on every worker (placed from the steps the agents report
    when asked, through their relays); its final view."""
    import ray

    request = {"next_steps": 1, "roles": {"*": {"all_ranks": True}}}
    view = ray.get(coord.create_session.remote(request), timeout=60)

    def ended() -> Any:
        v = ray.get(coord.get_session.remote(view.session_id))
        return v if v.state.is_terminal else None

    return wait_until(ended, 120, 0.2, what="session end")


def test_agents_poll_their_nodes_relay_and_survive_its_death(ray_coordinator) -> None:
    import ray

    coord = ray_coordinator
    ws = _workers([("actor", 0, 3, False), ("actor", 1, 3, False), ("actor", 2, 3, True)])
    ws += _workers([("critic", 0, 1, False)], DIRECT)
    try:
        nodes = Counter(ray.get([w.node_id.remote() for w in ws[:3]], timeout=30))
        for w in ws:  # the job: steps until the test kills it (an actor runs one call at once)
            w.run.remote(100_000, 0.5)
        final = _check(coord, nodes)
        assert final.state == "done", final.reason
        assert sorted((t.role, t.rank) for t in final.traces) == [
            ("actor", 0), ("actor", 1), ("actor", 2), ("critic", 0)
        ]  # fmt: skip
        (critic,) = [a for a in _agents(coord) if a.role == "critic"]
        assert str(critic.link) == "direct"  # PROFD_RELAY=0: never through a relay
    finally:
        for w in ws:
            ray.kill(w)


def _check(coord: Any, nodes: Counter[str]) -> Any:
    """Returns the last session's view, after the relay came back."""
    import ray

    from profd.actors.relay import relay_name

    wait_until(lambda: _links(coord) == ["relay"] * 3, 60, 0.2, what="agents via relays")
    wait_until(lambda: all(a.current_step for a in _agents(coord)), 60, 0.2, what="stepping")
    assert len(nodes) == 2
    relays = _relays()
    assert set(relays) == {relay_name(n) for n in nodes}  # one per node that hosts agents
    for node, n in nodes.items():  # each agent polls its own node's relay, parked there
        _parked(relays[relay_name(node)], n)
    head = relay_name(nodes.most_common(1)[0][0])

    final = _session(coord)
    assert final.state == "done", final.reason
    after = {n: ray.get(r.stats.remote()) for n, r in relays.items()}
    assert after[head].events_sent > 0 and after[head].reports_sent < after[head].events_sent
    assert all(s.pushes > 0 for s in after.values())  # plans pushed to each relay actor
    for node, n in nodes.items():  # the workers call their relay over its Unix socket
        assert after[relay_name(node)].socket_connections >= n, after

    # killed for good: its agents go to the coordinator directly, then start it again
    ray.kill(relays[head], no_restart=True)
    wait_until(lambda: head not in _relays(), 30, 0.1, what="relay gone")
    wait_until(lambda: head in _relays(), 60, 0.2, what="relay started again by its agents")
    wait_until(lambda: _links(coord) == ["relay"] * 3, 60, 0.2, what="agents back on relays")
    _parked(_relays()[head], nodes.most_common(1)[0][1])
    final = _session(coord)
    assert final.state == "done", final.reason
    back = ray.get(_relays()[head].stats.remote())  # the new process's socket, taken again
    assert back.socket_connections >= nodes.most_common(1)[0][1], back
    return final
