"""``profd demo``: a live job, a session triggered over HTTP, and the traces it produced.

1. start a local Ray on 127.0.0.1 (or join ``address``), the coordinator and the sidecar;
2. start the synthetic RL workers (two ``actor_rollout_ref`` ranks, one ``critic``);
3. once every worker is stepping, ``POST /api/v1/sessions`` for the next 2 steps on all ranks;
4. wait for the session to finish and print the traces with how to open them.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from profd.cli.client import ApiClient
from profd.cluster import apply_loopback_env, is_local_address, start_services
from profd.constants import NAMESPACE
from profd.settings import ProfdSettings, SidecarConfig

__all__ = ["DemoResult", "run_demo"]

WORKERS = (("actor_rollout_ref", 0, 2), ("actor_rollout_ref", 1, 2), ("critic", 0, 1))


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


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


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
        table.add_row(t["role"], str(t["rank"]), step, _human(t["bytes"]), name)
    return table


def run_demo(
    console: Console,
    *,
    steps: int = 8,
    port: int = 0,
    save_root: Path | None = None,
    address: str | None = None,
    min_step_s: float = 0.5,
) -> DemoResult:
    if is_local_address(address):
        apply_loopback_env()  # before Ray is imported: it reads these at import
    import ray

    from profd.demo.workload import DemoWorker, StepBudget

    started_ray = False
    if not ray.is_initialized():
        if address:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        else:
            console.print("[bold]Starting a local Ray on 127.0.0.1[/bold] ...")
            ray.init(
                address="local",
                num_cpus=4,
                include_dashboard=False,
                namespace=NAMESPACE,
                log_to_driver=False,
            )
            started_ray = True
    settings = ProfdSettings(save_root=save_root, poll_timeout_s=2.0)
    # The demo's coordinator lives and dies with the demo: nothing to persist.
    coord_settings = settings.coordinator().model_copy(update={"state_dir": None})
    token = secrets.token_urlsafe(24)
    sidecar = SidecarConfig(host="127.0.0.1", port=port, token=token)
    workers: list[Any] = []
    try:
        services = start_services(coord_settings, sidecar, detached=False)
        addr = services.address
        api = ApiClient(addr["url"], token)
        console.print(
            f"Coordinator up; sidecar at [cyan]{addr['url']}[/cyan]; "
            f"traces under [cyan]{coord_settings.save_root}[/cyan]"
        )
        remote = ray.remote(DemoWorker).options(num_cpus=0)
        workers = [remote.remote(role, rank, world, seed=7) for role, rank, world in WORKERS]
        budget = ray.remote(StepBudget).options(num_cpus=0).remote()
        ray.get([w.ready.remote() for w in workers], timeout=120)
        runs = [w.run.remote(steps, min_step_s, 1, budget) for w in workers]
        console.print(
            f"Started {len(workers)} workers (2 x actor_rollout_ref, 1 x critic), "
            f"{steps} steps each"
        )

        def stepping() -> list[dict[str, Any]] | None:
            agents = api.get("/api/v1/agents")["data"]
            live = [a for a in agents if a["state"] == "alive" and a["current_step"] is not None]
            return agents if len(live) >= len(WORKERS) else None

        agents = _wait_for(stepping, 120, "every worker to register and start stepping")
        console.print(
            f"{len(agents)} agents registered: "
            + ", ".join(f"{a['role']}#{a['rank']}@step{a['current_step']}" for a in agents)
        )
        body = {"tool": "torch", "next_steps": 2, "roles": {"*": {"all_ranks": True}}}
        console.print(f"POST {api.url}/api/v1/sessions {body}")
        session = api.post("/api/v1/sessions", body)
        sid = session["session_id"]
        # Workers whose loop would end before the window keep going until it is over.
        ray.get(budget.extend_to.remote(max(session["steps"]) + 1))
        console.print(
            f"Session [bold]{sid}[/bold]: steps {session['steps']} on "
            f"{len(session['targets'])} targets, {len(session['ignored'])} ignored"
        )

        def finished() -> dict[str, Any] | None:
            view = api.get(f"/api/v1/sessions/{sid}")
            return (
                view
                if view["state"] in ("done", "partial", "failed", "cancelled", "expired")
                else None
            )

        session = _wait_for(finished, 120, f"session {sid} to finish", interval=0.25)
        results = ray.get(runs, timeout=300)
        traces = api.get("/api/v1/traces", session_id=sid)["data"]
        console.print(f"Session {sid} [bold]{session['state']}[/bold]: {session['reason']}")
        console.print(trace_table(traces))
        console.print(
            "Open a trace at [cyan]https://ui.perfetto.dev[/cyan] (Open trace file) or in "
            "[cyan]chrome://tracing[/cyan] (Load); both read .json.gz directly."
        )
        return DemoResult(session=session, traces=traces, workers=results)
    finally:
        for w in workers:
            ray.kill(w)
        from profd.cluster import stop_services

        stop_services()
        if started_ray:
            ray.shutdown()
