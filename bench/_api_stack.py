"""The server side of ``bench/api_load.py``: a store of past sessions, agents that step, and
the coordinator and sidecar serving them (as ``profd up`` does, or in one process).

**Past sessions.** A few sessions are recorded for real first (a coordinator in this process
with its SQLite store, 16 agents on a small training step — forward, backward and an
optimizer step in stages, mini-batches marked — under ``torch.profiler``): 16 ranks x 2 steps,
2 ranks x 1 step, 4 ranks cancelled after their first step, and 8 ranks in discrete mode (one
trace per stage). That coordinator closes (its store writes everything out) and the store is
grown to ``past`` sessions through :class:`~profd.actors.store.SqliteStore`'s public API:
each a copy of one of those (its request, parts, history and traces as the coordinator
persisted them), with a session id and times of its own (one every 10 minutes back from
now), agents of its own, and its trace files hard links under its own session directory (the
summary route reads them). The older half carries the node id of an earlier Ray cluster, as
sessions from before the last ``profd up`` do (the sidecar finds their files by address). The
coordinator the bench then serves restores them at start, as after a restart.

**Agents.** ``--agents`` training processes (Ray actors in ``--ray`` mode, one agent each as a
job has one rank per process; threads of the server process otherwise), each stepping every
``STEP_S`` seconds until the bench ends: churn sessions record real steps on them.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("bench.api_load")

#: Seconds between two steps of an agent: its training loop, mostly asleep (RL steps last
#: seconds to minutes; half a second keeps churn sessions short).
STEP_S = 0.5
#: Seed shapes: (name, share of the past sessions).
SHAPES = (("all_ranks", 0.15), ("two_ranks", 0.50), ("cancelled", 0.10), ("discrete", 0.25))
#: Seconds between two past sessions' creation times.
PAST_SPACING_S = 600.0


# -- a training step ----------------------------------------------------------------------------
class TinyTrainer:
    """A small MLP trained in profd's stages: what a window records (a few hundred ops)."""

    def __init__(self, agent: Any) -> None:
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        self.agent = agent
        self.model = torch.nn.Sequential(
            torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.batch = torch.randn(16, 64)

    def step(self, n: int) -> None:
        torch, agent = self.torch, self.agent
        with agent.step(n):
            with agent.stage("compute_log_prob"), torch.no_grad():
                self.model(self.batch)
            with agent.stage("update_actor", update_loop=True):
                for i in range(2):
                    with agent.mini_batch(i):
                        self.opt.zero_grad()
                        self.model(self.batch).square().mean().backward()
                        self.opt.step()


class Stepper:
    """An agent stepping on a thread of its own until :meth:`stop`."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.trainer = TinyTrainer(agent)
        self.steps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-steps", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.trainer.step(self.steps)
            self.steps += 1
            self._stop.wait(STEP_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.agent.close(timeout=10)


class AgentProcess:
    """One training process (a Ray actor): ``profd.attach`` once, then steps until closed."""

    def __init__(self, rank: int, world: int) -> None:
        logging.getLogger("profd").setLevel(logging.ERROR)  # closing at the end: nothing to say
        import profd

        self.stepper = Stepper(profd.attach(role="actor", rank=rank, world_size=world))

    def connected(self) -> bool:
        return bool(self.stepper.agent.connected)

    def steps(self) -> int:
        return self.stepper.steps

    def stop(self) -> int:
        self.stepper.stop()
        return self.stepper.steps


# -- recording the seed sessions -----------------------------------------------------------------
def _wait(what: str, ready: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout:.0f} s")
        time.sleep(0.02)


def record_seeds(workdir: Path, n_agents: int = 16) -> tuple[list[dict[str, Any]], float]:
    """Record the seed sessions for real (coordinator and agents in this process, one agent
    stepping at a time: torch.profiler is process-wide). The persisted sessions, by shape,
    and the seconds it took."""
    from profd.actors.coordinator import ProfileCoordinator
    from profd.agent import ProfilerAgent
    from profd.testing.coordinator import InProcessCoordinator

    t0 = time.monotonic()
    owner = InProcessCoordinator(ProfileCoordinator(_coordinator_settings(workdir)))
    agents = [
        ProfilerAgent("actor", r, n_agents, find_link=owner.link).start() for r in range(n_agents)
    ]
    trainers = [TinyTrainer(a) for a in agents]
    _wait("agents did not register", lambda: all(a.connected for a in agents))
    actor = "actor"
    plans = {  # shape: (request, ranks); steps rise from one to the next for every agent
        "all_ranks": ({"steps": [10, 11], "roles": {actor: {"all_ranks": True}}}, range(n_agents)),
        "two_ranks": ({"steps": [20], "roles": {actor: {"ranks": [0, 1]}}}, range(2)),
        "cancelled": ({"steps": [30, 31], "roles": {actor: {"ranks": [2, 3, 4, 5]}}}, range(2, 6)),
        "discrete": (
            {"steps": [40], "roles": {actor: {"ranks": list(range(8)), "discrete": True}}},
            range(8),
        ),
    }
    ids = {
        shape: _record_seed(owner, agents, trainers, shape, body, list(ranks))
        for shape, (body, ranks) in plans.items()
    }
    for a in agents:
        a.close(timeout=10)
    owner.close()  # the store writes everything out and releases the state directory
    store = _open_store(workdir)
    saved = store.load()
    store.close()
    by_id = {d["session_id"]: d for d in saved["sessions"]}
    traces: dict[str, list[dict[str, Any]]] = {}
    for t in saved["traces"]:
        traces.setdefault(t["session_id"], []).append(t)
    return [
        {"shape": s, "session": by_id[sid], "traces": traces.get(sid, [])} for s, sid in ids.items()
    ], time.monotonic() - t0


def _record_seed(
    owner: Any, agents: list[Any], trainers: list[Any], shape: str, body: dict, ranks: list[int]
) -> str:
    """One seed session, recorded; its id."""
    sid = owner.call("create_session", body).session_id

    def view() -> Any:
        return owner.call("get_session", sid)

    # this session's window (a finished one may still be in a plan until the agent's next
    # poll: a window the agent ended leaves its plan without waking it)
    _wait(
        "plans did not arrive",
        lambda: all(any(w.session_id == sid for w in agents[r].plan.windows) for r in ranks),
    )
    # a step past the window closes it; the cancelled session records its first step only
    steps = body["steps"][:1] if shape == "cancelled" else [*body["steps"], body["steps"][-1] + 1]
    for r in ranks:
        for n in steps:
            trainers[r].step(n)
    if shape == "cancelled":
        _wait("the first step's traces did not arrive", lambda: len(view().traces) >= len(ranks))
        owner.call("cancel_session", sid, "cancelled by user")
    _wait(f"the {shape} seed session did not finish", lambda: view().state.is_terminal)
    return sid


def _coordinator_settings(workdir: Path) -> Any:
    """As ``profd up`` makes them (from the environment), under ``workdir``."""
    return profd_settings(workdir).coordinator(cwd=workdir)


def profd_settings(workdir: Path) -> Any:
    """``profd up``'s settings with the state and the save root under ``workdir``, and a free
    port (other sidecars may hold the default one)."""
    from profd.core.settings import ProfdSettings

    return ProfdSettings(state_dir=workdir / "state", save_root=workdir / "profile", port=0)


def _open_store(workdir: Path) -> Any:
    from profd.actors.store import SqliteStore, StateLock

    state = workdir / "state"
    return SqliteStore(state / "coordinator.sqlite3", lock=StateLock(state))


# -- growing the store -------------------------------------------------------------------------
_TIME_KEYS = ("created_at", "deadline", "finished_at")


def _shift(d: dict[str, Any], keys: tuple[str, ...], by: float) -> None:
    for k in keys:
        if isinstance(d.get(k), (int, float)):
            d[k] = d[k] + by


def _copy(
    seed: dict[str, Any], sid: str, created: float, save_root: Path, node: tuple[Any, Any]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """One past session from a seed: header, parts and traces of its own."""
    import copy

    header = copy.deepcopy(seed["session"])
    parts_in = header.pop("targets")
    by = created - header["created_at"]
    _shift(header, _TIME_KEYS, by)
    header["history"] = [[t + by, *rest] for t, *rest in header["history"]]
    header["session_id"] = sid
    save_dir = save_root / sid
    header["save_dir"] = str(save_dir)
    save_dir.mkdir(parents=True)
    agent_ids = {
        aid: f"{p['role']}-{p['rank']}-{secrets.token_hex(4)}" for aid, p in parts_in.items()
    }
    trace_ids = {t["trace_id"]: secrets.token_hex(8) for t in seed["traces"]}
    traces = []
    for t in seed["traces"]:
        t = dict(t, trace_id=trace_ids[t["trace_id"]], session_id=sid)
        t["agent_id"] = agent_ids.get(t["agent_id"], t["agent_id"])
        t["created_at"] += by
        path = save_dir / t["file_name"]
        os.link(t["path"], path)
        t["path"] = str(path)
        t["node_id"], t["node_ip"] = node
        traces.append(t)
    parts = {}
    for aid, p in parts_in.items():
        p = dict(p, agent_id=agent_ids[aid])
        p["traces"] = [trace_ids.get(x, x) for x in p["traces"]]
        _shift(p, ("armed_at",), by)
        parts[agent_ids[aid]] = p
    return header, parts, traces


def grow_store(
    workdir: Path, seeds: list[dict[str, Any]], past: int, here: tuple[Any, Any]
) -> dict[str, Any]:
    """Write ``past`` past sessions (copies of the seeds, see the module docstring) into the
    store under ``workdir``; their ids (oldest first) and counts."""
    rng = random.Random(17)
    by_shape = {s["shape"]: s for s in seeds}
    names = [name for name, _ in SHAPES]
    weights = [w for _, w in SHAPES]
    earlier_cluster = (secrets.token_hex(28), here[1])  # same address, another cluster's id
    save_root = workdir / "profile"
    store = _open_store(workdir)
    now = time.time()
    ids: list[str] = []
    taken: set[str] = set()
    n_traces = 0
    for i in range(past):
        created = now - (past - i) * PAST_SPACING_S
        while True:
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(created))
            sid = f"{stamp}-{secrets.token_hex(2)}"
            if sid not in taken:
                break
        taken.add(sid)
        seed = by_shape[rng.choices(names, weights)[0]]
        node = earlier_cluster if i < past // 2 and here[0] else here
        header, parts, traces = _copy(seed, sid, created, save_root, node)
        if not store.save_session(sid, header, parts):
            raise RuntimeError(f"the store refused past session {sid}: {store.last_error}")
        for t in traces:
            store.save_trace(t["trace_id"], sid, t)
        n_traces += len(traces)
        ids.append(sid)
    store.close()
    if store.failed_writes:
        raise RuntimeError(f"past sessions not all written: {store.last_error}")
    return {"past_ids": ids, "past_traces": n_traces}


# -- serving -------------------------------------------------------------------------------------
def prepare_store(workdir: Path, past: int, here: tuple[Any, Any]) -> dict:
    """Record the seeds and grow the store to ``past`` sessions; what the report needs."""
    t0 = time.monotonic()
    seeds, _ = record_seeds(workdir)  # past jobs had 16 ranks, whatever runs now
    grown = grow_store(workdir, seeds, past, here)
    return {**grown, "seed_s": round(time.monotonic() - t0, 1)}


def _up_config(workdir: Path) -> tuple[Any, Any]:
    """The coordinator settings and sidecar config exactly as ``profd up`` builds them (token
    file in the state directory, no flags given)."""
    from profd.cli.ray_cluster import read_or_create_token
    from profd.cli.service import SidecarFlags, _sidecar_config

    settings = profd_settings(workdir)
    coord = settings.coordinator(cwd=workdir)
    token, _ = read_or_create_token(settings.state_dir)
    return coord, _sidecar_config(settings, coord, token, SidecarFlags(), None)


def _wait_stepping(steps: Any, n: int, timeout: float = 120.0) -> None:
    """Until all ``n`` agents stepped a few times (``timeout`` counted from the first answer
    of all: processes that start torch on a busy machine take their time)."""
    deadline = None
    while True:
        counts = steps()
        deadline = deadline or time.monotonic() + timeout
        if sum(1 for c in counts if c > 2) == n:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {sum(1 for c in counts if c > 2)}/{n} agents step")
        time.sleep(0.2)


def serve_ray(workdir: Path, n_agents: int, past: int, ready: Any, stop: threading.Event) -> dict:
    """``profd up``'s stack on a local Ray (127.0.0.1): the coordinator and sidecar actors
    (``start_services``, as `profd up` calls it, not detached so they end with this process),
    and ``n_agents`` training processes. ``ready(info)`` once it serves; returns when
    ``stop`` is set."""
    from profd.core.ray_env import init_local_ray, ray_context

    init_local_ray()
    import ray

    from profd.cli.ray_cluster import start_services, stop_services

    ctx = ray_context()
    info = prepare_store(workdir, past, (ctx.node_id, ctx.node_ip))
    coord, sidecar = _up_config(workdir)
    t0 = time.monotonic()
    services = start_services(coord, sidecar, detached=False)
    info["restore_s"] = round(time.monotonic() - t0, 2)
    info["restored"] = services.coordinator_restored
    remote = ray.remote(AgentProcess).options(num_cpus=0)
    workers = [remote.remote(r, n_agents) for r in range(n_agents)]
    _wait_stepping(lambda: ray.get([w.steps.remote() for w in workers], timeout=600), n_agents)
    url = services.address["url"]
    ready(
        {
            **info,
            "url": url,
            "token": sidecar.token,
            "read_cache_s": sidecar.read_cache_s,
            "mode": "ray",
        }
    )
    stop.wait()
    steps = ray.get([w.stop.remote() for w in workers], timeout=60)
    stop_services()
    ray.shutdown()
    return {"agent_steps": sum(steps)}


class _ThreadLoopClient:
    """The sidecar's coordinator client for a coordinator on another thread's event loop."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    async def call(self, method: str, *args: Any) -> Any:
        import asyncio

        coro = getattr(self.owner.coordinator, method)(*args)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.owner.loop))


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


