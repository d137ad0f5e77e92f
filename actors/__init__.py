"""Ray actors of profd: the coordinator and the HTTP sidecar (installed as ``profd.actors``).

The actor classes are plain classes; ``ray.remote`` is applied here, where they are created.
"""

from __future__ import annotations

import logging
from typing import Any

from profd.core.constants import COORDINATOR_NAME, NAMESPACE, SIDECAR_NAME
from profd.core.ray_env import find_actor, find_coordinator, find_sidecar

__all__ = [
    "get_or_create_coordinator",
    "get_or_create_relay",
    "get_or_create_sidecar",
    "kill_named",
    "kill_relays",
]

log = logging.getLogger(__name__)

#: Enough concurrent calls for every agent's long-poll plus API traffic.
COORDINATOR_MAX_CONCURRENCY = 100_000
#: A node's agents: their long-polls, event reports and registrations at once.
RELAY_MAX_CONCURRENCY = 10_000


def _alive(handle: Any, timeout: float = 10.0) -> bool:
    """Whether a named actor answers ``ping`` (one that does not is going away: a new one
    takes its name once it is gone)."""
    import ray
    from ray.exceptions import RayError

    try:
        ray.get(handle.ping.remote(), timeout=timeout)
        return True
    except RayError as exc:
        log.info("the existing %s does not answer (%r); replacing it", handle, exc)
        return False


def _wait_name_free(name: str, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while find_actor(name) is not None and time.monotonic() < deadline:
        time.sleep(0.1)


def _head_affinity() -> Any:
    """Pin to the node of the calling process (the head, for ``profd up``)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def get_or_create_coordinator(settings: Any, *, detached: bool = True) -> tuple[Any, bool]:
    """Return ``(handle, created)``; the coordinator restarts with Ray if its process dies."""
    import ray

    from profd.actors.coordinator import ProfileCoordinator

    existing = find_coordinator()
    if existing is not None:
        if _alive(existing):
            return existing, False
        _wait_name_free(COORDINATOR_NAME)  # a coordinator that is going away
    opts: dict[str, Any] = dict(
        name=COORDINATOR_NAME,
        namespace=NAMESPACE,
        get_if_exists=True,
        num_cpus=0,
        max_restarts=-1,
        max_concurrency=COORDINATOR_MAX_CONCURRENCY,
        scheduling_strategy=_head_affinity(),
    )
    if detached:
        opts["lifetime"] = "detached"
    handle = ray.remote(ProfileCoordinator).options(**opts).remote(settings.model_dump())
    ray.get(handle.start.remote())  # constructed, and housekeeping runs on its loop
    return handle, True


def get_or_create_sidecar(config: Any, *, detached: bool = True) -> tuple[Any, bool]:
    """Start the HTTP sidecar on this node; return ``(handle, created)``."""
    import ray

    from profd.actors.sidecar import SidecarServer

    existing = find_sidecar()
    if existing is not None:
        if _alive(existing):
            return existing, False
        _wait_name_free(SIDECAR_NAME)
    opts: dict[str, Any] = dict(
        name=SIDECAR_NAME,
        namespace=NAMESPACE,
        get_if_exists=True,
        num_cpus=0,
        max_restarts=0,
        scheduling_strategy=_head_affinity(),
    )
    if detached:
        opts["lifetime"] = "detached"
    handle = ray.remote(SidecarServer).options(**opts).remote(config.model_dump())
    try:
        ray.get(handle.address.remote(), timeout=60)
    except Exception:
        ray.kill(handle)
        raise
    return handle, True


def get_or_create_relay(node_id: str) -> Any:
    """The relay of Ray node ``node_id`` (started there when missing; Ray restarts it when
    its process dies). Detached: it outlives the job that started it, until ``profd down``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from profd.actors.relay import NodeRelay, relay_name

    return (
        ray.remote(NodeRelay)
        .options(
            name=relay_name(node_id),
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            max_restarts=-1,
            max_concurrency=RELAY_MAX_CONCURRENCY,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(node_id)
    )


def kill_relays() -> list[str]:
    """Kill every node relay; their names."""
    import ray

    from profd.actors.relay import RELAY_PREFIX

    killed = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        ours = entry.get("namespace") == NAMESPACE and entry["name"].startswith(RELAY_PREFIX)
        if ours and kill_named(entry["name"]):
            killed.append(entry["name"])
    return killed


def kill_named(name: str) -> bool:
    import ray

    handle = find_actor(name)
    if handle is None:
        return False
    ray.kill(handle, no_restart=True)
    return True
