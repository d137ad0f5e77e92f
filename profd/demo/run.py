"""``profd demo``: a live job, a session triggered over HTTP, and the traces it produced.

1. start a local Ray on 127.0.0.1 (or join ``address``), the coordinator and the sidecar;
2. start the synthetic RL job: two ``actor_rollout_ref`` ranks and one ``critic`` (Ray
   workers), two rollout replicas served by fake vLLM servers (real HTTP, vLLM's profiling
   endpoints and file names), and a single-controller driver (verl style) that runs the steps;
3. while the job runs, ``POST /api/v1/sessions`` for the next 2 steps on every rank and
   replica;
4. wait for the session to finish and print the training and rollout traces side by side.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from profd.cli.client import ApiClient, format_bytes
from profd.cli.ray_cluster import start_services
from profd.core.constants import NAMESPACE
from profd.core.ray_env import apply_loopback_env, init_local_ray, is_local_address
from profd.core.settings import ProfdSettings, SidecarConfig

__all__ = ["DemoResult", "run_demo"]

WORKERS = (("actor_rollout_ref", 0, 2), ("actor_rollout_ref", 1, 2), ("critic", 0, 1))
#: Rollout replicas (tp=1 each: global GPU ranks 0 and 1).
REPLICAS = 2
TERMINAL = ("done", "partial", "failed", "cancelled", "expired")


@dataclass
class DemoResult:
    session: dict[str, Any]
    traces: list[dict[str, Any]]
    workers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.session.get("state") == "done" and bool(self.traces)


def _wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def trace_table(traces: list[dict[str, Any]], cwd: Path | None = None) -> Table:
    """Traces as a table; the directory is shown once in the title when they share one."""
    cwd = cwd or Path.cwd()
    dirs = {str(Path(t["path"]).parent) for t in traces}
    common = dirs.pop() if len(dirs) == 1 else None
    title = "Traces"
    if common is not None:
        try:
            shown_dir = str(Path(common).relative_to(cwd))
        except ValueError:
            shown_dir = common
        title = f"Traces in {shown_dir}/"
    table = Table(title=title, title_justify="left")
    for col in ("role", "rank", "step", "size", "file" if common else "path"):
        table.add_column(
            col, overflow="fold", justify="right" if col in ("rank", "size") else "left"
        )
    for t in traces:
        steps = t["steps"]
        step = str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
        name = t["file_name"] if common else t["path"]
        table.add_row(t["role"], str(t["rank"]), step, format_bytes(t["bytes"]), name)
    return table


def _start_ray(console: Console, address: str | None) -> bool:
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        return False
    console.print("[bold]Starting a local Ray on 127.0.0.1[/bold] ...")
    init_local_ray()
    return True


def _start_rollout(stack: ExitStack, save_root: str) -> tuple[list[Any], list[Any]]:
    """Fake vLLM replicas launched with profd's launch settings, and their rollout agents."""
    from profd.rollout import (
        EngineProfileOptions,
        RolloutAgent,
        VllmHttpEngine,
        engine_trace_dir,
        vllm_launch_settings,
    )
    from profd.rollout.engine_args import VLLM_VERIFIED
    from profd.rollout.service import RolloutService
    from profd.testing.fake_engines import FakeVllmServer

    fakes, services = [], []
    for r in range(REPLICAS):
        trace_dir = engine_trace_dir(save_root, r)
        # last out: the engine's own directory goes once empty (its files moved into the
        # sessions); one still holding files is kept, so nothing is lost
        stack.callback(_remove_if_empty, trace_dir)
        launch = vllm_launch_settings(EngineProfileOptions(), str(trace_dir), VLLM_VERIFIED)
        fake = stack.enter_context(FakeVllmServer.from_launch(launch, tp=1))
        agent = RolloutAgent(r, (1, 1, 1), VllmHttpEngine(fake.url), vllm_launch=launch)
        services.append(RolloutService(agent, replicas=REPLICAS).start())
        stack.callback(services[-1].close, 60.0)
        fakes.append(fake)
    return fakes, services


def _remove_if_empty(path: Path) -> None:
    with contextlib.suppress(OSError):  # not empty, or never made
        path.rmdir()


def _drive(
    workers: list[Any],
    fakes: list[Any],
    steps: int,
    min_step_s: float,
    until: threading.Event,
    progress: dict[str, int],
) -> None:
    """The single controller: every step, generation on the replicas, then the workers."""
    import ray

    from profd.driver.controller import Controller

    ctl = Controller()
    step = 0
    while step < steps or not until.is_set():
        step += 1
        started = time.perf_counter()
        with ctl.step(step):
            with ctl.rollout():
                for f in fakes:
                    f.advance(4)  # engine iterations: the replicas generate
            ray.get([w.work.remote() for w in workers])
        progress["step"] = step
        time.sleep(max(0.0, min_step_s - (time.perf_counter() - started)))
        if step >= steps + 40:
            break  # the session never ended: stop the job anyway


