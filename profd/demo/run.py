"""``profd demo``: a live job, a session asked for over HTTP, the traces it produced, and a
trigger that profiles a slow rank by itself.

1. start a local Ray on 127.0.0.1 (or join ``address``), the coordinator and the sidecar;
2. start the synthetic RL job: two ``actor_rollout_ref`` ranks and one ``critic`` (Ray
   workers), two rollout replicas served by fake vLLM servers (real HTTP, vLLM's profiling
   endpoints and file names), and a single-controller driver (verl style) that runs the steps;
3. while the job runs, ``POST /api/v1/sessions`` for the next 2 steps on every rank and
   replica;
4. wait for the session to finish and print the training and rollout traces side by side;
5. ``POST /api/v1/triggers``: a ``stage_time`` trigger on the actors' ``update_actor`` stage;
   then make actor rank 1 slow (its ``update_actor`` runs 3x longer from a step on) and print
   the trigger's firing (rank, observed vs baseline, step) and the session it started by
   itself on the slow rank and its healthy peer, with their traces.
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
from profd.cli.traces_view import steps_cell
from profd.core.constants import NAMESPACE
from profd.core.ray_env import apply_loopback_env, init_local_ray, is_local_address
from profd.core.settings import ProfdSettings, SidecarConfig

__all__ = ["DemoRefused", "DemoResult", "Firing", "run_demo"]

WORKERS = (("actor_rollout_ref", 0, 2), ("actor_rollout_ref", 1, 2), ("critic", 0, 1))
#: Rollout replicas (tp=1 each: global GPU ranks 0 and 1).
REPLICAS = 2
TERMINAL = ("done", "partial", "failed", "cancelled", "expired")

#: Every update stage takes at least this long (a real update waits on its all-reduce);
#: it keeps the stage's time steady on a busy machine (its compute, tens of ms, took 120 ms
#: at a load of 10 on 2 cores), so only the injected rank is slow.
UPDATE_S = 0.1
#: The rank made slow (its index in WORKERS) and how much longer its update stage runs.
SLOW_WORKER, SLOW_BY = 1, 3.0
#: The trigger the demo posts (the same as ``profd watch --role actor_rollout_ref --stage
#: update_actor --stage-time 2 --baseline-steps 10 --min-ms 200 --for-steps 2``). Its
#: baseline is several times the durations one report carries (a rank ships its new ones
#: about once a second: 2-3 steps here), so the slow rank's first report does not yet pull
#: the pooled median up; two slow steps in a row and 200 ms keep a stall, or a loaded
#: machine, from firing it.
TRIGGER = {
    "name": "slow-update-actor",
    "when": {
        "kind": "stage_time",
        "role": "actor_rollout_ref",
        "stage": "update_actor",
        "factor": 2.0,
        "baseline_steps": 10,
        "min_ms": 200.0,
        "for_steps": 2,
    },
    "session": {"tool": "torch", "next_steps": 2},
    "cooldown_s": 300.0,
}


class DemoRefused(RuntimeError):
    """The demo will not run here (a profd is up on the cluster it was asked to join)."""


@dataclass
class Firing:
    """What the demo's trigger did: the trigger (GET /api/v1/triggers/{id}), its firing,
    the step the slowdown began at, and the session it started with that session's traces."""

    trigger: dict[str, Any]
    firing: dict[str, Any]
    slow_from: int
    session: dict[str, Any]
    traces: list[dict[str, Any]]
    #: The step it fired in: the evidence's, else (a single-controller worker marks no
    #: step of its own) the driver's step running when it fired.
    step: int | None = None

    @property
    def ok(self) -> bool:
        return self.session.get("state") == "done" and bool(self.traces)


@dataclass
class DemoResult:
    session: dict[str, Any]
    traces: list[dict[str, Any]]
    workers: list[dict[str, Any]] = field(default_factory=list)
    fired: Firing | None = None

    @property
    def ok(self) -> bool:
        return (
            self.session.get("state") == "done"
            and bool(self.traces)
            and self.fired is not None
            and self.fired.ok
        )


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
        step = steps_cell(t["steps"])
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


