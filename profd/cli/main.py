"""The ``profd`` command line.

Exit codes: 0 success; 1 the request failed or a session did not end ``done``; 2 bad usage;
3 the sidecar cannot be reached.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from profd.cli import (
    analysis,
    diff_view,
    export_view,
    service,
    stacks_view,
    status_view,
    watch_view,
)
from profd.cli.client import ApiClient, CliError
from profd.cli.common import (
    JsonOpt,
    UrlOpt,
    console,
    err_console,
    fail,
    finite,
    finite_from,
    print_json,
    sidecar_client,
)
from profd.cli.requests import build_request, check_window
from profd.cli.session_view import (
    print_outcome,
    print_session,
    settle_cancelled,
    wait_session,
    writing_targets,
)
from profd.cli.traces_view import (
    download_traces,
    print_traces,
)
from profd.core.paging import DEFAULT_LIMIT, MAX_LIMIT

__all__ = ["app", "main"]

app = typer.Typer(
    name="profd",
    help="Live, step-aligned profiling of PyTorch training on Ray.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",  # joins a docstring's lines (rich mode kept its breaks)
)


# -- status / lists -------------------------------------------------------------------------
app.command("status")(status_view.status)  # first in the help, as the first thing to run
LimitOpt = Annotated[
    int, typer.Option("--limit", min=1, max=MAX_LIMIT, help="How many of the newest to show.")
]
CursorOpt = Annotated[
    str | None,
    typer.Option("--cursor", help="Show the page after this one (the cursor a page prints)."),
]
AllOpt = Annotated[bool, typer.Option("--all", help="Show every one (follow every page).")]


def _listing(
    api: ApiClient, path: str, limit: int, cursor: str | None, show_all: bool, **params: Any
) -> tuple[list[dict[str, Any]], int, str | None, int | None]:
    """One page (or, with ``show_all``, every page): its items, how many match in all, the
    cursor of the next page (None when nothing follows) and the bytes of every match (traces;
    None when the listing does not say)."""
    if show_all:
        items = api.get_all(path, **params)
        sizes = [i.get("bytes") for i in items]
        known = all(isinstance(b, int) for b in sizes)
        return items, len(items), None, sum(sizes) if known else None  # type: ignore[arg-type]
    body = api.get(path, **params, limit=limit, cursor=cursor)
    data = body["data"]
    return data, body.get("total", len(data)), body.get("next_cursor"), body.get("bytes")


def _say_more(
    command: list[str],
    noun: str,
    shown: int,
    total: int,
    next_cursor: str | None,
    after_cursor: bool,
    to_stderr: bool,
) -> None:
    """Under a page: how many more there are and the commands that show them."""
    if next_cursor is None:
        return
    cmd = "profd " + " ".join(command)
    if after_cursor:
        head = f"{shown} {noun} after the cursor, {total} in all; more follow"
    else:
        head = f"the newest {shown} of {total} {noun}; {total - shown} more"
    text = f"{head}: `{cmd} --cursor {next_cursor}` for the next page, `{cmd} --all` for all"
    # soft-wrapped: the terminal folds the line, rich inserts no newline in the cursor token
    # (a copied command must work)
    (err_console if to_stderr else console).print(
        text, markup=False, highlight=False, soft_wrap=True
    )


def _command(name: str, url: str | None, limit: int, **options: str | None) -> list[str]:
    """The command line that lists the same thing (for the hints under a page)."""
    words = [name]
    if url:
        words += ["--url", url]
    for option, value in options.items():
        if value is not None:
            words += [f"--{option}", value]
    if limit != DEFAULT_LIMIT:
        words += ["--limit", str(limit)]
    return words


@app.command()
def sessions(
    url: UrlOpt = None,
    limit: LimitOpt = DEFAULT_LIMIT,
    cursor: CursorOpt = None,
    show_all: AllOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """List sessions, the newest first (a page of --limit; --all for every one)."""
    try:
        api = sidecar_client(url)
        data, total, next_cursor, _ = _listing(api, "/api/v1/sessions", limit, cursor, show_all)
    except CliError as exc:
        fail(exc)
    hint = (_command("sessions", url, limit), "sessions", len(data), total, next_cursor)
    if as_json:
        print_json(data)
        _say_more(*hint, cursor is not None, to_stderr=True)
        return
    if console.width < WIDE_SESSIONS:
        _print_sessions_narrow(data)
    else:
        table = Table(title="Sessions")
        whole = ("session", "state", "tool", "by")  # ids and words whole; the reason wraps
        for col in ("session", "state", "tool", "steps", "targets", "traces", "by", "reason"):
            table.add_column(col, overflow="fold", no_wrap=col in whole)
        for s in data:
            table.add_row(
                s["session_id"],
                s["state"],
                s["tool"],
                _steps_shown(s),
                str(len(s["targets"])),
                str(len(s["traces"])),
                s.get("trigger_id") or "request",  # what started it: a trigger (profd watch)
                s["reason"],
            )
        console.print(table)
    _say_more(*hint, cursor is not None, to_stderr=False)


#: Below this many columns (an 80-column terminal, a pipe) ``profd sessions`` prints a
#: session a line and its reason under it: eight columns cropped the reason and split ids.
WIDE_SESSIONS = 110


def _print_sessions_narrow(data: list[dict[str, Any]]) -> None:
    from rich.markup import escape

    console.print("[bold]Sessions[/bold] (newest first)")
    for s in data:
        by = f"  by {s['trigger_id']}" if s.get("trigger_id") else ""
        console.print(
            f"{escape(s['session_id'])}  {s['state']}  {escape(s['tool'])}  "
            f"{_window_shown(s)}  {len(s['targets'])} target(s)  "
            f"{len(s['traces'])} trace(s){escape(by)}",
            highlight=False,
        )
        if s["reason"]:
            console.print(f"    {escape(s['reason'])}", highlight=False)


def _steps_shown(session: dict[str, Any]) -> str:
    """A session's steps as runs (``82-111``, not thirty numbers), or its timed window
    (``for 2.5 s``)."""
    from profd.actors.selection import rank_ranges

    if session.get("steps"):
        return rank_ranges(session["steps"])
    duration = (session.get("request") or {}).get("duration_s")
    return f"for {duration:g} s" if duration else "-"


def _window_shown(session: dict[str, Any]) -> str:
    """``steps 82-111``, or ``for 2.5 s`` (a timed window has no steps)."""
    shown = _steps_shown(session)
    return shown if shown.startswith("for ") else f"steps {shown}"


@app.command()
def traces(
    url: UrlOpt = None,
    session: Annotated[str | None, typer.Option("--session", help="Only this session.")] = None,
    download: Annotated[
        Path | None,
        typer.Option(help="Download every trace (all pages) into DIR; exit 1 if any fails."),
    ] = None,
    limit: LimitOpt = DEFAULT_LIMIT,
    cursor: CursorOpt = None,
    show_all: AllOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """List traces, the newest first, one table per session (a page of --limit; --all for
    every one), and optionally download them. Paths are shown under the session's save root
    (--json gives the full path)."""
    failed: list[tuple[dict[str, Any], str]] = []
    try:
        api = sidecar_client(url)
        everything = show_all or download is not None
        data, total, next_cursor, total_bytes = _listing(
            api, "/api/v1/traces", limit, cursor, everything, session_id=session
        )
        if session is not None and not data:  # an unknown session is a 404, not "none"
            from urllib.parse import quote

            api.get(f"/api/v1/sessions/{quote(session, safe='')}")
        if download is not None:
            failed = download_traces(api, data, download, per_session=session is None)
    except CliError as exc:
        fail(exc)
    hint = (
        _command("traces", url, limit, session=session),
        "traces",
        len(data),
        total,
        next_cursor,
    )
    if as_json:
        print_json(data)
        _say_more(*hint, cursor is not None, to_stderr=True)
    else:
        print_traces(data, total, total_bytes, session)
        _say_more(*hint, cursor is not None, to_stderr=False)
    if download is not None:
        _report_downloads(download, data, failed, per_session=session is None, as_json=as_json)


def _report_downloads(
    into: Path,
    data: list[dict[str, Any]],
    failed: list[tuple[dict[str, Any], str]],
    *,
    per_session: bool,
    as_json: bool,
) -> None:
    """What `profd traces --download` wrote, and each trace it could not (exit 1)."""
    done = len(data) - len(failed)
    folders = " (a folder per session)" if per_session and data else ""
    (err_console if as_json else console).print(
        f"downloaded {done} file(s) into {into}{folders}", markup=False, highlight=False
    )
    if failed:
        err_console.print(
            f"[red]error:[/red] {len(failed)} of {len(data)} trace(s) could not be downloaded:"
        )
        for t, reason in failed:
            err_console.print(
                f"  trace {t['trace_id']} ({t['file_name']}): {reason}",
                markup=False,
                highlight=False,
            )
        raise typer.Exit(1)


@app.command()
def profile(
    url: UrlOpt = None,
    config: Annotated[
        Path | None, typer.Option(help="Request as YAML/JSON (profd or verl layout).")
    ] = None,
    tool: Annotated[
        str | None, typer.Option(help="torch, torch_memory, nsys, npu, py_spy.")
    ] = None,
    steps: Annotated[str | None, typer.Option(help="Steps to profile, e.g. 120,121.")] = None,
    next_steps: Annotated[int | None, typer.Option(help="Profile the next N steps.")] = None,
    duration: Annotated[
        float | None,
        typer.Option(
            "--duration",
            callback=finite,
            metavar="SECONDS",
            help="Profile for SECONDS (targets without steps: rollout servers, timed tools).",
        ),
    ] = None,
    role: Annotated[
        list[str], typer.Option(help="Role to profile (repeatable; default all).")
    ] = [],  # noqa: B006
    ranks: Annotated[str | None, typer.Option(help="Ranks of those roles, e.g. 0,8.")] = None,
    all_ranks: Annotated[bool, typer.Option("--all-ranks", help="Every rank.")] = False,
    job: Annotated[
        str | None,
        typer.Option(help="Only this Ray job's agents (`profd status` shows each one's job)."),
    ] = None,
    discrete: Annotated[bool, typer.Option("--discrete", help="One trace per stage.")] = False,
    contents: Annotated[
        str | None, typer.Option(help="torch contents, e.g. cpu,cuda,stack.")
    ] = None,
    continuous: Annotated[
        bool, typer.Option("--continuous-steps", help="Consecutive steps share one trace.")
    ] = False,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the session ends.")] = False,
    timeout: Annotated[
        float, typer.Option(callback=finite_from(0), help="Seconds to --wait.")
    ] = 3600.0,
    as_json: JsonOpt = False,
) -> None:
    """Start a profiling session over HTTP (one of --steps, --next-steps, --duration)."""
    check_window(steps, next_steps, duration, config)
    body = build_request(
        config,
        tool,
        steps,
        next_steps,
        role,
        ranks,
        all_ranks,
        discrete,
        contents,
        continuous,
        duration=duration,
    )
    if job is not None:
        body["job_id"] = job
    _start_session(url, body, wait, timeout, as_json)


def _start_session(
    url: str | None, body: dict[str, Any], wait: bool, timeout: float, as_json: bool
) -> None:
    """POST the request, show the session (and, with ``wait``, follow it to its end)."""
    try:
        api = sidecar_client(url)
        view = api.post("/api/v1/sessions", body)
        if wait:
            view = wait_session(api, view, timeout, quiet=as_json)
    except CliError as exc:
        fail(exc)
    if as_json:
        print_json(view)
    else:
        print_session(view)
        if wait:
            print_outcome(view)
    if wait and view["state"] != "done":
        raise typer.Exit(1)


@app.command()
def cancel(
    session_id: Annotated[str, typer.Argument(metavar="SESSION_ID", help="Session to stop.")],
    reason: Annotated[str | None, typer.Option(help="Why (kept as the session's reason).")] = None,
    wait_s: Annotated[
        float,
        typer.Option(
            "--wait-s",
            callback=finite_from(0),
            help="Seconds to wait for the traces the cancel flushes (targets recording).",
        ),
    ] = 30.0,
    url: UrlOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Stop a live session; what it recorded so far is kept, and a window still open is
    written (its trace waited for, up to --wait-s)."""
    from urllib.parse import quote

    path = f"/api/v1/sessions/{quote(session_id, safe='')}"
    try:
        api = sidecar_client(url)
        writing = writing_targets(api.get(path))
        view = api.post(f"{path}/cancel", {"reason": reason} if reason else None)
    except CliError as exc:
        if exc.status == 409:
            exc = CliError(f"{exc} (nothing to cancel)", exc.exit_code, exc.status)
        fail(exc)
    view, left = settle_cancelled(api, view, writing, wait_s, quiet=as_json)
    if as_json:
        print_json({**view, "still_writing": left})
        return
    print_outcome(view, details=True)
    if left:
        who = ", ".join(
            f"{t['role']} rank {t['rank']}" for t in view["targets"] if t["agent_id"] in left
        )
        console.print(
            f"  still writing their last trace after {wait_s:g} s: {who}; `profd traces "
            f"--session {session_id}` lists them once written",
            markup=False,
            highlight=False,
        )


