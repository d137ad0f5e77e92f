"""The ``profd`` command line.

Exit codes: 0 success; 1 the request failed or a session did not end ``done``; 2 bad usage;
3 the sidecar cannot be reached.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.table import Table

from profd.cli import analysis, service
from profd.cli.client import EXIT_UNREACHABLE, ApiClient, CliError
from profd.core.paging import DEFAULT_LIMIT, MAX_LIMIT
from profd.core.settings import ProfdSettings
from profd.core.states import PartState

__all__ = ["app", "main"]

app = typer.Typer(
    name="profd",
    help="Live, step-aligned profiling of PyTorch training on Ray.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()
err_console = Console(stderr=True)

UrlOpt = Annotated[
    str | None, typer.Option("--url", help="Sidecar URL (default: from `profd up`).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
TERMINAL = ("done", "partial", "failed", "cancelled", "expired")


def _settings() -> ProfdSettings:
    return ProfdSettings()


def _client(url: str | None) -> ApiClient:
    return ApiClient.from_state(url, _settings().state_dir)


def _fail(exc: CliError) -> None:
    err_console.print(f"[red]error:[/red] {exc}")
    raise typer.Exit(exc.exit_code)


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


# -- status / lists -------------------------------------------------------------------------
@app.command()
def status(url: UrlOpt = None, as_json: JsonOpt = False) -> None:
    """Agents and sessions at a glance."""
    try:
        api = _client(url)
        st = api.get("/api/v1/status")
        agents = api.get("/api/v1/agents")["data"]
    except CliError as exc:
        _fail(exc)
    if as_json:
        _print_json({"status": st, "agents": agents})
        return
    console.print(
        f"profd {st['version']} at {api.url}: {st['agents']} agents alive, "
        f"{st['traces']} traces ({st['trace_bytes'] / 1e6:.1f} MB), "
        f"save root {st['save_root']}"
    )
    if st.get("driver_step") is not None:
        console.print(
            f"driver (profd.controller()) at step {st['driver_step']}, "
            f"{st['driver_seen_s']:.1f}s ago"
        )
    if st["live_sessions"]:
        console.print("live sessions: " + ", ".join(st["live_sessions"]))
    table = Table(title="Agents")
    for col in ("role", "rank", "world", "node", "pid", "state", "step", "last seen"):
        table.add_column(col)
    for a in agents:
        table.add_row(
            a["role"],
            str(a["rank"]),
            str(a["world_size"] or "-"),
            a["node_ip"] or a["hostname"],
            str(a["pid"]),
            a["state"],
            _step_cell(a),
            f"{a['last_seen_s']:.1f}s",
        )
    console.print(table)


def _step_cell(agent: dict[str, Any]) -> str:
    step = agent.get("current_step")
    if step is None:
        return "-"
    return f"{step} (driver)" if agent.get("step_source") == "driver" else str(step)


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
) -> tuple[list[dict[str, Any]], int, str | None]:
    """One page (or, with ``show_all``, every page): its items, how many match in all and
    the cursor of the next page (None when nothing follows)."""
    if show_all:
        items = api.get_all(path, **params)
        return items, len(items), None
    body = api.get(path, **params, limit=limit, cursor=cursor)
    return body["data"], body.get("total", len(body["data"])), body.get("next_cursor")


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
    (err_console if to_stderr else console).print(text, markup=False, highlight=False)


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
        api = _client(url)
        data, total, next_cursor = _listing(api, "/api/v1/sessions", limit, cursor, show_all)
    except CliError as exc:
        _fail(exc)
    hint = (_command("sessions", url, limit), "sessions", len(data), total, next_cursor)
    if as_json:
        _print_json(data)
        _say_more(*hint, cursor is not None, to_stderr=True)
        return
    table = Table(title="Sessions")
    for col in ("session", "state", "tool", "steps", "targets", "traces", "reason"):
        table.add_column(col, overflow="fold")
    for s in data:
        table.add_row(
            s["session_id"],
            s["state"],
            s["tool"],
            str(s["steps"]),
            str(len(s["targets"])),
            str(len(s["traces"])),
            s["reason"],
        )
    console.print(table)
    _say_more(*hint, cursor is not None, to_stderr=False)


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
    """List traces, the newest first (a page of --limit; --all for every one), and
    optionally download them."""
    from profd.demo.run import trace_table

    failed: list[tuple[dict[str, Any], str]] = []
    try:
        api = _client(url)
        everything = show_all or download is not None
        data, total, next_cursor = _listing(
            api, "/api/v1/traces", limit, cursor, everything, session_id=session
        )
        if download is not None:
            failed = _download_traces(api, data, download)
    except CliError as exc:
        _fail(exc)
    hint = (
        _command("traces", url, limit, session=session),
        "traces",
        len(data),
        total,
        next_cursor,
    )
    if as_json:
        _print_json(data)
        _say_more(*hint, cursor is not None, to_stderr=True)
    else:
        console.print(trace_table(data))
        _say_more(*hint, cursor is not None, to_stderr=False)
    if download is None:
        return
    done = len(data) - len(failed)
    (err_console if as_json else console).print(
        f"downloaded {done} file(s) into {download}", markup=False, highlight=False
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


def _download_traces(
    api: ApiClient, traces: list[dict[str, Any]], into: Path
) -> list[tuple[dict[str, Any], str]]:
    """Download each trace into ``into`` (through a ``.part`` file, so a failed one leaves
    nothing behind); the ones that failed, with the reason. Stops only when the sidecar
    cannot be reached at all (raises)."""
    try:
        into.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"cannot create {into}: {exc.strerror or exc}") from None
    failed: list[tuple[dict[str, Any], str]] = []
    for t in traces:
        dest = into / t["file_name"]
        part = dest.with_name(dest.name + ".part")
        try:
            api.download(f"/api/v1/traces/{t['trace_id']}/download", part)
            part.replace(dest)
        except CliError as exc:
            part.unlink(missing_ok=True)
            if exc.exit_code == EXIT_UNREACHABLE:
                raise
            failed.append((t, str(exc)))
        except OSError as exc:
            part.unlink(missing_ok=True)
            failed.append((t, f"cannot write {dest}: {exc.strerror or exc}"))
    return failed


# -- profile --------------------------------------------------------------------------------
def _ints(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None


def _build_request(
    config: Path | None,
    tool: str | None,
    steps: str | None,
    next_steps: int | None,
    roles: list[str],
    ranks: str | None,
    all_ranks: bool,
    discrete: bool,
    contents: str | None,
    continuous: bool,
) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if config is not None:
        from profd.driver.launch import resolve_interpolations
        from profd.driver.verl import looks_like_verl, request_from_verl

        try:
            loaded = resolve_interpolations(yaml.safe_load(config.read_text()) or {})
            if not isinstance(loaded, dict):
                raise ValueError(
                    f"config: must be a mapping (verl's global_profiler + <role>.profiler, or "
                    f"a session request), got {type(loaded).__name__}"
                )
            body = (
                request_from_verl(loaded).model_dump(mode="json", exclude_none=True)
                if looks_like_verl(loaded)
                else dict(loaded)
            )
        except (ValueError, yaml.YAMLError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--config") from None
    if tool:
        body["tool"] = tool
    if steps is not None:
        body["steps"] = _ints(steps)
        body.pop("next_steps", None)
    if next_steps is not None:
        body["next_steps"] = next_steps
        body.pop("steps", None)
    if continuous:
        body["profile_continuous_steps"] = True
    block: dict[str, Any] = {}
    if all_ranks:
        block["all_ranks"] = True
    if ranks is not None:
        block["ranks"] = _ints(ranks)
    if discrete:
        block["discrete"] = True
    if contents is not None:
        block["tool_config"] = {"torch": {"contents": [c for c in contents.split(",") if c]}}
    if roles or block:
        body.setdefault("roles", {})
        for role in roles or ["*"]:
            body["roles"][role] = {**body["roles"].get(role, {}), **block}
    return body


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
    role: Annotated[
        list[str], typer.Option(help="Role to profile (repeatable; default all).")
    ] = [],  # noqa: B006
    ranks: Annotated[str | None, typer.Option(help="Ranks of those roles, e.g. 0,8.")] = None,
    all_ranks: Annotated[bool, typer.Option("--all-ranks", help="Every rank.")] = False,
    discrete: Annotated[bool, typer.Option("--discrete", help="One trace per stage.")] = False,
    contents: Annotated[
        str | None, typer.Option(help="torch contents, e.g. cpu,cuda,stack.")
    ] = None,
    continuous: Annotated[
        bool, typer.Option("--continuous-steps", help="Consecutive steps share one trace.")
    ] = False,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the session ends.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to --wait.")] = 3600.0,
    as_json: JsonOpt = False,
) -> None:
    """Start a profiling session over HTTP."""
    body = _build_request(
        config, tool, steps, next_steps, role, ranks, all_ranks, discrete, contents, continuous
    )
    try:
        api = _client(url)
        view = api.post("/api/v1/sessions", body)
        if wait:
            view = _wait_session(api, view, timeout, quiet=as_json)
    except CliError as exc:
        _fail(exc)
    if as_json:
        _print_json(view)
    else:
        _print_session(view)
    if wait and view["state"] != "done":
        raise typer.Exit(1)


def _wait_session(
    api: ApiClient, view: dict[str, Any], timeout: float, quiet: bool
) -> dict[str, Any]:
    from rich.progress import BarColumn, Progress, TextColumn

    sid = view["session_id"]
    deadline = time.monotonic() + timeout
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[state]}"),
        console=err_console,
        disable=quiet,
        transient=True,
    ) as bar:
        task = bar.add_task(f"session {sid}", total=max(1, len(view["targets"])), state="")
        while view["state"] not in TERMINAL:
            if time.monotonic() > deadline:
                raise CliError(f"session {sid} still {view['state']} after {timeout:.0f} s")
            time.sleep(0.5)
            view = api.get(f"/api/v1/sessions/{sid}")
            done = sum(1 for t in view["targets"] if PartState(t["state"]).is_terminal)
            bar.update(task, completed=done, state=view["state"])
    return view


def _print_session(view: dict[str, Any]) -> None:
    console.print(f"session [bold]{view['session_id']}[/bold] {view['state']}: {view['reason']}")
    console.print(f"  tool {view['tool']}, steps {view['steps']}, dir {view['save_dir']}")
    table = Table(title="Targets")
    for col in ("role", "rank", "block", "state", "recorded", "missed", "reason"):
        table.add_column(col, overflow="fold")
    for t in view["targets"]:
        table.add_row(
            t["role"],
            str(t["rank"]),
            t["role_block"],
            t["state"],
            str(t["recorded_steps"]),
            str(t["missed_steps"]),
            t["reason"],
        )
    console.print(table)
    for ig in view["ignored"]:
        rank = "" if ig["rank"] is None else f" rank {ig['rank']}"
        console.print(f"  ignored {ig['role']}{rank}: {ig['reason']}")


# -- demo -----------------------------------------------------------------------------------
@app.command()
def demo(
    steps: Annotated[int, typer.Option(help="Training steps per worker.")] = 8,
    port: Annotated[int, typer.Option(help="Sidecar port (0 = any free port).")] = 0,
    save_root: Annotated[Path | None, typer.Option(help="Where traces go.")] = None,
    address: Annotated[str | None, typer.Option(help="Join this Ray cluster instead.")] = None,
) -> None:
    """Run a small RL job, profile 2 of its steps over HTTP, and show the traces."""
    from profd.demo.run import run_demo

    logging.basicConfig(level=logging.WARNING)
    result = run_demo(console, steps=steps, port=port, save_root=save_root, address=address)
    if not result.ok:
        err_console.print(f"[red]demo session ended {result.session.get('state')}[/red]")
        raise typer.Exit(1)


service.register(app)
analysis.register(app)  # profd merge / profd summarize


def main() -> None:
    app()


if __name__ == "__main__":
    main()
