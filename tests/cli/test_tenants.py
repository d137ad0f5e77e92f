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


LEAVES_AN_ACTOR = r"""
import sys
import ray

ray.init(address=sys.argv[1], namespace="profd-test-left")

@ray.remote(num_cpus=0)
class Left:
    def ping(self):
        return "ok"

actor = Left.options(name="left-behind", lifetime="detached").remote()
assert ray.get(actor.ping.remote(), timeout=60) == "ok"
"""


def test_an_actor_left_by_a_job_that_ended_says_so(ray_session: Any) -> None:
    """A detached actor outlives its job (Ray Train leaves one): `profd down` names it as
    left by a job that has ended, so the user knows no driver of theirs still runs."""
    import subprocess
    import sys

    import ray

    from profd.cli.ray_cluster import cluster_tenants

    address = ray_session.address_info["address"]
    r = subprocess.run(
        [sys.executable, "-c", LEAVES_AN_ACTOR, address], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    try:
        (left,) = [t for t in cluster_tenants() if "'left-behind'" in t.what]
        assert left.kind == "actor" and left.job_ended, left
        assert "left by that job, which has ended (detached)" in left.describe()
        own = [t for t in cluster_tenants() if t.kind == "actor" and not t.job_ended]
        assert all("'left-behind'" not in t.what for t in own)
    finally:
        ray.kill(ray.get_actor("left-behind", namespace="profd-test-left"))