def _refuse_a_running_profd(address: str | None, started_ray: bool) -> None:
    """The demo runs a coordinator of its own and stops it at its end: on a cluster where
    profd is up it would have used that one, with its triggers and another token, and then
    stopped the user's profd."""
    from profd.core.ray_env import find_coordinator

    if find_coordinator() is None:
        return
    if started_ray:
        import ray

        ray.shutdown()
    raise DemoRefused(
        f"profd is up on the Ray cluster at {address or 'this address'}; the demo runs its "
        "own profd and stops it at its end, so it does not run there: run `profd demo` "
        "without --address (a local Ray of its own), or on a cluster without profd"
    )


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
    progress: dict[str, Any],
) -> None:
    """The single controller: every step, generation on the replicas, then the workers.
    From step ``progress["slow_from"]`` on, worker ``SLOW_WORKER``'s update runs slow
    (``progress["slowed_at"]``: the first such step); ``progress["began"]`` keeps when each
    step began (wall clock, as firings say)."""
    import ray

    from profd.driver.controller import Controller

    ctl = Controller()
    step = 0
    while step < steps or not until.is_set():
        step += 1
        started = time.perf_counter()
        progress.setdefault("began", []).append((time.time(), step))
        slow_from = progress.get("slow_from")
        slow = slow_from is not None and step >= slow_from
        if slow:
            progress.setdefault("slowed_at", step)  # the first step it ran slow
        with ctl.step(step):
            with ctl.rollout():
                for f in fakes:
                    f.advance(4)  # engine iterations: the replicas generate
            ray.get(
                [
                    w.work.remote(UPDATE_S * (SLOW_BY if slow and i == SLOW_WORKER else 1.0))
                    for i, w in enumerate(workers)
                ]
            )
        progress["step"] = step
        time.sleep(max(0.0, min_step_s - (time.perf_counter() - started)))
        if step >= steps + 150:
            break  # the sessions never ended: stop the job anyway


def _profile(api: ApiClient, console: Console, progress: dict[str, Any]) -> dict[str, Any]:
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

    return _wait_session(api, sid, 180)


def _wait_session(api: ApiClient, sid: str, timeout: float) -> dict[str, Any]:
    def finished() -> dict[str, Any] | None:
        view = api.get(f"/api/v1/sessions/{sid}")
        return view if view["state"] in TERMINAL else None

    return _wait_for(finished, timeout, f"session {sid} to finish", interval=0.25)


def _session_traces(api: ApiClient, sid: str) -> list[dict[str, Any]]:
    return sorted(
        api.get_all("/api/v1/traces", session_id=sid),
        key=lambda t: (t["role"], t["rank"], t["steps"], t["file_name"]),
    )


def _watch(api: ApiClient, console: Console, progress: dict[str, Any]) -> Firing:
    """Post the trigger, make one actor rank slow, and follow the trigger's firing to the
    end of the session it started."""
    from profd.actors.triggers import PROFILED_GRACE_S

    # Durations an agent measured while profiled, and a few seconds after, are not held
    # against it (they carry the profiler's cost): the first session's ranks are watched
    # again only once that grace has passed, so the trigger and the slowdown start then.
    time.sleep(PROFILED_GRACE_S + 0.2)
    console.print()
    console.print(f"POST {api.url}/api/v1/triggers {TRIGGER}")
    made = api.post("/api/v1/triggers", TRIGGER)
    tid, w = made["trigger_id"], TRIGGER["when"]
    console.print(
        f"Trigger [bold]{tid}[/bold] ({made['name']}): when an {w['role']} rank's "
        f"{w['stage']} takes over {w['factor']:g}x the role's rolling median (and "
        f"{w['min_ms']:g} ms) {w['for_steps']} steps in a row, profile its next "
        f"{TRIGGER['session']['next_steps']} steps and its closest peer's"
    )
    role, rank, _ = WORKERS[SLOW_WORKER]
    slow_from = progress["began"][-1][1] + 1  # the next step the driver begins
    progress["slow_from"] = slow_from
    console.print(
        f"Making {role} rank {rank} slow: its update_actor runs {SLOW_BY:g}x longer "
        f"({UPDATE_S * 1000:.0f} -> {UPDATE_S * SLOW_BY * 1000:.0f} ms) from step {slow_from}"
    )

    def settled() -> tuple[dict[str, Any], dict[str, Any]] | None:
        view = api.get(f"/api/v1/triggers/{tid}")
        done = [f for f in view["firings"] if f["state"] != "due"]
        return (view, done[-1]) if done else None  # newest first: the first firing

    _, firing = _wait_for(settled, 60, f"trigger {tid} to fire", interval=0.2)
    if firing["state"] != "fired":
        raise RuntimeError(f"trigger {tid}: its session was refused: {firing['error']}")
    session = _wait_session(api, firing["session_id"], 120)
    trigger = api.get(f"/api/v1/triggers/{tid}")
    step = firing["evidence"].get("step")
    if step is None:
        step = max((n for at, n in progress["began"] if at <= firing["at"]), default=None)
    traces = _session_traces(api, session["session_id"])
    slowed_at = progress.get("slowed_at", slow_from)
    return Firing(trigger, firing, slowed_at, session, traces, step)


