"""``profd stacks``: where every attached process's training thread is now, grouped by stack
(``GET /api/v1/stacks``)."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer
from rich.markup import escape

from profd.actors.selection import rank_ranges
from profd.cli.client import CliError
from profd.cli.common import (
    JsonOpt,
    UrlOpt,
    console,
    fail,
    finite_from,
    print_json,
    sidecar_client,
)

__all__ = ["print_stacks", "stacks"]


def _short(path: str) -> str:
    """A frame's file as people read it: from its package folder on (site-packages cut)."""
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep, "lib" + os.sep + "python"):
        i = path.rfind(marker)
        if i >= 0:
            rest = path[i + len(marker) :]
            return rest.split(os.sep, 1)[1] if marker.startswith("lib") and os.sep in rest else rest
    return path


def _who(ranks: list[dict[str, Any]]) -> str:
    by_role: dict[str, list[int]] = {}
    for r in ranks:
        by_role.setdefault(r["role"], []).append(r["rank"])
    return "; ".join(f"{role} rank(s) {rank_ranges(rs)}" for role, rs in by_role.items())


def print_stacks(view: dict[str, Any], depth: int | None = None) -> None:
    groups = view["groups"]
    n = sum(len(g["ranks"]) for g in groups)
    console.print(
        f"{n} process(es) in {len(groups)} group(s) of identical stacks, the odd ones first"
    )
    for i, g in enumerate(groups, 1):
        methods = sorted({r["method"] for r in g["ranks"]})
        pids = ", ".join(f"{r['pid']}@{r['node']}" for r in g["ranks"])
        console.print(
            f"\n[bold]group {i}[/bold]: {len(g['ranks'])} process(es): "
            f"{escape(_who(g['ranks']))}  [dim](pid {escape(pids)}; read by "
            f"{', '.join(methods)})[/dim]"
        )
        frames = g["stack"] if depth is None else g["stack"][:depth]
        for f in frames:  # innermost first, as py-spy prints them
            console.print(f"    {escape(f['function'])} ({escape(_short(f['file']))}:{f['line']})")
        if len(frames) < len(g["stack"]):
            console.print(f"    [dim]... {len(g['stack']) - len(frames)} more frame(s)[/dim]")
    for m in view["missing"]:
        role = "" if m["role"] in ("*", None) else f"{m['role']} "  # no --role: any role's
        who = f"{role}rank {m['rank']}" + (f" (pid {m['pid']})" if m.get("pid") else "")
        console.print(f"[yellow]no stack from {escape(who)}: {escape(m['reason'])}[/yellow]")
    for note in view["notes"]:
        console.print(f"[dim]note: {escape(note)}[/dim]")


def stacks(
    role: Annotated[str | None, typer.Option(help="Only this role's processes.")] = None,
    ranks: Annotated[str | None, typer.Option(help="Only these ranks, e.g. 0,2.")] = None,
    job: Annotated[
        str | None, typer.Option(help="Only this Ray job's processes (`profd status`).")
    ] = None,
    native: Annotated[bool, typer.Option(help="Native frames too (py-spy only).")] = False,
    method: Annotated[
        str, typer.Option(help="auto (py-spy where it can attach, else the agents), py_spy, agent.")
    ] = "auto",
    depth: Annotated[
        int | None, typer.Option(min=1, help="Show at most this many frames per group.")
    ] = None,
    timeout: Annotated[
        float,
        typer.Option(
            callback=finite_from(0, 60, above=True),  # the sidecar's bounds, checked here
            help="Seconds to wait for answers (at most 60).",
        ),
    ] = 5.0,
    url: UrlOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The Python stack of every attached process now, grouped by identical stack, the odd
    groups first: where a hung job hangs. Needs no session and no step marks."""
    params: dict[str, Any] = {"method": method, "timeout_s": timeout}
    if role:
        params["role"] = role
    if ranks:
        params["ranks"] = ranks
    if job:
        params["job_id"] = job
    if native:
        params["native"] = "true"
    try:
        # py-spy's node tasks, then the agents, each up to --timeout (and py-spy's own 10 s)
        api = sidecar_client(url, timeout=2 * timeout + 40)
        view = api.get("/api/v1/stacks", **params)
    except CliError as exc:
        fail(exc)
    if as_json:
        print_json(view)
        return
    print_stacks(view, depth)
