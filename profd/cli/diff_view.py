"""``profd diff A B``: session B against session A (directories or session ids), per stage x
role with a verdict, per rank, and the operators that changed most; ``--json``, ``--html``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from profd.analysis.diff import DIFF_TOP_OPS, DiffRule, SessionDiff, Verdict
from profd.analysis.diff_gpu import GpuChange, GpuScope
from profd.cli.analysis import (
    UrlOpt,
    WorkersOpt,
    _fail,
    _usage_error,
    err_console,
    resolve_target,
)
from profd.cli.client import CliError
from profd.cli.common import finite

__all__ = ["diff", "print_diff"]

_COLOUR = {Verdict.SLOWER: "red", Verdict.FASTER: "green"}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def _signed(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:+,.1f}{unit}"


def _verdict(v: Verdict) -> str:
    colour = _COLOUR.get(v)
    return f"[{colour}]{v.value}[/{colour}]" if colour else v.value


def gpu_scope_label(c: GpuChange) -> str:
    """'(window)' for a role's whole profiled window, else the stage (or '(outside stages)')."""
    if c.scope is GpuScope.WINDOW:
        return "(window)"
    return c.stage if c.stage is not None else "(outside stages)"


def _a_to_b(c: GpuChange, field: str) -> str:
    def one(v: float | None) -> str:
        return "-" if v is None else f"{v:,.1f}"

    a = None if c.a is None else getattr(c.a, field)
    b = None if c.b is None else getattr(c.b, field)
    return f"{one(a)} → {one(b)}"


def _print_gpu(d: SessionDiff, out: Console) -> None:
    roles = [c for c in d.gpu if c.rank is None]
    if not roles:
        return
    table = Table(title="GPU per step (ms), A → B, each role's mean rank", title_justify="left")
    for col in ("stage", "role", "idle", "compute", "non-compute", "overlap %"):
        table.add_column(
            col, overflow="fold", justify="left" if col in ("stage", "role") else "right"
        )
    for c in roles:
        table.add_row(
            gpu_scope_label(c), c.role or "-", _a_to_b(c, "idle_ms"), _a_to_b(c, "compute_ms"),
            _a_to_b(c, "non_compute_ms"), _a_to_b(c, "comm_comp_overlap_pct"),
        )  # fmt: skip
    out.print(table)


def print_diff(d: SessionDiff, out: Console | None = None) -> None:
    """The stage table with verdicts, the per-rank changes beyond the noise, each role's GPU
    time per step, the top ops."""
    out = out or Console()
    out.print(f"A: {d.a}\nB: {d.b}")
    table = Table(title="Stages: median wall time per step (ms), B against A", title_justify="left")
    for col in ("stage", "role", "A", "B", "change", "%", "verdict"):
        table.add_column(
            col, overflow="fold", justify="left" if col in ("stage", "role") else "right"
        )
    for c in d.stages:
        table.add_row(
            c.stage, c.role or "-", _ms(c.a_ms), _ms(c.b_ms), _signed(c.delta_ms),
            _signed(c.delta_pct, "%"), _verdict(c.verdict),
        )  # fmt: skip
    out.print(table)
    rule = d.rule
    out.print(
        f"Noise: a change counts beyond max({rule.k:g} x A's spread (scaled MAD), "
        f"{rule.abs_floor_ms:g} ms, {rule.rel_floor:.0%} of A)."
    )
    moved = [c for c in d.ranks if c.verdict in _COLOUR]
    if moved:
        ranks = Table(title="Ranks whose stage changed", title_justify="left")
        for col in ("stage", "role", "rank", "A", "B", "change", "verdict"):
            ranks.add_column(col, justify="left" if col in ("stage", "role") else "right")
        for c in moved:
            ranks.add_row(
                c.stage, c.role or "-", str(c.rank), _ms(c.a_ms), _ms(c.b_ms),
                _signed(c.delta_ms), _verdict(c.verdict),
            )  # fmt: skip
        out.print(ranks)
    _print_gpu(d, out)
    if d.ops:
        ops = Table(title="Operators and kernels that changed most (self ms)", title_justify="left")
        for col in ("stage", "operator", "calls A", "calls B", "A", "B", "change"):
            ops.add_column(
                col, overflow="fold", justify="left" if col in ("stage", "operator") else "right"
            )
        for o in d.ops:
            ops.add_row(
                o.stage or "-", o.name, str(o.a_calls), str(o.b_calls), _ms(o.a_self_ms),
                _ms(o.b_self_ms), _signed(o.delta_ms),
            )  # fmt: skip
        out.print(ops)


def diff(
    a: Annotated[str, typer.Argument(help="Session A: a directory or a session id.")],
    b: Annotated[str, typer.Argument(help="Session B, compared against A.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the diff as JSON.")] = False,
    html: Annotated[Path | None, typer.Option("--html", help="Also write an HTML view.")] = None,
    top: Annotated[int, typer.Option(help="Operators listed.", min=1)] = 10,
    noise_k: Annotated[
        float, typer.Option(callback=finite, help="Noise: multiple of the spread.")
    ] = 3.0,
    noise_floor_ms: Annotated[
        float, typer.Option(callback=finite, help="Noise: at least this (ms).")
    ] = 1.0,
    noise_fraction: Annotated[
        float, typer.Option(callback=finite, help="Noise: at least this share of A.")
    ] = 0.05,
    workers: WorkersOpt = None,
    url: UrlOpt = None,
) -> None:
    """Session B against session A: per stage x role (and rank) the median wall time, its
    change and a verdict (slower / faster / same within noise), and the operators that
    changed most."""
    from pydantic import ValidationError

    from profd.analysis.diff import diff_summaries
    from profd.analysis.summary import summarize_dir

    try:
        rule = DiffRule(k=noise_k, abs_floor_ms=noise_floor_ms, rel_floor=noise_fraction)
    except ValidationError as exc:
        err = exc.errors()[0]
        option = {
            "k": "--noise-k",
            "abs_floor_ms": "--noise-floor-ms",
            "rel_floor": "--noise-fraction",
        }
        raise typer.BadParameter(err["msg"], param_hint=option.get(str(err["loc"][0]))) from None
    try:
        summaries = [
            summarize_dir(resolve_target(t, url), workers=workers, top=DIFF_TOP_OPS) for t in (a, b)
        ]
        result = diff_summaries(*summaries, rule=rule, top=top)
    except CliError as exc:
        _fail(exc)
    except ValueError as exc:
        _usage_error(exc)
    if html is not None:
        from profd.analysis.diff_report import write_diff_html

        write_diff_html(result, html)
    if as_json:
        sys.stdout.write(json.dumps(result.model_dump(mode="json"), indent=2) + "\n")
    else:
        print_diff(result)
    if html is not None:
        err_console.print(f"HTML view: {html}")
