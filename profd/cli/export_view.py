"""``profd export --hta SESSION DIR``: write a session's traces as a folder HTA loads as is
(one file per role x rank, unique ``distributedInfo.rank``, ``ProfilerStep#<n>`` rows over
profd's steps; see :mod:`profd.analysis.hta_export` and ``docs/hta-export.md``).

SESSION is a directory or a session id (resolved by the sidecar, as ``profd summarize``
does). DIR must be new or empty: nothing is overwritten. Bad arguments exit 2 naming the
argument; an unreachable sidecar exits 3.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from profd.cli.analysis import (
    UrlOpt,
    WorkersOpt,
    _fail,
    _usage_error,
    console,
    err_console,
    resolve_target,
)
from profd.cli.client import CliError
from profd.cli.common import comma_list

if TYPE_CHECKING:
    from profd.analysis.hta_export import HtaExport

__all__ = ["export", "print_export"]


def print_export(report: HtaExport) -> None:
    """The HTA ranks written (rank -> track), then what was skipped and what to know."""
    from profd.analysis.hta_export import HTA_RANKS_FILE

    table = Table(title=f"HTA ranks written to {report.output}", title_justify="left")
    for col in ("HTA rank", "track", "files", "steps", "ProfilerStep rows"):
        table.add_column(col, overflow="fold", justify="right" if col == "HTA rank" else "left")
    for r in report.ranks:
        if r.added_profiler_steps:
            rows = "added: " + ",".join(map(str, r.added_profiler_steps))
        else:
            rows = "torch's" if r.steps else "-"
        steps = ",".join(map(str, r.steps)) or "-"
        table.add_row(str(r.hta_rank), r.track, str(len(r.sources)), steps, rows)
    console.print(table)
    console.print(
        f"Rank map: {Path(report.output) / HTA_RANKS_FILE}. In Python (HTA 0.5): "
        f"TraceAnalysis(trace_dir={report.output!r}, include_last_profiler_step=True)",
        soft_wrap=True,
    )
    for s in report.skipped:
        err_console.print(f"[yellow]skipped[/yellow] {s.name}: {s.reason}")
    for note in report.notes:
        err_console.print(f"[yellow]note[/yellow] {note}")


def export(
    session: Annotated[
        str,
        typer.Argument(
            metavar="SESSION", help="Session directory, or a session id (resolved by the sidecar)."
        ),
    ],
    out_dir: Annotated[
        Path, typer.Argument(metavar="DIR", help="Folder to write (new, or empty).")
    ],
    hta: Annotated[
        bool, typer.Option("--hta", help="HTA's layout (the one format for now; required).")
    ] = False,
    steps: Annotated[
        str | None, typer.Option(help="Only the files holding these steps, e.g. 3 or 3,4.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    workers: WorkersOpt = None,
    url: UrlOpt = None,
) -> None:
    """Write a session's traces as a folder HTA (Holistic Trace Analysis) loads as is: one
    file per role x rank with a unique distributedInfo.rank, `ProfilerStep#N` rows over
    profd's steps, and a rank map; the session's files are never touched."""
    from profd.analysis.hta_export import export_hta

    if not hta:
        raise typer.BadParameter("choose the format: --hta is the one there is", param_hint="--hta")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        what = "is a file" if not out_dir.is_dir() else "exists and is not empty"
        raise typer.BadParameter(f"{out_dir} {what}; choose a new folder", param_hint="DIR")
    wanted = comma_list(steps, "--steps", as_int=True)
    try:
        try:
            directory = resolve_target(session, url)
        except typer.BadParameter as exc:
            exc.param_hint = "SESSION"
            raise
        report = export_hta(directory, out_dir, steps=wanted, workers=workers)
    except CliError as exc:
        _fail(exc)
    except ValueError as exc:
        _usage_error(exc)
    if as_json:
        sys.stdout.write(json.dumps(report.model_dump(mode="json"), indent=2) + "\n")
    else:
        print_export(report)
