"""profd: a profiling control plane for PyTorch training on Ray.

In a worker::

    agent = profd.attach(role="actor", rank=rank, world_size=world)
    with agent.step(global_step):
        with agent.stage("update_actor", update_loop=True):
            for i, mb in enumerate(mini_batches):
                with agent.mini_batch(i):
                    ...

Importing profd starts nothing and imports neither Ray nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from profd.core.constants import __version__

__all__ = [
    "ProfilerAgent",
    "SessionRequest",
    "__version__",
    "attach",
    "attach_rollout",
    "controller",
    "join_or_start_ray",
    "start_session",
    "wait_session",
]

if TYPE_CHECKING:
    from profd.agent import ProfilerAgent
    from profd.core.request import SessionRequest


def attach(
    role: str,
    rank: int | None = None,
    world_size: int | None = None,
    topology: dict[str, int] | None = None,
    **kwargs: Any,
) -> ProfilerAgent:
    """Attach this worker to profd; see :func:`profd.agent.attach`."""
    from profd.agent import attach as _attach

    return _attach(role, rank, world_size, topology, **kwargs)


def controller() -> Any:
    """The single-controller driver's handle: ``with profd.controller().step(n): ...``."""
    from profd.driver.controller import controller as _controller

    return _controller()


def attach_rollout(replica: int, parallelism: Any, engine: Any, **kwargs: Any) -> Any:
    """Register a rollout replica; see :func:`profd.rollout.service.attach_rollout`."""
    from profd.rollout.service import attach_rollout as _attach

    return _attach(replica, parallelism, engine, **kwargs)


def start_session(config: Any, **kwargs: Any) -> Any:
    """Declare a session at job start (verl or profd layout); see :mod:`profd.driver.launch`."""
    from profd.driver.launch import start_session as _start

    return _start(config, **kwargs)


def join_or_start_ray(address: str | None = None, num_cpus: int = 4) -> None:
    """For a job script, before its first ``import ray``: join the cluster at ``address`` (or
    ``$RAY_ADDRESS``), else start a private Ray on 127.0.0.1; see
    :func:`profd.core.ray_env.join_or_start_ray`."""
    from profd.core.ray_env import join_or_start_ray as _join

    _join(address, num_cpus)


def wait_session(session_id: str, timeout: float = 120.0) -> Any:
    """Wait for a session to end; see :func:`profd.driver.launch.wait_session`."""
    from profd.driver.launch import wait_session as _wait

    return _wait(session_id, timeout)


def __getattr__(name: str) -> Any:
    # Lazy, so `import profd` stays cheap and side-effect free.
    if name == "ProfilerAgent":
        from profd.agent import ProfilerAgent

        return ProfilerAgent
    if name == "SessionRequest":
        from profd.core.request import SessionRequest

        return SessionRequest
    raise AttributeError(f"module 'profd' has no attribute {name!r}")
