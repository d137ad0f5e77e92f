"""``profd summarize --per-step``: every step x stage x rank, as the summary holds them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from profd.analysis.models import SessionSummary


def _print_stats(s: SessionSummary, out: Console) -> None:
    stats = Table(title="Stages across ranks (ms)")
    for col in ("step", "stage", "role", "ranks", "min", "median", "max", "end spread", "last"):
        stats.add_column(col, overflow="fold")
    for x in s.stage_stats:
        stats.add_row(
            str(x.step),
            x.stage,
            x.role or "-",
            str(x.ranks),
            f"{x.wall_min_ms:,.1f}",
            f"{x.wall_median_ms:,.1f}",
            f"{x.wall_max_ms:,.1f}",
            f"{x.end_spread_ms:,.1f}",
            short_track(x.slowest),
        )
    out.print(stats)


def _print_grid(s: SessionSummary, out: Console) -> None:
    """Step x stage rows, one column per track (only while that fits a terminal)."""
    if len(s.tracks) > 12 or not s.stage_times:
        return
    grid = Table(title="Wall time per step x stage x track (ms)")
    grid.add_column("step")
    grid.add_column("stage")
    names = [t.track for t in s.tracks]
    for n in names:
        grid.add_column(short_track(n), overflow="fold")
    cells: dict[tuple[Any, str], dict[str, float]] = {}
    for r in s.stage_times:
        cells.setdefault((r.step, r.stage), {})[r.track] = r.wall_ms
    for (step, stage), row in cells.items():
        grid.add_row(str(step), stage, *[f"{row[n]:,.1f}" if n in row else "" for n in names])
    out.print(grid)


def _print_stragglers(s: SessionSummary, out: Console) -> None:
    if not s.stragglers:
        out.print("No straggler.")
        return
    late = Table(title="Stragglers")
    for col in ("step", "stage", "track", "late ms", "cause", "threshold ms", "wall ms"):
        late.add_column(col, overflow="fold")
    for x in s.stragglers:
        late.add_row(
            str(x.step),
            x.stage,
            short_track(x.track),
            f"[red]{x.late_ms:,.1f}[/red]",
            x.cause.value if x.cause is not None else "-",
            f"{x.threshold_ms:,.1f}",
            f"{x.wall_ms:,.1f}",
        )
    out.print(late)


def _print_gaps(s: SessionSummary, out: Console) -> None:
    if not s.idle_gaps:
        return
    table = Table(title="Largest idle gaps between stages")
    for col in ("step", "track", "after", "before", "gap ms"):
        table.add_column(col, overflow="fold")
    for g in sorted(s.idle_gaps, key=lambda g: -g.gap_ms)[:8]:
        table.add_row(str(g.step), short_track(g.track), g.after, g.before, f"{g.gap_ms:,.1f}")
    out.print(table)


def _print_ops(s: SessionSummary, out: Console) -> None:
    ops = Table(title="Top operators by self time (3 per stage)")
    for col in ("stage", "device", "operator", "calls", "self ms", "share"):
        ops.add_column(col, overflow="fold")
    for group in s.top_ops:
        for o in group.ops[:3]:
            ops.add_row(
                group.stage or "(outside)",
                group.device,
                o.name,
                str(o.calls),
                f"{o.self_ms:,.1f}",
                f"{o.share:.0%}",
            )
    out.print(ops)


def _print_minis(s: SessionSummary, out: Console) -> None:
    from statistics import median

    groups: dict[tuple[Any, Any, int], list[Any]] = {}
    for m in s.mini_batches:
        groups.setdefault((m.step, m.stage, m.index), []).append(m)
    if not groups:
        return
    table = Table(title="Mini-batches over tracks (ms)")
    for col in ("step", "stage", "mini-batch", "tracks", "median", "max", "micro-batches"):
        table.add_column(col)
    for (step, stage, index), ms in groups.items():
        walls = [m.wall_ms for m in ms]
        table.add_row(
            str(step),
            stage or "-",
            str(index),
            str(len(ms)),
            f"{median(walls):,.1f}",
            f"{max(walls):,.1f}",
            str(max(m.micro_batches for m in ms)),
        )
    out.print(table)


def _pct(part: float | None, whole: float = 100.0) -> str:
    return "-" if part is None or whole <= 0 else f"{100 * part / whole:.1f}%"


_GPU_COLUMNS = ("window", "idle", "compute", "non-comp", "comm", "mem", "overlap")


def _gpu_cells(g: Any) -> list[str]:
    return [
        f"{g.window_ms:,.1f}",
        _pct(g.idle_ms, g.window_ms),
        f"{g.compute_ms:,.1f}",
        f"{g.non_compute_ms:,.1f}",
        f"{g.communication_ms:,.1f}",
        f"{g.memory_ms:,.1f}",
        _pct(g.comm_comp_overlap_pct),
    ]


def _gpu_table(title: str, text: tuple[str, ...], numbers: tuple[str, ...]) -> Table:
    """Borderless, as the default view's tables: ten columns fit 80 characters."""
    table = Table(
        title=title, box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True,
        title_justify="left",
    )  # fmt: skip
    for col in text:
        table.add_column(col, overflow="fold")
    for col in numbers:
        table.add_column(col, no_wrap=True, justify="right")
    return table


def _print_gpu(s: SessionSummary, out: Console) -> None:
    """Every track's GPU time, then every (track, stage)."""
    if not s.gpu:
        return
    tracks = _gpu_table("GPU time per track (ms)", ("track",), ("kernels", *_GPU_COLUMNS))
    stages = _gpu_table("GPU time per track x stage (ms)", ("track", "stage"), _GPU_COLUMNS)
    for g in s.gpu:
        tracks.add_row(short_track(g.track), f"{g.kernels:,}", *_gpu_cells(g))
        for r in g.stages:
            stages.add_row(short_track(g.track), r.stage or "(outside)", *_gpu_cells(r))
    out.print(tracks)
    out.print(stages)


def short_track(track: str) -> str:
    """A track's label without its node (``actor rank 0 @host`` -> ``actor rank 0``)."""
    return track.split(" @", 1)[0]


def print_per_step(s: SessionSummary, out: Console) -> None:
    for part in (_print_stats, _print_grid, _print_minis, _print_stragglers, _print_gaps):
        part(s, out)
    _print_gpu(s, out)
    _print_ops(s, out)