def _trigger(api: ApiClient, console: Console, progress: dict[str, int]) -> dict[str, Any]:
    """While the job runs: ask over HTTP for the next 2 steps on every rank and replica."""

    def registered() -> bool:
        agents = api.get("/api/v1/agents")["data"]
        return len(agents) >= len(WORKERS) + REPLICAS and progress.get("step", 0) >= 1

    _wait_for(registered, 120, "every worker and replica to register")
    agents = api.get("/api/v1/agents")["data"]
    console.print(
        f"{len(agents)} agents registered: " + ", ".join(f"{a['role']}#{a['rank']}" for a in agents)
    )
    body = {"tool": "torch", "next_steps": 2, "roles": {"*": {"all_ranks": True}}}
    console.print(f"POST {api.url}/api/v1/sessions {body}")
    session = api.post("/api/v1/sessions", body)
    console.print(
        f"Session [bold]{session['session_id']}[/bold]: steps {session['steps']} on "
        f"{len(session['targets'])} targets, {len(session['ignored'])} ignored"
    )
    sid = session["session_id"]

    def finished() -> dict[str, Any] | None:
        view = api.get(f"/api/v1/sessions/{sid}")
        return view if view["state"] in TERMINAL else None

    return _wait_for(finished, 180, f"session {sid} to finish", interval=0.25)


def _print_outcome(console: Console, session: dict[str, Any], traces: list[dict]) -> None:
    console.print(
        f"Session {session['session_id']} [bold]{session['state']}[/bold]: {session['reason']}"
    )
    console.print(trace_table(traces))
    console.print(
        "Open a trace at [cyan]https://ui.perfetto.dev[/cyan] (Open trace file) or in "
        "[cyan]chrome://tracing[/cyan] (Load); both read .json.gz directly. "
        "[cyan]profd summarize <dir>[/cyan] gives the per-stage summary."
    )


def run_demo(
    console: Console,
    *,
    steps: int = 8,
    port: int = 0,
    save_root: Path | None = None,
    address: str | None = None,
    min_step_s: float = 0.4,
) -> DemoResult:
    if is_local_address(address):
        apply_loopback_env()  # before Ray is imported: it reads these at import
    import ray

    from profd.demo.workload import DemoWorker

    started_ray = _start_ray(console, address)
    # The demo's coordinator lives and dies with the demo: nothing to persist.
    coord = ProfdSettings(save_root=save_root, poll_timeout_s=2.0).coordinator()
    coord = coord.model_copy(update={"state_dir": None})
    token = secrets.token_urlsafe(24)
    workers: list[Any] = []
    try:
        with ExitStack() as stack:
            services = start_services(coord, SidecarConfig(port=port, token=token), detached=False)
            api = ApiClient(services.address["url"], token)
            console.print(
                f"Coordinator up; sidecar at [cyan]{api.url}[/cyan]; "
                f"traces under [cyan]{coord.save_root}[/cyan]"
            )
            remote = ray.remote(DemoWorker).options(num_cpus=0)
            workers = [remote.remote(role, rank, world, seed=7) for role, rank, world in WORKERS]
            ray.get([w.ready.remote() for w in workers], timeout=120)
            fakes, _ = _start_rollout(stack, coord.save_root)
            console.print(
                "Job: 2 x actor_rollout_ref + 1 x critic (Ray workers), 2 rollout "
                "replicas (fake vLLM), a single-controller driver"
            )
            until, progress = threading.Event(), {}
            driver = threading.Thread(
                target=_drive,
                args=(workers, fakes, steps, min_step_s, until, progress),
                daemon=True,
            )
            driver.start()
            try:
                session = _trigger(api, console, progress)
            finally:
                until.set()
                driver.join(300)
            results = ray.get([w.close.remote() for w in workers], timeout=120)
        traces = sorted(
            api.get_all("/api/v1/traces", session_id=session["session_id"]),
            key=lambda t: (t["role"], t["rank"], t["steps"], t["file_name"]),
        )
        _print_outcome(console, session, traces)
        return DemoResult(
            session=session, traces=traces, workers=[{"closed_cleanly": r} for r in results]
        )
    finally:
        for w in workers:
            ray.kill(w)
        from profd.cli.ray_cluster import stop_services

        stop_services()
        if started_ray:
            ray.shutdown()
