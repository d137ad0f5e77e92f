"""What `profd down` counts as not profd's on the cluster it would stop: a node relay, which a
job's agents start (detached) and `profd down` stops with the rest, is profd's own."""

from __future__ import annotations

from typing import Any


class Bystander:
    def ping(self) -> str:
        return "ok"


def test_a_node_relay_is_profds_own_and_a_users_actor_is_not(ray_session: Any) -> None:
    import ray

    from profd.actors import get_or_create_relay, kill_relays
    from profd.actors.relay import relay_name
    from profd.cli.ray_cluster import cluster_tenants, is_profd_actor

    relay = get_or_create_relay(ray_session.node_id)
    user = ray.remote(Bystander).options(name="users-own", num_cpus=0).remote()
    try:
        ray.get(relay.ping.remote(), timeout=60)
        assert ray.get(user.ping.remote(), timeout=60) == "ok"
        whats = [t.what for t in cluster_tenants() if t.kind == "actor"]
        assert any("'users-own'" in w for w in whats), whats
        assert not any(relay_name(ray_session.node_id) in w for w in whats), whats
        assert is_profd_actor(relay_name("abc")) and not is_profd_actor("users-own")
    finally:
        ray.kill(user)
        kill_relays()
