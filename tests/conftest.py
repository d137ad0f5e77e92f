"""Shared fixtures: one real local Ray per test session (on 127.0.0.1), a fresh coordinator
per test, an in-process coordinator for fast agent tests, and real uvicorn sidecars around it.

The suite's one bearer token is :data:`helpers.TOKEN` (``from helpers import TOKEN, AUTH``):
it lives in ``helpers`` because this module is not meant to be imported by tests."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from helpers import Sidecar, coordinator_settings, start_sidecar, wait_until

for _k, _v in {
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}.items():
    os.environ.setdefault(_k, _v)


def _terminated(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends it at once
    raise KeyboardInterrupt("SIGTERM")


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERM'd run (a CI timeout, ``kill``) ends as an interrupted one: fixtures and
    ``pytest_unconfigure`` still run, so the background vLLM server and Ray are stopped
    instead of outliving the run (a SIGTERM'd run used to leave the vLLM server running)."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _terminated)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Any]:
    """A real two-node Ray cluster on 127.0.0.1, started once for the whole test session.

    The head runs the driver, the coordinator and the sidecar; the second node carries the
    custom resource ``node_b`` so tests can place workers there.
    """
    import ray
    from ray.cluster_utils import Cluster

    from profd.core.constants import NAMESPACE

    c = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": 4, "include_dashboard": False},
    )
    c.add_node(num_cpus=2, resources={"node_b": 1})
    c.wait_for_nodes()
    ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="session")
def ray_session(cluster: Any) -> Any:
    """The test session's Ray (see :func:`cluster`); its ``address_info`` like ``ray.init``."""
    import ray

    ctx = ray.get_runtime_context()
    return type(
        "RaySession",
        (),
        {"address_info": {"address": cluster.address}, "node_id": ctx.get_node_id()},
    )()


def _kill_services() -> None:
    from profd.cli.ray_cluster import stop_services
    from profd.core.ray_env import find_coordinator, find_sidecar

    stop_services()
    gone = lambda: find_coordinator() is None and find_sidecar() is None  # noqa: E731
    wait_until(gone, 30, what="actors gone")


@pytest.fixture
def ray_coordinator(ray_session: Any, tmp_path: Path) -> Iterator[Any]:
    """A fresh named coordinator actor for one test."""
    from profd.actors import get_or_create_coordinator

    _kill_services()
    handle, created = get_or_create_coordinator(coordinator_settings(tmp_path), detached=False)
    assert created
    yield handle
    _kill_services()


@pytest.fixture
def local_coordinator(tmp_path: Path) -> Iterator[Any]:
    """A coordinator running in this process on its own event-loop thread."""
    from profd.actors.coordinator import ProfileCoordinator
    from profd.testing.coordinator import InProcessCoordinator

    owner = InProcessCoordinator(ProfileCoordinator(coordinator_settings(tmp_path)))
    yield owner
    owner.close()


@pytest.fixture
def make_sidecar(local_coordinator: Any) -> Iterator[Callable[..., Sidecar]]:
    """``make_sidecar(**overrides)``: a real uvicorn sidecar on 127.0.0.1 (a free port, started
    and ready) around :func:`local_coordinator`, as a frozen :class:`helpers.Sidecar` (``url``,
    ``token``, ``owner``, ``app``, ``headers``, ``client()``).

    By default it has the suite's token (:data:`helpers.TOKEN`) and :class:`SidecarConfig`'s
    defaults; ``overrides`` are those of :func:`helpers.start_sidecar` (``token=None``, any
    config field such as ``host``, ``allowed_hosts``, ``allow_hook_commands``,
    ``upload_prefixes``, ``base_dir``, ``read_cache_s``; ``dependency_overrides``). Any number
    may run at once; every one still running is stopped at tear-down, before the coordinator
    closes (``with make_sidecar(...) as sc:`` stops one earlier)."""
    with ExitStack() as stack:

        def make(**overrides: Any) -> Sidecar:
            return stack.enter_context(start_sidecar(local_coordinator, **overrides))

        yield make


@pytest.fixture
def sidecar(make_sidecar: Callable[..., Sidecar]) -> Sidecar:
    """The default sidecar of :func:`make_sidecar`: loopback, the suite's token."""
    return make_sidecar()
