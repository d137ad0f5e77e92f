"""``profd merge`` and ``profd summarize``: look at a session's traces.

TARGET is a session directory (works offline) or a session id, which the sidecar resolves
to its directory (``GET /api/v1/sessions/{id}`` → ``save_dir``). When some of its traces are
not on this machine (other nodes, no shared filesystem), they are downloaded through the
sidecar into ``<state dir>/downloads/<session>/`` (the local ones linked there), so nothing
is left out. Bad options exit 2 with the option named; an unreachable sidecar exits 3.

``summarize`` prints, by default, the summary folded over steps
(:mod:`profd.analysis.aggregate`: one row per stage x role, whatever the step count), at the
terminal's width (80 when stdout is not a terminal), long names shortened with a legend;
``--per-step`` prints every step x stage x rank, ``--wide`` full names, never wrapped.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from profd.cli.client import EXIT_USAGE, ApiClient, CliError, format_bytes
from profd.cli.common import comma_list, finite
from profd.cli.summary_view import print_summary

if TYPE_CHECKING:
    pass

__all__ = ["merge", "register", "resolve_target", "summarize"]

console = Console()
err_console = Console(stderr=True)

_SESSION_ID = re.compile(r"^[A-Za-z0-9._\-]{1,64}$")

TargetArg = Annotated[
    str, typer.Argument(help="Session directory, or a session id (resolved by the sidecar).")
]
UrlOpt = Annotated[str | None, typer.Option("--url", help="Sidecar URL, to resolve a session id.")]
WorkersOpt = Annotated[
    int | None, typer.Option("--workers", help="Worker processes (default: one per CPU).")
]


def resolve_target(target: str, url: str | None) -> Path:
    """The session directory named by ``target`` (a path, or a session id via the sidecar)."""
    path = Path(target).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise typer.BadParameter(
            f"{target} is a file, not a session directory", param_hint="TARGET"
        )
    if not _SESSION_ID.match(target) or target.startswith("."):
        raise typer.BadParameter(f"no such directory: {target}", param_hint="TARGET")
    from profd.core.settings import ProfdSettings

    api = ApiClient.from_state(url, ProfdSettings().state_dir)
    try:
        view = api.get(f"/api/v1/sessions/{target}")
    except CliError as exc:
        if exc.status == 404:
            raise typer.BadParameter(
                f"{target} is neither a directory nor a known session id", param_hint="TARGET"
            ) from None
        raise
    traces = api.get_all("/api/v1/traces", session_id=target)  # every page
    save_dir = Path(view["save_dir"])
    if all(_here(t) for t in traces) and save_dir.is_dir():
        return save_dir
    return _fetch(api, target, traces, ProfdSettings().state_dir / "downloads" / target)


def _here(trace: dict[str, Any]) -> bool:
    """Whether this machine holds the trace, whole (it may live on another node)."""
    path = Path(trace["path"])
    return path.is_file() and path.stat().st_size == trace["bytes"]


def _fetch(api: ApiClient, session_id: str, traces: list[dict[str, Any]], into: Path) -> Path:
    """A directory with every trace of the session: files on this machine linked, the others
    downloaded through the sidecar (from their nodes). Kept for the next look."""
    into.mkdir(parents=True, exist_ok=True)
    fetched = 0
    for t in traces:
        dest = into / t["file_name"]
        if dest.is_file() and dest.stat().st_size == t["bytes"]:
            continue
        if _here(t):
            dest.unlink(missing_ok=True)
            dest.symlink_to(Path(t["path"]).resolve())
            continue
        part = dest.with_name(dest.name + ".part")
        api.download(f"/api/v1/traces/{t['trace_id']}/download", part)
        part.replace(dest)
        fetched += 1
    if fetched:
        err_console.print(
            f"session {session_id}: fetched {fetched} trace(s) held on other nodes into {into}"
        )
    return into


def _usage_error(exc: ValueError) -> None:
    err_console.print(f"[red]error:[/red] {exc}")
    raise typer.Exit(EXIT_USAGE)


def _fail(exc: CliError) -> None:
    err_console.print(f"[red]error:[/red] {exc}")
    raise typer.Exit(exc.exit_code)


# -- merge ----------------------------------------------------------------------------------
def merge(
    target: TargetArg,
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Merged trace (.json.gz or .json).")
    ] = Path("merged.json.gz"),
    stages: Annotated[
        str | None, typer.Option(help="Keep only events inside these stages, e.g. update_actor.")
    ] = None,
    ranks: Annotated[str | None, typer.Option(help="Keep only these ranks, e.g. 0,8.")] = None,
    roles: Annotated[str | None, typer.Option(help="Keep only these roles.")] = None,
    start: Annotated[
        float | None,
        typer.Option(callback=finite, help="Window start, ms after the earliest event."),
    ] = None,
    end: Annotated[
        float | None, typer.Option(callback=finite, help="Window end, ms after the earliest event.")
    ] = None,
    max_mb: Annotated[
        float | None,
        typer.Option(
            "--max-mb",
            callback=finite,
            help="Size budget (uncompressed MB): drop the shortest events.",
        ),
    ] = None,
    workers: WorkersOpt = None,
    url: UrlOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Merge every rank's trace (and the rollout's) into one timeline for Perfetto."""
    from profd.analysis.merge import merge_dir

    if max_mb is not None and not max_mb > 0:
        raise typer.BadParameter(f"must be > 0, got {max_mb}", param_hint="--max-mb")
    if start is not None and start < 0:
        raise typer.BadParameter(f"must be >= 0, got {start}", param_hint="--start")
    if end is not None and end <= (start or 0.0):
        raise typer.BadParameter(f"must be greater than --start, got {end}", param_hint="--end")
    try:
        directory = resolve_target(target, url)
        report = merge_dir(
            directory,
            output,
            stages=comma_list(stages, "--stages"),
            ranks=comma_list(ranks, "--ranks", as_int=True),
            roles=comma_list(roles, "--roles"),
            start_ms=start,
            end_ms=end,
            max_mb=max_mb,
            workers=workers,
        )
    except CliError as exc:
        _fail(exc)
    except ValueError as exc:
        _usage_error(exc)
    if as_json:
        sys.stdout.write(json.dumps(report.model_dump(mode="json"), indent=2) + "\n")
    else:
        print_merge(report)


