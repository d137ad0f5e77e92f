"""``profd status``: the sidecar's figures, the jobs' drivers, live sessions and every
agent, in a table that fits 80 columns."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table

from profd.cli.client import CliError, format_bytes
from profd.cli.common import JsonOpt, UrlOpt, console, fail, print_json, sidecar_client

__all__ = ["status"]


def status(url: UrlOpt = None, as_json: JsonOpt = False) -> None:
    """Agents and sessions at a glance."""
    try:
        api = sidecar_client(url)
        st = api.get("/api/v1/status")
        agents = api.get("/api/v1/agents")["data"]
    except CliError as exc:
        fail(exc)
    if as_json:
        print_json({"status": st, "agents": agents})
        return
    console.print(
        f"profd {st['version']} at {api.url}: {st['agents']} agents alive, "
        f"{st['traces']} traces ({format_bytes(st['trace_bytes'])}), "
        f"save root {st['save_root']}"
    )
    if st.get("ray_address"):
        # A job that started a Ray of its own (ray.init() with no cluster it could find)
        # never registers here: this is the address it must join.
        hint = "" if st["agents"] else f" (jobs join it with RAY_ADDRESS={st['ray_address']})"
        console.print(f"Ray cluster {st['ray_address']}{hint}")
    drivers = st.get("driver_steps") or {}
    if len(drivers) > 1:  # two jobs, two drivers: each one's step
        each = ", ".join(f"job {j} at step {s}" for j, s in sorted(drivers.items()))
        console.print(f"drivers (profd.controller()): {each}")
    elif st.get("driver_step") is not None:
        console.print(
            f"driver (profd.controller()) at step {st['driver_step']}, "
            f"{st['driver_seen_s']:.1f}s ago"
        )
    if st["live_sessions"]:
        console.print("live sessions: " + ", ".join(st["live_sessions"]))
    # Fits 80 columns (a terminal's, and what a pipe gets) without cutting a role or node:
    # rank and world share a cell, no borders, long names fold instead of ending in "…".
    table = Table(
        title="Agents", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True
    )
    # Several jobs on the cluster: which job each agent is in (`profd profile --job` picks).
    jobs = len({a.get("job_id") for a in agents}) > 1
    for col in ("job",) * jobs + ("role", "rank", "node", "pid", "state", "step", "via", "seen"):
        table.add_column(col, overflow="fold", no_wrap=col not in ("role", "node"))
    for a in agents:
        table.add_row(
            *((a.get("job_id") or "-",) * jobs),
            a["role"],
            f"{a['rank']}/{a['world_size']}" if a["world_size"] else str(a["rank"]),
            a["node_ip"] or a["hostname"],
            str(a["pid"]),
            a["state"],
            _step_cell(a),
            a.get("link") or "-",  # how its plans reach it: relay, direct or shared
            f"{a['last_seen_s']:.1f}s",
        )
    console.print(table)


def _step_cell(agent: dict[str, Any]) -> str:
    step = agent.get("current_step")
    if step is None:
        return "-"
    return f"{step} (driver)" if agent.get("step_source") == "driver" else str(step)