def _print_firing(console: Console, fired: Firing) -> None:
    f, ev, s = fired.firing, fired.firing["evidence"], fired.session
    step = fired.step
    late = "" if step is None else f" (slow since step {fired.slow_from})"
    console.print(
        f"Trigger [bold]{fired.trigger['trigger_id']}[/bold] fired in step {step}{late}: "
        f"{ev['role']} rank {ev['rank']} {ev['mark']} took "
        f"[bold]{ev['observed_s'] * 1000:.1f} ms[/bold] against a baseline of "
        f"{ev['baseline_s'] * 1000:.1f} ms ({ev['observed_s'] / ev['baseline_s']:.1f}x; "
        f"factor {ev['factor']:g}, median of {ev['baseline_samples']})"
    )
    ranks = sorted({t["rank"] for t in s["targets"]}, key=lambda r: r != ev["rank"])
    peers = "".join(f" and {r} (its peer)" for r in ranks if r != ev["rank"])
    console.print(
        f"It started session [bold]{f['session_id']}[/bold] by itself: steps {s['steps']} on "
        f"{ev['role']} rank {ev['rank']} (the slow one){peers}, trigger_id {s['trigger_id']}"
    )
    _print_outcome(console, s, fired.traces)
    if not fired.ok:
        console.print(f"[red]The trigger's session ended {s['state']}: {s['reason']}[/red]")


def _print_outcome(console: Console, session: dict[str, Any], traces: list[dict]) -> None:
    console.print(
        f"Session {session['session_id']} [bold]{session['state']}[/bold]: {session['reason']}"
    )
    console.print(trace_table(traces))


def _print_hints(console: Console) -> None:
    console.print(
        "Open a trace at [cyan]https://ui.perfetto.dev[/cyan] (Open trace file) or in "
        "[cyan]chrome://tracing[/cyan] (Load); both read .json.gz directly. "
        "[cyan]profd summarize <dir>[/cyan] gives the per-stage summary."
    )


def _profile_the_job(
    api: ApiClient,
    console: Console,
    workers: list[Any],
    fakes: Any,
    steps: int,
    min_step_s: float,
) -> tuple[dict[str, Any], list[dict[str, Any]], Firing]:
    """While the driver steps the job: one session over HTTP, then a trigger that fires;
    the session, its traces and the firing."""
    until, progress = threading.Event(), {}
    driver = threading.Thread(
        target=_drive,
        args=(workers, fakes, steps, min_step_s, until, progress),
        daemon=True,
    )
    driver.start()
    try:
        session = _profile(api, console, progress)
        traces = _session_traces(api, session["session_id"])
        _print_outcome(console, session, traces)
        fired = _watch(api, console, progress)
        _print_firing(console, fired)
    finally:
        until.set()
        driver.join(300)
    return session, traces, fired


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
    _refuse_a_running_profd(address, started_ray)
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
            session, traces, fired = _profile_the_job(
                api, console, workers, fakes, steps, min_step_s
            )
            results = ray.get([w.close.remote() for w in workers], timeout=120)
        _print_hints(console)
        return DemoResult(
            session=session,
            traces=traces,
            workers=[{"closed_cleanly": r} for r in results],
            fired=fired,
        )
    finally:
        for w in workers:
            ray.kill(w)
        from profd.cli.ray_cluster import stop_services

        stop_services()
        if started_ray:
            ray.shutdown()
