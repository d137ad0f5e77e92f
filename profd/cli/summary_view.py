"""What ``profd summarize`` prints: the summary folded over steps, at the terminal's width
(80 columns when stdout is not one), long names shortened with a legend; ``--per-step``
hands over to :mod:`profd.cli.summary_per_step`."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table

from profd.cli.client import format_bytes
from profd.cli.summary_per_step import print_per_step, short_track
from profd.core.naming import parse_trace_name

if TYPE_CHECKING:
    from profd.analysis.models import FileInfo, SessionSummary

err_console = Console(stderr=True)


# Display widths (characters) of names in the default, 80-column output; --wide lifts them.
STAGE_W, ROLE_W, TRACK_W, OP_W = 18, 17, 17, 28
DEFAULT_COLUMNS = 80


WIDE_COLUMNS = 100_000  # --wide: never wrap, never shorten


def _columns(wide: bool) -> int:
    """The console width: the terminal's when stdout is one, else 80 (pipes, tests, CI)."""
    if wide:
        return WIDE_COLUMNS
    if sys.stdout.isatty():
        return shutil.get_terminal_size((DEFAULT_COLUMNS, 24)).columns
    return DEFAULT_COLUMNS


@dataclass(frozen=True)
class _Names:
    """Display names of stages, roles and tracks, and the legend of the shortened ones."""

    stage: dict[str, str]
    role: dict[str, str]
    track: dict[str, str]

    @classmethod
    def of(cls, s: SessionSummary, wide: bool) -> _Names:
        from profd.analysis.aggregate import short_names

        stages = [*s.stages, *(g.stage for g in s.top_ops if g.stage)]
        stages += [x for g in s.idle_gaps for x in (g.after, g.before)]
        roles = [t.role for t in s.tracks if t.role]
        tracks = [short_track(t.track) for t in s.tracks if t.rank is None]  # shown for no rank
        if wide:
            return cls(*({n: n for n in names} for names in (stages, roles, tracks)))
        return cls(
            short_names(stages, STAGE_W), short_names(roles, ROLE_W), short_names(tracks, TRACK_W)
        )

    def st(self, stage: str | None) -> str:
        return "(outside)" if stage is None else self.stage.get(stage, stage)

    def ro(self, role: str | None) -> str:
        return "-" if role is None else self.role.get(role, role)

    def rank(self, rank: int | None, track: str) -> str:
        """``r3``, or the (short) track name where there is no rank."""
        return (
            f"r{rank}"
            if rank is not None
            else self.track.get(short_track(track), short_track(track))
        )

    def legend(self) -> list[tuple[str, str]]:
        pairs = [*self.stage.items(), *self.role.items(), *self.track.items()]
        return list(dict.fromkeys((short, full) for full, short in pairs if short != full))


_TEXT_COLUMNS = frozenset(
    {"stage", "role", "rank", "slowest", "dev", "operator", "after", "before", "track"}
)


def _table(title: str, *columns: str) -> Table:
    """A borderless table whose cells never wrap (names are shortened to fit instead)."""
    table = Table(
        title=title,
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
        title_justify="left",
    )
    for col in columns:
        text = col in _TEXT_COLUMNS
        table.add_column(
            col, no_wrap=True, overflow="ellipsis", justify="left" if text else "right"
        )
    return table


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _pct(part: float | None, whole: float = 100.0) -> str:
    return "-" if part is None or whole <= 0 else f"{100 * part / whole:.1f}%"


class _Spaced:
    """A console whose next print comes after a blank line, when ``gap`` is set: a section
    that prints nothing leaves no empty line (three stood before the operators)."""

    def __init__(self, out: Console) -> None:
        self._out = out
        self.gap = False

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.gap:
            self.gap = False
            self._out.print()
        self._out.print(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)


def print_summary(
    s: SessionSummary, out: Console | None = None, per_step: bool = False, wide: bool = False
) -> None:
    """The summary for people: folded over steps (a size independent of the step count),
    or every step with ``per_step``."""
    from profd.analysis.aggregate import steps_text

    out = out or Console(width=_columns(wide))
    p = s.processing
    out.print(
        f"[bold]{s.source}[/bold]: {len(s.tracks)} tracks, {len(s.files)} files "
        f"({format_bytes(p.json_bytes)} JSON, {p.wall_s:.2f} s), steps {steps_text(s.steps)}, "
        f"span {s.span_ms:,.1f} ms",
        soft_wrap=wide,
    )
    if per_step:
        print_per_step(s, out)
    else:
        names = _Names.of(s, wide)
        _print_stage_aggregates(s, out, names)
        _print_legend(out, names)
        sections = (
            _print_straggler_aggregates,
            _print_idle_aggregates,
            _print_minis_folded,
            _print_gpu,
        )
        spaced = _Spaced(out)
        for section in sections:
            spaced.gap = True
            section(s, spaced, names)  # type: ignore[arg-type]
        spaced.gap = True
        _print_top_ops(s, spaced, names, wide)  # type: ignore[arg-type]
    for x in s.skipped:
        err_console.print(f"[yellow]skipped[/yellow] {x.name}: {x.reason}")
    for line in partial_lines(s.files):
        err_console.print(f"[yellow]partial[/yellow] {line}", soft_wrap=True)  # one line each
    for a in s.aligned:
        err_console.print(
            f"[yellow]placed[/yellow] {a.name} has no wall clock of its own: its ts 0 was "
            f"placed at the {a.source}, {a.offset_ms:,.1f} ms after t0 "
            f"(± {a.uncertainty_ms:.1f} ms)"
        )