def print_merge(report: Any) -> None:
    table = Table(title=f"Merged {len(report.tracks)} tracks into {report.output}")
    for col in ("pid", "track", "files"):
        table.add_column(col, overflow="fold")
    for t in report.tracks:
        table.add_row(str(t.pid), t.label, str(len(t.files)))
    console.print(table)
    console.print(
        f"{report.events:,} events, {format_bytes(report.json_bytes)} of JSON, "
        f"{format_bytes(report.file_bytes)} on disk. Open it at https://ui.perfetto.dev"
    )
    for reason, cats in report.dropped.items():
        listed = ", ".join(f"{n:,} {c}" for c, n in cats.items())
        console.print(f"dropped by {reason}: {listed}")
    if report.budget_note:
        console.print(f"budget: {report.budget_note}")
    for name, why in report.skipped.items():
        err_console.print(f"[yellow]skipped[/yellow] {name}: {why}")
    for name, how in report.aligned.items():
        err_console.print(f"[yellow]placed[/yellow] {name} {how}")


# -- summarize ------------------------------------------------------------------------------
def summarize(
    target: TargetArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    html: Annotated[
        Path | None, typer.Option("--html", help="Also write an HTML report with plots here.")
    ] = None,
    top: Annotated[int, typer.Option(help="Operators listed per stage.", min=1)] = 10,
    late_k: Annotated[
        float,
        typer.Option(
            callback=finite, help="Straggler: multiple of the peers' spread (scaled MAD)."
        ),
    ] = 3.0,
    late_floor_ms: Annotated[
        float, typer.Option(callback=finite, help="Straggler: never late by less than this (ms).")
    ] = 5.0,
    late_fraction: Annotated[
        float,
        typer.Option(
            callback=finite, help="Straggler: never late by less than this share of the stage."
        ),
    ] = 0.05,
    per_step: Annotated[
        bool, typer.Option("--per-step", help="Every step x stage x rank, not folded over steps.")
    ] = False,
    wide: Annotated[
        bool, typer.Option("--wide", help="Full names, never shortened or wrapped.")
    ] = False,
    workers: WorkersOpt = None,
    url: UrlOpt = None,
) -> None:
    """Stage wall times folded over steps (median, p90, max, slowest rank), stragglers, idle
    gaps, mini-batches and top operators, in 80 columns; --per-step prints every step."""
    from pydantic import ValidationError

    from profd.analysis.models import StragglerRule
    from profd.analysis.summary import summarize_dir

    try:
        rule = StragglerRule(k=late_k, abs_floor_ms=late_floor_ms, rel_floor=late_fraction)
    except ValidationError as exc:
        err = exc.errors()[0]
        option = {
            "k": "--late-k",
            "abs_floor_ms": "--late-floor-ms",
            "rel_floor": "--late-fraction",
        }
        raise typer.BadParameter(err["msg"], param_hint=option.get(str(err["loc"][0]))) from None
    try:
        directory = resolve_target(target, url)
        summary = summarize_dir(directory, workers=workers, top=top, rule=rule)
    except CliError as exc:
        _fail(exc)
    except ValueError as exc:
        _usage_error(exc)
    if html is not None:
        from profd.analysis.report import write_html

        write_html(summary, html)
    if as_json:
        sys.stdout.write(json.dumps(summary.model_dump(mode="json"), indent=2) + "\n")
    else:
        print_summary(summary, per_step=per_step, wide=wide)
    if html is not None:
        err_console.print(f"HTML report: {html}")


def register(app: typer.Typer) -> None:
    """Add ``merge`` and ``summarize`` to the ``profd`` app."""
    app.command("merge")(merge)
    app.command("summarize")(summarize)