# -- demo -----------------------------------------------------------------------------------
@app.command()
def demo(
    steps: Annotated[int, typer.Option(help="Training steps per worker.")] = 8,
    port: Annotated[int, typer.Option(help="Sidecar port (0 = any free port).")] = 0,
    save_root: Annotated[Path | None, typer.Option(help="Where traces go.")] = None,
    address: Annotated[str | None, typer.Option(help="Join this Ray cluster instead.")] = None,
) -> None:
    """Run a small RL job, profile 2 of its steps over HTTP, show the traces, then make one
    rank slow and show the trigger that profiles it by itself."""
    from rich.markup import escape

    from profd.demo.run import DemoRefused, run_demo

    logging.basicConfig(level=logging.WARNING)
    try:
        result = run_demo(console, steps=steps, port=port, save_root=save_root, address=address)
    except DemoRefused as exc:
        err_console.print(f"[red]{escape(str(exc))}[/red]")
        raise typer.Exit(1) from None
    if not result.ok:
        first = result.session.get("state")
        fired = result.fired.session.get("state") if result.fired is not None else None
        if first != "done" or not result.traces:
            err_console.print(f"[red]demo session ended {first}[/red]")
        else:
            err_console.print(f"[red]the demo's triggered session ended {fired}[/red]")
        raise typer.Exit(1)


service.register(app)
analysis.register(app)  # profd merge / profd summarize
app.command("diff")(diff_view.diff)
app.command("watch")(watch_view.watch)
app.command("stacks")(stacks_view.stacks)
app.command("export")(export_view.export)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