def partial_lines(files: list[FileInfo]) -> list[str]:
    """The files that hold steps only in part, a line each to grep; the windows of a discrete
    stage's schedule (its ``_mb`` files and the ``_part`` after them, a few mini-batches
    each: partial by design) folded into one line per collection, or a rank's schedule would
    print a line per mini-batch."""
    collections: dict[str, list[FileInfo]] = {}
    scheduled: set[str] = set()  # the stems of a schedule's windows
    for f in files:
        if f.partial_steps:
            suffix = parts.suffix if (parts := parse_trace_name(f.name)) else ""
            stem = f.name[: f.name.rindex(suffix)] if suffix else f.name
            collections.setdefault(stem, []).append(f)
            if suffix.startswith("_mb"):
                scheduled.add(stem)
    lines: list[str] = []
    for stem, group in collections.items():
        if stem not in scheduled:
            for f in group:
                which = ", ".join(map(str, f.partial_steps))
                lines.append(
                    f"{f.name}: holds step {which} only in part, left out of step and stage times"
                )
            continue
        which = ", ".join(map(str, sorted({n for f in group for n in f.partial_steps})))
        more = f" and {len(group) - 1} more" if len(group) > 1 else ""
        lines.append(
            f"{group[0].name}{more}: a schedule's windows of step {which}, a few mini-batches "
            "each; their mini-batches are kept, the stage is left out of stage times"
        )
    return lines


def _print_stage_aggregates(s: SessionSummary, out: Console, names: _Names) -> None:
    from profd.analysis.aggregate import stage_aggregates

    rows = stage_aggregates(s)
    if not rows:
        out.print("No stage ranges.")
        return
    table = _table(
        f"Stage wall time over {len(s.steps) or 1} step(s) x ranks (ms)",
        *("stage", "role", "ranks", "median", "p90", "max", "slowest"),
    )
    for a in rows:
        table.add_row(
            names.st(a.stage),
            names.ro(a.role),
            str(a.ranks),
            _ms(a.median_ms),
            _ms(a.p90_ms),
            _ms(a.max_ms),
            f"{names.rank(a.slowest_rank, a.slowest_track)} {a.slowest_in}/{a.steps}",
        )
    out.print(table)
    out.print(
        "slowest: the rank with the largest time; k/n: in k of n steps it was the slowest "
        "of its role (--per-step: every step)."
    )


def _print_legend(out: Console, names: _Names) -> None:
    pairs = names.legend()
    if not pairs:
        return
    legend = Table.grid(padding=(0, 2))
    legend.add_column(no_wrap=True)
    legend.add_column(overflow="fold")
    for short, full in pairs:
        legend.add_row(short, full)
    out.print("Names shortened to fit (--wide prints them whole):")
    out.print(legend)


def _print_straggler_aggregates(s: SessionSummary, out: Console, names: _Names) -> None:
    from profd.analysis.aggregate import straggler_aggregates

    rows = straggler_aggregates(s)
    if not rows:
        out.print("No straggler.")
        return
    table = _table(
        "Stragglers: late in k of n steps (ran long in j of them), by how much (ms)",
        *("stage", "role", "rank", "late", "long", "max", "median", "worst"),
    )
    for a in rows:
        table.add_row(
            names.st(a.stage),
            names.ro(a.role),
            names.rank(a.rank, a.track),
            f"{a.late_steps}/{a.steps}",
            "-" if a.long_steps is None else str(a.long_steps),
            f"[red]{_ms(a.max_late_ms)}[/red]",
            _ms(a.median_late_ms),
            str(a.worst_step) if a.worst_step is not None else "-",
        )
    out.print(table)


