"""Helpers shared by the tests (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from profd.testing.server import free_port  # noqa: F401  (used by tests)

#: The one bearer token of the test suite: the sidecars the tests start (in process, as Ray
#: actors, through ``profd up``) and the token files they write. Distinctive on purpose: tests
#: assert that it never shows up in a page.
TOKEN = "s3cret-test-token-5e1f"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def wait_until(
    predicate: Any, timeout: float = 30.0, interval: float = 0.05, what: str = ""
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")


def coordinator_settings(tmp_path: Path, **overrides: Any) -> Any:
    from profd.core.settings import CoordinatorSettings

    values = dict(
        save_root=str(tmp_path / "profile"),
        base_dir=str(tmp_path),
        # Persist as `profd up` does, so every API test also exercises the SQLite store.
        state_dir=str(tmp_path / "state"),
        poll_timeout_s=1.0,
        heartbeat_timeout_s=6.0,
        align_timeout_s=1.0,
        tick_s=0.2,
    )
    values.update(overrides)
    return CoordinatorSettings(**values)


class LoopClient:
    """Calls a coordinator that lives on an :class:`InProcessCoordinator` loop from any loop
    (uvicorn's, in API tests)."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    async def call(self, method: str, *args: Any) -> Any:
        import asyncio

        coro = getattr(self.owner.coordinator, method)(*args)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.owner.loop))


def start_agents(owner: Any, n: int = 1, role: str = "actor", **kw: Any) -> list[Any]:
    """``n`` agents of one role, registered with an in-process coordinator."""
    from profd.agent import ProfilerAgent

    agents = [ProfilerAgent(role, r, n, find_link=owner.link, **kw).start() for r in range(n)]
    wait_until(lambda: all(a.connected for a in agents), 10, what="agents registered")
    return agents


def wait_terminal(owner: Any, sid: str, timeout: float = 20.0) -> Any:
    def done() -> Any:
        view = owner.call("get_session", sid)
        return view if view.state.is_terminal else None

    return wait_until(done, timeout, what=f"session {sid} terminal")


def wait_armed(agent: Any, sid: str) -> None:
    wait_until(lambda: any(w.session_id == sid for w in agent.plan.windows), 10, what="plan")


def user_ranges(trace: dict) -> list[str]:
    return [e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]


def busy_python_work(seconds: float) -> int:
    """Pure-Python work for a while (what py-spy should find by name)."""
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += sum(i * i for i in range(200))
    return n


@dataclass(frozen=True)
class Sidecar:
    """A real uvicorn sidecar on 127.0.0.1 around an in-process coordinator (see
    :func:`start_sidecar`). ``with`` stops it at the end of the block; :meth:`stop` is
    idempotent, so the fixtures' tear-down may stop it again."""

    url: str
    token: str | None
    owner: Any  # the InProcessCoordinator behind it
    app: Any  # the FastAPI app: its config, dependency_overrides
    _server: Any = field(repr=False)
    _thread: threading.Thread = field(repr=False)
    _socket: socket.socket = field(repr=False)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def config(self) -> Any:
        return self.app.state.config

    @property
    def headers(self) -> dict[str, str]:
        """The bearer header for this sidecar's token (empty without one)."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def client(self, *, auth: bool = True, **kw: Any) -> Any:
        """An ``httpx.Client`` on this sidecar, sending the token unless ``auth=False``."""
        import httpx

        return httpx.Client(base_url=self.url, headers=self.headers if auth else {}, **kw)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        if self._thread.is_alive():  # a request still open past the graceful shutdown
            self._server.force_exit = True
            self._thread.join(5)
        self._socket.close()
        assert not self._thread.is_alive(), f"the sidecar on {self.url} did not stop"

    def __enter__(self) -> Sidecar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_sidecar(
    owner: Any,
    *,
    token: str | None = TOKEN,
    read_cache_s: float | None = None,
    client: Any = None,
    dependency_overrides: dict[Callable[..., Any], Callable[..., Any]] | None = None,
    port: int = 0,
    **config: Any,
) -> Sidecar:
    """Serve ``create_app`` on 127.0.0.1 (a port bound here first: no race for a free one)
    around the in-process coordinator ``owner``, and wait until uvicorn has started.

    ``token``: the bearer token (None: none configured). ``config``: any other
    :class:`~profd.core.settings.SidecarConfig` field (``host``, ``allow_hook_commands``,
    ``upload_prefixes``, ``save_roots``, ``base_dir``, ``allowed_hosts``, ``freeze_gc``, ...).
    ``read_cache_s``: share reads for that long, as ``profd up`` runs it (``SharedReads``);
    by default every request reaches the coordinator. ``client``: another coordinator client
    than the coordinator's own. ``dependency_overrides``: FastAPI overrides (``get_client``,
    ``get_runner``, ...) set before it starts. ``port``: a given one (a restarted sidecar
    where the last one ran); by default a free one.
    """
    import uvicorn

    from profd.api import create_app
    from profd.api.client import SharedReads
    from profd.core.settings import SidecarConfig

    if read_cache_s is not None:
        config["read_cache_s"] = read_cache_s
    settings = SidecarConfig(token=token, **config)
    inner = client if client is not None else LoopClient(owner)
    if read_cache_s:
        inner = SharedReads(inner, ttl_s=read_cache_s)
    app = create_app(settings, client=inner)
    app.dependency_overrides.update(dependency_overrides or {})

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    failed: list[BaseException] = []

    def serve() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # a failed startup ends in sys.exit inside uvicorn
            failed.append(exc)

    thread = threading.Thread(target=serve, name=f"sidecar-{port}", daemon=True)
    sidecar = Sidecar(f"http://127.0.0.1:{port}", token, owner, app, server, thread, sock)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sidecar.stop()
            raise RuntimeError(f"the sidecar did not start on {sidecar.url}: {failed}")
        time.sleep(0.01)
    return sidecar
