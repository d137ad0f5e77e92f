"""Load on the HTTP sidecar: polling clients plus session create / cancel churn.

A server process runs the real sidecar (uvicorn on 127.0.0.1, the app of ``profd up``, token
on) in front of a real coordinator (the ``ProfileCoordinator`` class on its own event-loop
thread, with its SQLite store), with ``--agents`` real agents that recorded one session (so the
trace index is not empty). This process runs ``--clients`` concurrent clients (asyncio +
httpx, one keep-alive connection each) for ``--duration`` seconds:

* pollers: ``GET /api/v1/status`` and ``GET /api/v1/traces`` in turn, one request every
  ``--interval`` seconds each (with random phase, as independent dashboards or scripts);
* ``--churn`` of the clients instead create a session and cancel it, every ``--interval``.
  Agents in one process cannot be held by two live sessions at once, so churn client 0
  targets the agents (explicit steps far ahead) and the others create launch-time sessions
  that wait for a role of their own (``wait_for_agents``), which hold no agent.

Latency is measured per request in the client, after ``--warmup`` seconds in which the
clients connect (those requests are not counted); an error is any non-2xx answer, a timeout
or a connection failure; the load generator freezes its heap at the end of the warm-up so
that its own garbage collections are not counted. Targets: 0 errors, p99 <= 50 ms. The
server also prints its own view (request start to response end inside uvicorn), which tells
the server's share of the latency from the clients' and the machine's.

    python bench/api_load.py [--clients 100] [--duration 60] [--interval 0.5] [--churn 4]
    python bench/api_load.py --ray   # as `profd up` serves: sidecar and coordinator actors

Last line: ``RESULT clients=100 requests=... errors=... p50_ms=... p99_ms=...``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TOKEN = "bench-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FAR_STEP = 10**9


# -- server process ---------------------------------------------------------------------------
class ThreadLoopClient:
    """The sidecar's coordinator client for a coordinator on another thread's event loop."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    async def call(self, method: str, *args: Any) -> Any:
        coro = getattr(self.owner.coordinator, method)(*args)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.owner.loop))


def _record_one_session(owner: Any, agents: list[Any]) -> None:
    import torch

    view = owner.call("create_session", {"steps": [1], "roles": {"actor": {"all_ranks": True}}})
    deadline = time.monotonic() + 20
    while not all(a.plan.windows for a in agents) and time.monotonic() < deadline:
        time.sleep(0.05)
    for a in agents:
        for n in (1, 2):
            with a.step(n), a.stage("work"):
                torch.ones(64, 64) @ torch.ones(64, 64)
    while time.monotonic() < deadline:
        if owner.call("get_session", view.session_id).state.is_terminal:
            return
        time.sleep(0.1)
    raise RuntimeError("the warm-up session did not finish")


class ServerTiming:
    """ASGI wrapper: time from request start to the end of the response, inside the server
    (tells the server's share of the latency from the clients' and the machine's)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seconds: list[float] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.seconds.append(time.perf_counter() - t0)


def serve(port_file: Path, n_agents: int, workdir: Path) -> None:
    import uvicorn

    from profd.actors.coordinator import ProfileCoordinator
    from profd.agent import ProfilerAgent
    from profd.api import create_app
    from profd.core.settings import CoordinatorSettings, SidecarConfig
    from profd.testing.coordinator import InProcessCoordinator

    settings = CoordinatorSettings(
        save_root=str(workdir / "profile"), base_dir=str(workdir), state_dir=str(workdir / "state")
    )
    owner = InProcessCoordinator(ProfileCoordinator(settings))
    agents = [
        ProfilerAgent("actor", r, n_agents, find_link=owner.link).start() for r in range(n_agents)
    ]
    deadline = time.monotonic() + 20
    while not all(a.connected for a in agents):
        if time.monotonic() > deadline:
            raise RuntimeError("agents did not register")
        time.sleep(0.05)
    _record_one_session(owner, agents)
    app = ServerTiming(
        create_app(
            SidecarConfig(token=TOKEN, port=0, freeze_gc=True),  # as `profd up` starts it
            client=ThreadLoopClient(owner),
        )
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", access_log=False, lifespan="on"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    port_file.write_text(str(port))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    logging.getLogger("profd").setLevel(logging.ERROR)  # agents closing: nothing to report
    server.should_exit = True
    thread.join(10)
    if app.seconds:
        print(
            f"server side: n={len(app.seconds)} p50={pct(app.seconds, 0.5):.2f} ms "
            f"p99={pct(app.seconds, 0.99):.2f} ms",
            flush=True,
        )
    for a in agents:
        a.close(timeout=5)
    owner.close()


class RayOwner:
    """``owner.call(...)`` on the coordinator actor (as :class:`InProcessCoordinator` offers)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.handle, method).remote(*args), timeout=60)