def _print_idle_aggregates(s: SessionSummary, out: Console, names: _Names) -> None:
    from profd.analysis.aggregate import idle_aggregates

    rows = idle_aggregates(s)
    if not rows:
        return
    table = _table(
        "Idle time between stages, per step and rank (ms)",
        *("role", "ranks", "steps", "step median", "median", "max", "total"),
    )
    for a in rows:
        table.add_row(
            names.ro(a.role),
            str(a.ranks),
            str(a.steps),
            _ms(a.step_median_ms),
            _ms(a.per_step_median_ms),
            _ms(a.per_step_max_ms),
            _ms(a.total_ms),
        )
    out.print(table)
    largest = _table("Largest idle gap per role", "role", "step", "rank", "ms", "after", "before")
    for a in rows:
        if (g := a.largest) is not None:
            rank = _rank_of_track(s, g.track)
            largest.add_row(
                names.ro(a.role),
                str(g.step) if g.step is not None else "-",
                names.rank(rank, g.track),
                _ms(g.gap_ms),
                names.st(g.after),
                names.st(g.before),
            )
    if largest.row_count:
        out.print(largest)


def _rank_of_track(s: SessionSummary, track: str) -> int | None:
    return next((t.rank for t in s.tracks if t.track == track), None)


def _print_minis_folded(s: SessionSummary, out: Console, names: _Names) -> None:
    from profd.analysis.aggregate import mini_batch_aggregates

    rows = mini_batch_aggregates(s)
    if not rows:
        return
    table = _table(
        "Mini-batches over steps and ranks (ms)",
        *("stage", "role", "mini", "n", "median", "max", "micro"),
    )
    for a in rows:
        table.add_row(
            names.st(a.stage),
            names.ro(a.role),
            str(a.index),
            str(a.samples),
            _ms(a.median_ms),
            _ms(a.max_ms),
            str(a.micro_batches),
        )
    out.print(table)


GPU_TRACKS = 16  # rows of the default GPU table; --per-step and --json have every track


def _print_gpu(s: SessionSummary, out: Console, names: _Names) -> None:
    """GPU time per track and per stage (HTA's temporal breakdown), when a trace has any."""
    from profd.analysis.aggregate import gpu_stage_aggregates

    if not s.gpu:
        return
    info = {t.track: t for t in s.tracks}
    table = _table(
        "GPU time per track (ms)",
        *("track", "window", "idle", "compute", "non-comp", "comm", "mem", "overlap"),
    )
    # the idlest first: with many ranks, the ones to look at
    rows = sorted(s.gpu, key=lambda g: -(g.idle_ms / g.window_ms if g.window_ms else 0.0))
    for g in rows[:GPU_TRACKS]:
        t = info.get(g.track)
        who = names.rank(t.rank if t else None, g.track)
        if t is not None and t.role and t.rank is not None:
            who = f"{names.ro(t.role)} {who}"
        table.add_row(
            who,
            _ms(g.window_ms),
            _pct(g.idle_ms, g.window_ms),
            _ms(g.compute_ms),
            _ms(g.non_compute_ms),
            _ms(g.communication_ms),
            _ms(g.memory_ms),
            _pct(g.comm_comp_overlap_pct),
        )
    out.print(table)
    if len(rows) > GPU_TRACKS:
        out.print(f"… {len(rows) - GPU_TRACKS} more tracks (--per-step or --json: all).")
    out.print(
        "idle: share of the window (first kernel start to last kernel end) with no kernel; "
        "overlap: share of comm time with computation running (as HTA defines them)."
    )
    stages = _table(
        "GPU time per stage, summed over tracks (ms)",
        *("stage", "window", "idle", "compute", "non-comp", "comm", "overlap"),
    )
    for a in gpu_stage_aggregates(s):
        stages.add_row(
            names.st(a.stage),
            _ms(a.window_ms),
            _pct(a.idle_ms, a.window_ms),
            _ms(a.compute_ms),
            _ms(a.non_compute_ms),
            _ms(a.communication_ms),
            _pct(a.overlap_pct),
        )
    out.print(stages)
    out.print(
        "A kernel counts in the stage that launched it, idle time in the stage the host was in."
    )


def _print_top_ops(s: SessionSummary, out: Console, names: _Names, wide: bool) -> None:
    from profd.analysis.aggregate import middle_ellipsis

    if not s.top_ops:
        return
    table = _table(
        "Top operators by self time (3 per stage)",
        *("stage", "dev", "operator", "calls", "self ms", "share"),
    )
    for group in s.top_ops:
        for o in group.ops[:3]:
            table.add_row(
                names.st(group.stage),
                group.device,
                o.name if wide else middle_ellipsis(o.name, OP_W),
                f"{o.calls:,}",
                _ms(o.self_ms),
                f"{o.share:.0%}",
            )
    out.print(table)
