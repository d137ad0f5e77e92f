"""The Ray environment of this process, for every part of profd: which node, job and GCS it
belongs to, whether that GCS answers, how to join or start a loopback Ray, how to find profd's
coordinator and call it. The one place that asks Ray these questions.

Ray is imported inside functions only, so importing this module starts nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from profd.core.constants import COORDINATOR_NAME, NAMESPACE, SIDECAR_NAME
from profd.core.errors import CoordinatorUnavailable, ProfdError

__all__ = [
    "LOOPBACK_ENV",
    "RayContext",
    "acall_coordinator",
    "apply_loopback_env",
    "call_coordinator",
    "connect_ray",
    "current_address",
    "find_actor",
    "find_coordinator",
    "find_sidecar",
    "gcs_probe",
    "gcs_reachable",
    "init_local_ray",
    "is_local_address",
    "join_or_start_ray",
    "process_start",
    "ray_context",
    "ray_node",
    "ray_up",
]

log = logging.getLogger(__name__)


#: Keeps a local Ray on 127.0.0.1, without token auth or usage reporting (environment.md).
LOOPBACK_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def apply_loopback_env() -> None:
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field
    22); ``None`` where there is no such process or no ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count after the last ')'
    try:
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def init_local_ray(num_cpus: int = 4) -> None:
    """Start a private Ray in this process on 127.0.0.1 (the demo, benchmarks)."""
    apply_loopback_env()
    import ray

    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        namespace=NAMESPACE,
        log_to_driver=False,
    )


@dataclass(frozen=True)
class RayContext:
    """Where this process stands in Ray (all ``None`` outside Ray)."""

    node_id: str | None = None
    node_ip: str | None = None
    job_id: str | None = None  # a worker's is its driver's
    gcs_address: str | None = None


def ray_context() -> RayContext:
    """This process's node, job and GCS address, when it is part of a Ray cluster."""
    try:
        if ray_up():
            import ray

            ctx = ray.get_runtime_context()
            return RayContext(
                ctx.get_node_id(),
                ray.util.get_node_ip_address(),
                ctx.get_job_id(),
                ctx.gcs_address,
            )
    except Exception as exc:  # never-break-training boundary: an agent attaches without it
        log.warning("profd: could not read this process's Ray context: %r", exc)
    return RayContext()


def ray_node() -> tuple[str | None, str | None]:
    """(node id, node address) of this process when it is part of a Ray cluster."""
    ctx = ray_context()
    return ctx.node_id, ctx.node_ip


def is_local_address(address: str | None) -> bool:
    """A Ray profd starts itself, or one explicitly on loopback. ``auto`` is not: it may be a
    routable cluster with its own settings (token auth, ...), which profd must not override."""
    return address in (None, "local") or str(address).split(":")[0] in ("127.0.0.1", "localhost")


def gcs_reachable(address: str, timeout: float = 3.0) -> bool:
    """A quick TCP check, so a vanished cluster fails fast instead of Ray retrying for minutes."""
    return gcs_probe(address, timeout) is True


def gcs_probe(address: str, timeout: float) -> bool | None:
    """``True``: the GCS accepts a connection; ``False``: it is refused (nothing listens: the
    GCS is gone); ``None``: no answer within ``timeout`` (a lost packet, a far or busy node —
    not proof of anything)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            return True
    except (ConnectionRefusedError, ValueError):
        return False
    except OSError:
        return None


def join_or_start_ray(address: str | None = None, num_cpus: int = 4) -> None:
    """For a job script: join the cluster at ``address`` (or ``$RAY_ADDRESS``, as under
    ``ray job submit``); with neither, start a private Ray on 127.0.0.1. A Ray this process
    already joined (a test, a notebook) is kept.

    A Ray started here, or one at a 127.0.0.1 address, gets the loopback settings before
    Ray is imported (it reads them at import); a cluster elsewhere keeps its own settings,
    token auth included. So a script calls this before its first ``import ray``.
    """
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        init_local_ray(num_cpus=num_cpus)
    else:
        connect_ray(address)


def connect_ray(address: str | None, quiet: bool = False) -> None:
    """Join the cluster at ``address`` (``auto`` = the one on this node); ``quiet``: Ray's
    own INFO lines ("Connecting to existing Ray cluster ...") are not shown (profd's CLI:
    they are not its output); a user's driver keeps them.

    For a cluster on this machine the loopback settings are applied *before* Ray is imported
    (Ray reads them at import); for remote clusters nothing is changed.
    """
    if is_local_address(address):
        apply_loopback_env()
    if address not in (None, "auto", "local") and not gcs_reachable(str(address)):
        raise ConnectionError(f"no Ray cluster answers at {address}")
    import ray

    if not ray.is_initialized():
        ray.init(
            address=address or "auto",
            namespace=NAMESPACE,
            log_to_driver=False,
            logging_level=logging.WARNING if quiet else logging.INFO,
        )


def current_address() -> str | None:
    """The resolved GCS address of the cluster this process joined (never ``auto``)."""
    return ray_context().gcs_address


def ray_up() -> bool:
    """This process has joined a Ray cluster. Never imports Ray: a process that did not
    import it has not joined one."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(getattr(ray, "is_initialized", lambda: False)())


def find_actor(name: str) -> Any | None:
    """One of profd's named actors, or ``None`` when Ray is down or there is no such actor."""
    if not ray_up():
        return None
    import ray

    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:  # Ray's answer for "no actor of that name"
        return None


def find_coordinator() -> Any | None:
    return find_actor(COORDINATOR_NAME)


def find_sidecar() -> Any | None:
    return find_actor(SIDECAR_NAME)


def _unanswered() -> tuple[type[BaseException], ...]:
    """Ray's errors that mean "the actor did not answer": dead, restarting, unreachable, slow."""
    from ray import exceptions as rx

    return (rx.RayActorError, rx.GetTimeoutError, rx.RaySystemError, rx.ObjectLostError)


def _reraise(method: str, exc: BaseException) -> None:
    from ray.exceptions import RayTaskError

    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, ProfdError):  # the coordinator's own answer (404, 409, 422)
            raise cause from None
        raise exc
    if isinstance(exc, _unanswered()):
        if "restarting" in str(exc).lower():  # Ray's ActorUnavailableError, in its words
            message = (
                f"the profd coordinator is restarting (Ray restarts it after a crash, from its "
                f"state); {method} can be asked again in a few seconds"
            )
        else:
            message = f"the profd coordinator did not answer {method}: {exc}"
        raise CoordinatorUnavailable(message) from exc
    raise exc


def call_coordinator(handle: Any, method: str, *args: Any, timeout: float | None) -> Any:
    """Call ``method`` on the coordinator actor and wait at most ``timeout`` seconds. Raises
    :class:`CoordinatorUnavailable` when it does not answer, its own errors as themselves."""
    import ray

    try:
        return ray.get(getattr(handle, method).remote(*args), timeout=timeout)
    except Exception as exc:
        _reraise(method, exc)


async def acall_coordinator(handle: Any, method: str, *args: Any) -> Any:
    """:func:`call_coordinator` for an event loop (the sidecar)."""
    try:
        return await getattr(handle, method).remote(*args)
    except Exception as exc:
        # a JSON read is named by the read it makes
        _reraise(f"{args[0]} (read_json)" if method == "read_json" and args else method, exc)