def serve_ray(port_file: Path, n_agents: int, workdir: Path) -> None:
    """What `profd up` runs: the sidecar actor (uvicorn inside it) calling the coordinator
    actor through Ray on every request, on a local Ray on 127.0.0.1."""
    from profd.cli.ray_cluster import start_services, stop_services
    from profd.core.ray_env import init_local_ray

    init_local_ray()  # before the agents: they find the coordinator through Ray
    import ray

    from profd.agent import ProfilerAgent
    from profd.core.settings import CoordinatorSettings, SidecarConfig

    settings = CoordinatorSettings(
        save_root=str(workdir / "profile"), base_dir=str(workdir), state_dir=str(workdir / "state")
    )
    services = start_services(
        settings, SidecarConfig(token=TOKEN, port=0, freeze_gc=True), detached=False
    )
    agents = [ProfilerAgent("actor", r, n_agents).start() for r in range(n_agents)]
    deadline = time.monotonic() + 60
    while not all(a.connected for a in agents):
        if time.monotonic() > deadline:
            raise RuntimeError("agents did not register")
        time.sleep(0.05)
    _record_one_session(RayOwner(services.coordinator), agents)
    port_file.write_text(str(services.address["port"]))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    logging.getLogger("profd").setLevel(logging.ERROR)
    for a in agents:
        a.close(timeout=5)
    stop_services()
    ray.shutdown()