def serve_in_process(
    workdir: Path, n_agents: int, past: int, ready: Any, stop: threading.Event
) -> dict:
    """The same app (its reads shared as `profd up` shares them) and coordinator in this one
    process, no Ray: the sidecar's own cost without Ray's hops. Agents are threads here."""
    import uvicorn

    from profd.actors.coordinator import ProfileCoordinator
    from profd.agent import ProfilerAgent
    from profd.api import create_app
    from profd.api.client import SharedReads
    from profd.testing.coordinator import InProcessCoordinator

    info = prepare_store(workdir, past, (None, None))
    coord, sidecar = _up_config(workdir)
    t0 = time.monotonic()
    owner = InProcessCoordinator(ProfileCoordinator(coord))
    info["restore_s"] = round(time.monotonic() - t0, 2)
    info["restored"] = sum(owner.call("status").sessions_by_state.values())
    steppers = [
        Stepper(ProfilerAgent("actor", r, n_agents, find_link=owner.link).start())
        for r in range(n_agents)
    ]
    _wait_stepping(lambda: [s.steps if s.agent.connected else 0 for s in steppers], n_agents)
    client = SharedReads(_ThreadLoopClient(owner), sidecar.read_cache_s)
    app = ServerTiming(create_app(sidecar, client=client))
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", access_log=False, lifespan="on"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait("uvicorn did not start", lambda: server.started)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    ready(
        {
            **info,
            "url": url,
            "token": sidecar.token,
            "read_cache_s": sidecar.read_cache_s,
            "mode": "in-process",
        }
    )
    stop.wait()
    logging.getLogger("profd").setLevel(logging.ERROR)  # agents closing: nothing to report
    server.should_exit = True
    thread.join(10)
    for s in steppers:
        s.stop()
    owner.close()
    return {"server_seconds": app.seconds, "agent_steps": sum(s.steps for s in steppers)}
