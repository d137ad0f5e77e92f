"""``profd traces``: the trace index as one table per session, and downloads."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from profd.cli.client import EXIT_UNREACHABLE, ApiClient, CliError, format_bytes
from profd.cli.common import (
    console,
)


def save_root_of(trace: dict[str, Any]) -> str | None:
    """The save root a trace lies under: the parent of its session's directory (named by
    the session id); None when its path does not show one."""
    parts = Path(trace["path"]).parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == trace["session_id"]:
            return str(Path(*parts[:i]))
    return None


def shown_path(trace: dict[str, Any]) -> str:
    """A trace's path relative to its save root (``<session id>/[sub/]<file>``), or the full
    path when it does not lie in a session directory."""
    root = save_root_of(trace)
    return str(Path(trace["path"]).relative_to(root)) if root else trace["path"]


def by_session(traces: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Traces grouped by session, the session with the newest trace first, each group's
    traces newest first."""
    groups: dict[str, list[dict[str, Any]]] = {}
    newest = sorted(traces, key=lambda t: (t["created_at"], t["trace_id"]), reverse=True)
    for t in newest:
        groups.setdefault(t["session_id"], []).append(t)
    return list(groups.items())


def steps_cell(steps: list[int]) -> str:
    if not steps:
        return "-"
    return str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"


def traces_tables(traces: list[dict[str, Any]], page: bool = False) -> list[Table]:
    """One table per session: its traces newest first, paths under the save root (``page``:
    a page of a longer listing, so a session's count is this page's)."""
    tables = []
    where = " on this page" if page else ""
    for sid, group in by_session(traces):
        roots = {save_root_of(t) for t in group}
        root = roots.pop() if len(roots) == 1 else None
        size = format_bytes(sum(t["bytes"] for t in group))
        table = Table(
            title=f"session {sid}: {len(group)} trace(s){where}, {size}",
            title_justify="left",
            caption=f"paths under {root}/" if root else None,
            caption_justify="left",
        )
        for col in ("written", "role", "rank", "step", "size", "path"):
            table.add_column(
                col,
                overflow="fold",
                justify="right" if col in ("rank", "size") else "left",
                no_wrap=col in ("written", "size"),
            )
        for t in group:
            written = time.strftime("%H:%M:%S", time.localtime(t["created_at"]))
            table.add_row(
                written,
                t["role"],
                str(t["rank"]),
                steps_cell(t["steps"]),
                format_bytes(t["bytes"]),
                shown_path(t) if root else t["path"],
            )
        tables.append(table)
    return tables


def print_traces(
    data: list[dict[str, Any]], total: int, total_bytes: int | None, session: str | None
) -> None:
    if not data:
        console.print("no traces" + (f" of session {session}" if session else ""))
        return
    for table in traces_tables(data, page=total > len(data)):
        console.print(table)
    shown = format_bytes(sum(t["bytes"] for t in data))
    if total == len(data):
        line = f"{total} trace(s), {shown}"
    else:
        every = f" of {format_bytes(total_bytes)}" if total_bytes is not None else ""
        line = f"{len(data)} of {total} trace(s) shown, {shown}{every}"
    console.print(line, markup=False, highlight=False)


def session_folder(session_id: str) -> str:
    """The folder a session's downloads go in when the download is not of one session (a
    folder each, so `profd merge DIR/<session>` merges one session, never several)."""
    name = session_id.replace("/", "_").replace("\\", "_")
    return name if name not in ("", ".", "..") else f"session-{name}"


def download_traces(
    api: ApiClient, traces: list[dict[str, Any]], into: Path, per_session: bool = True
) -> list[tuple[dict[str, Any], str]]:
    """Download each trace into ``into`` (``per_session``: into a folder per session, the
    same layout whatever the listing holds; through a ``.part`` file, so a failed one
    leaves nothing behind); the ones that failed, with the reason. Stops only when the sidecar
    cannot be reached at all (raises)."""
    try:
        into.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"cannot create {into}: {exc.strerror or exc}") from None
    failed: list[tuple[dict[str, Any], str]] = []
    for t in traces:
        folder = into / session_folder(t["session_id"]) if per_session else into
        dest = folder / t["file_name"]
        part = dest.with_name(dest.name + ".part")
        try:
            folder.mkdir(exist_ok=True)
            api.download(f"/api/v1/traces/{t['trace_id']}/download", part)
            part.replace(dest)
            continue
        except CliError as exc:
            if exc.exit_code == EXIT_UNREACHABLE:
                part.unlink(missing_ok=True)
                raise
            failed.append((t, str(exc)))
        except OSError as exc:
            failed.append((t, f"cannot write {dest}: {exc.strerror or exc}"))
        part.unlink(missing_ok=True)
        if folder != into:  # a session's folder holds only what was downloaded
            with contextlib.suppress(OSError):
                folder.rmdir()  # (only when empty)
    return failed