# -- load ---------------------------------------------------------------------------------
class Tally:
    """Latencies and errors of requests that started after ``start`` (the warm-up is not
    counted: it opens the connections)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.latencies: dict[str, list[float]] = {}
        self.errors: dict[str, int] = {}
        self.lag: list[float] = []

    def add(self, route: str, seconds: float, ok: bool, why: str = "") -> None:
        if time.monotonic() - seconds < self.start:
            return
        self.latencies.setdefault(route, []).append(seconds)
        if not ok:
            key = f"{route}: {why}"
            self.errors[key] = self.errors.get(key, 0) + 1


async def timed(client: Any, tally: Tally, route: str, method: str, path: str, **kw: Any) -> Any:
    import httpx

    t0 = time.perf_counter()
    try:
        r = await client.request(method, path, **kw)
    except httpx.HTTPError as exc:
        tally.add(route, time.perf_counter() - t0, False, type(exc).__name__)
        return None
    ok = 200 <= r.status_code < 300
    tally.add(route, time.perf_counter() - t0, ok, f"HTTP {r.status_code} {r.text[:120]}")
    return r.json() if ok else None


async def poller(url: str, tally: Tally, deadline: float, interval: float) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        await asyncio.sleep(random.uniform(0, interval))
        turn = 0
        while time.monotonic() < deadline:
            start = time.monotonic()
            if turn % 2 == 0:
                await timed(client, tally, "GET status", "GET", "/api/v1/status")
            else:
                await timed(client, tally, "GET traces", "GET", "/api/v1/traces")
            turn += 1
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - start)))


async def churner(url: str, tally: Tally, deadline: float, interval: float, index: int) -> None:
    import httpx

    if index == 0:
        body: dict[str, Any] = {"steps": [FAR_STEP], "roles": {"actor": {"all_ranks": True}}}
    else:
        body = {"steps": [FAR_STEP], "roles": {f"late{index}": {}}, "wait_for_agents": True}
    async with httpx.AsyncClient(base_url=url, timeout=10, headers=AUTH) as client:
        await asyncio.sleep(random.uniform(0, interval))
        while time.monotonic() < deadline:
            start = time.monotonic()
            view = await timed(
                client, tally, "POST sessions", "POST", "/api/v1/sessions", json=body
            )
            if view is not None:
                sid = view["session_id"]
                await timed(client, tally, "POST cancel", "POST", f"/api/v1/sessions/{sid}/cancel")
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - start)))


async def load(
    url: str, clients: int, churn: int, duration: float, interval: float, warmup: float = 2.0
) -> Tally:
    tally = Tally(time.monotonic() + warmup)
    deadline = tally.start + duration
    tasks = [churner(url, tally, deadline, interval, i) for i in range(churn)]
    tasks += [poller(url, tally, deadline, interval) for _ in range(clients - churn)]
    await asyncio.gather(settle(tally), lag_monitor(tally, deadline), *tasks)
    return tally


async def settle(tally: Tally) -> None:
    """Near the end of the warm-up, when every client holds its connection: freeze this
    process's heap, so the load generator's own full collections do not count as latency."""
    await asyncio.sleep(max(0.0, tally.start - time.monotonic() - 0.5))
    gc.collect()
    gc.freeze()


async def lag_monitor(tally: Tally, deadline: float, period: float = 0.005) -> None:
    """How late this process's event loop wakes up: the clients' own share of the latency
    (a CPU-starved load generator shows up here, not as server time)."""
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        await asyncio.sleep(period)
        late = time.perf_counter() - t0 - period
        if time.monotonic() - late >= tally.start:
            tally.lag.append(max(0.0, late))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def report(tally: Tally, clients: int, duration: float, mode: str) -> None:
    every = [v for vs in tally.latencies.values() for v in vs]
    for route, vs in sorted(tally.latencies.items()):
        print(
            f"{route:14s} n={len(vs):6d} p50={pct(vs, 0.5):6.2f} ms p99={pct(vs, 0.99):6.2f} ms "
            f"max={max(vs) * 1000:7.2f} ms"
        )
    for why, n in sorted(tally.errors.items()):
        print(f"error x{n}: {why}")
    errors = sum(tally.errors.values())
    if tally.lag:
        print(
            f"client event-loop lag p50={pct(tally.lag, 0.5):.2f} ms "
            f"p99={pct(tally.lag, 0.99):.2f} ms max={max(tally.lag) * 1000:.2f} ms"
        )
    print(f"throughput {len(every) / duration:.0f} req/s over {duration:.0f} s")
    print(
        f"RESULT clients={clients} requests={len(every)} errors={errors} "
        f"p50_ms={pct(every, 0.5):.2f} p99_ms={pct(every, 0.99):.2f} mode={mode}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between requests")
    parser.add_argument("--churn", type=int, default=4, help="clients doing create / cancel")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds not measured")
    parser.add_argument(
        "--ray",
        action="store_true",
        help="serve as `profd up` does: sidecar and coordinator as Ray actors (every request "
        "makes a Ray call); default: both in one server process",
    )
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        (serve_ray if args.ray else serve)(args.serve, args.agents, args.workdir)
        return
    if not 0 <= args.churn <= args.clients:
        parser.error("--churn must be between 0 and --clients")
    with tempfile.TemporaryDirectory(prefix="profd-api-load-") as tmp:
        port_file = Path(tmp) / "port"
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        cmd = [sys.executable, __file__, "--serve", str(port_file), "--workdir", tmp]
        cmd += ["--agents", str(args.agents), *(["--ray"] if args.ray else [])]
        server = subprocess.Popen(cmd, env=env)
        try:
            deadline = time.monotonic() + 120
            while not port_file.exists():
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the sidecar did not start")
                time.sleep(0.1)
            url = f"http://127.0.0.1:{port_file.read_text()}"
            print(
                f"sidecar {url}: {args.clients} clients ({args.churn} churning), "
                f"one request per {args.interval} s each, {args.duration:.0f} s "
                f"after {args.warmup:.0f} s of warm-up"
            )
            tally = asyncio.run(
                load(url, args.clients, args.churn, args.duration, args.interval, args.warmup)
            )
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
    report(tally, args.clients, args.duration, "ray-actors" if args.ray else "one-process")


if __name__ == "__main__":
    main()
