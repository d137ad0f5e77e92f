"""A self-contained HTML report of a :class:`SessionSummary`: inline SVG plots and tables, no
scripts, no network — it opens from a file, a mail attachment or an artefact store.

Top down: a warning when some file is not on the shared clock (kept apart, or placed by
metadata), the stragglers with the cause of their lateness, the stage timeline per track,
the mean wall time per step of each stage per track, then the tables, and the GPU time per
track (HTA's temporal breakdown) where the traces have device events. The plots are in
:mod:`profd.analysis.report_svg`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from html import escape
from pathlib import Path

from profd.analysis.clocks import EPOCH_FLOOR_US
from profd.analysis.models import (
    GpuTime,
    SessionSummary,
    SkipKind,
    SkippedFile,
    StageTime,
    Straggler,
)
from profd.analysis.report_svg import (
    GPU_PARTS,
    LATE,
    LATE_START,
    STEP_BG,
    bar_caption,
    fmt,
    gpu_bars_svg,
    stage_bars_svg,
    stage_colors,
    timeline_svg,
)

__all__ = ["clock_skipped", "render_html", "stage_bars_svg", "timeline_svg", "write_html"]


_CSS = f"""
body{{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;
color:#222;max-width:1320px}}
h1{{font-size:20px}}h2{{font-size:16px;margin-top:30px;border-bottom:1px solid #ddd}}
h3{{font-size:14px;margin:18px 0 4px}}
table{{border-collapse:collapse;margin:8px 0}}td,th{{padding:3px 8px;
border-bottom:1px solid #eee;text-align:right;vertical-align:top}}
td:first-child,th:first-child,td.l,th.l{{text-align:left}}th{{background:#f6f6f6}}
.late{{color:{LATE};font-weight:600}}.lstart{{color:#c25e00;font-weight:600}}
.muted{{color:#666}}.legend span{{display:inline-block;margin:2px 14px 2px 0}}
.sw{{display:inline-block;width:14px;height:12px;margin-right:5px;vertical-align:middle;
box-sizing:border-box}}.sw.ran-long{{border:2px solid {LATE}}}
.sw.started-late{{border:2px dashed {LATE_START}}}.sw.step-band{{background:{STEP_BG}}}
svg{{max-width:100%;height:auto}}svg text{{font:11px sans-serif;fill:#222}}
svg text.axis-title{{fill:#555}}svg text.step-label{{fill:#555;font-weight:600}}
details{{margin:8px 0}}
.warn{{border:1px solid #e0a800;border-left:6px solid #e0a800;background:#fff8e1;
padding:8px 14px;margin:12px 0}}.warn ul{{margin:4px 0;padding-left:20px}}
"""


def _table(head: Sequence[str], rows: Iterable[Sequence[object]], left: int = 1) -> str:
    th = "".join(
        f'<th class="{"l" if i < left else ""}">{escape(h)}</th>' for i, h in enumerate(head)
    )
    body = []
    for row in rows:
        cells = []
        for i, v in enumerate(row):
            cls = ' class="l"' if i < left else ""
            text = v if isinstance(v, _Raw) else escape("-" if v is None else str(v))
            cells.append(f"<td{cls}>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{th}</tr>{''.join(body)}</table>"


class _Raw(str):
    """Already-escaped HTML for a table cell."""


def _signed(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:+,.1f}"


def clock_skipped(s: SessionSummary) -> list[SkippedFile]:
    """Files kept off the shared timeline because of their clock (not for being unreadable)."""
    return [x for x in s.skipped if x.kind is SkipKind.CLOCK]


def _clock_warning(s: SessionSummary) -> str:
    """A box naming every file that is off the timeline or only placed on it by metadata."""
    apart, placed = clock_skipped(s), s.aligned
    if not apart and not placed:
        return ""
    items = [
        f"<li><b>{escape(x.name)}</b>: <b>not on the timeline</b>: {escape(x.reason)}</li>"
        for x in apart
    ] + [
        f"<li><b>{escape(a.name)}</b>: placed by metadata ({escape(a.source)}) at "
        f"{fmt(a.offset_ms)} ms after t0, <b>± {fmt(a.uncertainty_ms)} ms</b>: its times "
        "against the other tracks are only that precise</li>"
        for a in placed
    ]
    return (
        '<div class="warn" id="clock-warning" role="note"><b>Clock warning.</b> '
        f"{len(apart)} file(s) kept off the shared timeline, {len(placed)} placed on it by "
        f"metadata rather than by their own clock:<ul>{''.join(items)}</ul></div>"
    )


def _overview(s: SessionSummary) -> str:
    p = s.processing
    t0 = "-"
    if s.t0_epoch_us is not None and s.t0_epoch_us >= EPOCH_FLOOR_US:
        at = datetime.fromtimestamp(s.t0_epoch_us / 1e6, tz=UTC)
        t0 = at.isoformat(timespec="milliseconds").replace("+00:00", " UTC")
    facts = [
        ("source", s.source),
        ("sessions", ", ".join(s.session_ids) or "-"),
        ("tracks", str(len(s.tracks))),
        (
            "files",
            f"{len(s.files)} read, {len(s.skipped)} skipped, {len(s.aligned)} placed by "
            f"metadata; {p.json_bytes / 1e6:,.1f} MB of JSON in {p.wall_s:.2f} s ({p.mode}, "
            f"{p.workers} worker(s))",
        ),
        ("steps", ", ".join(map(str, s.steps)) or "-"),
        ("t0 (first event)", t0),
        ("span", f"{fmt(s.span_ms)} ms"),
    ]
    return _table(("", ""), facts, left=2)


def _pushed_by(s: SessionSummary, x: Straggler) -> Straggler | None:
    """The latest earlier stage of the same track and step that ran long: what delayed a
    stage that only started late."""
    if x.start_ms is None:
        return None
    before = [
        y
        for y in s.stragglers
        if (y.track, y.step) == (x.track, x.step)
        and y.cause is not None
        and y.cause.long
        and y.start_ms is not None
        and y.start_ms < x.start_ms
    ]
    return max(before, key=lambda y: y.start_ms or 0.0, default=None)


def _cause_cell(s: SessionSummary, x: Straggler) -> _Raw:
    if x.cause is None:
        return _Raw('<span class="muted">not recorded</span>')
    css = "late" if x.cause.long else "lstart"
    text = f'<span class="{css}">{escape(x.cause.value)}</span>'
    origin = _pushed_by(s, x) if not x.cause.long else None
    if origin is not None:
        text += f' <span class="muted">(after {escape(origin.stage)} ran long)</span>'
    return _Raw(text)


_LATE_HEAD = (
    "track", "step", "stage", "cause", "ended late by ms", "started late by ms",
    "ran longer by ms", "wall ms", "peers' median wall ms", "threshold ms",
)  # fmt: skip


def _stragglers(s: SessionSummary) -> str:
    r = s.straggler_rule
    rule = (
        f"A rank is a straggler of a stage when the stage ends after the median end on its "
        f"peers by more than max({r.k:g} × MAD, {r.abs_floor_ms:g} ms, {r.rel_floor:.0%} of "
        "the stage's median wall time)."
    )
    if not s.stragglers:
        return f"<p>No straggler. {escape(rule)}</p>"
    rows = [
        (
            x.track,
            x.step,
            x.stage,
            _cause_cell(s, x),
            _Raw(f'<span class="late">{_signed(x.late_ms)}</span>'),
            _signed(x.start_late_ms),
            _signed(x.extra_wall_ms),
            fmt(x.wall_ms),
            fmt(x.peer_median_wall_ms),
            fmt(x.threshold_ms),
        )
        for x in s.stragglers
    ]
    causes = (
        '<b class="late">long duration</b>: the stage ran longer than on its peers. '
        '<b class="lstart">late start</b>: it started late, pushed by an earlier stage that '
        "ran late, and its own duration is normal. Both: it started late and ran long."
    )
    return f"<p>{escape(rule)} {causes}</p>" + _table(_LATE_HEAD, rows, left=4)


def _legend(colors: dict[str, str], bars: bool = False) -> str:
    items = [
        f'<span><i class="sw" style="background:{c}"></i>{escape(name)}</span>'
        for name, c in colors.items()
    ]
    if not bars:
        items.append('<span><i class="sw step-band"></i>step range (idle where no stage)</span>')
    long = (
        f'<i class="sw" style="background:{LATE}"></i>' if bars else '<i class="sw ran-long"></i>'
    )
    items.append(f"<span>{long}straggler: long duration</span>")
    items.append('<span><i class="sw started-late"></i>straggler: late start only</span>')
    if bars:
        items.append("<span>- - - median over tracks</span>")
    return f'<div class="legend">{"".join(items)}</div>'


def _bars(s: SessionSummary) -> str:
    """One chart per stage; its heading says what the bars are."""
    by_stage: dict[str, list[StageTime]] = defaultdict(list)
    for r in s.stage_times:
        by_stage[r.stage].append(r)
    return "".join(
        f"<h3>{escape(bar_caption(stage, by_stage[stage])[0])}</h3>"
        + stage_bars_svg(s, stage, by_stage[stage])
        for stage in s.stages
    )


def _ops(s: SessionSummary) -> str:
    out = []
    for group in s.top_ops:
        title = f"{group.stage or '(outside stages)'} — {group.device}, {fmt(group.self_ms)} ms"
        rows = [
            (o.name, o.category, o.calls, fmt(o.self_ms), fmt(o.total_ms), f"{o.share:.1%}")
            for o in group.ops
        ]
        out.append(
            f"<h3>{escape(title)}</h3>"
            + _table(
                ("operator", "category", "calls", "self ms", "total ms", "share"), rows, left=2
            )
        )
    return "".join(out) or "<p class='muted'>No operator events.</p>"


_GPU_HEAD = (
    "window ms", "idle ms", "idle", "compute ms", "non-compute ms", "communication ms",
    "memory ms", "comm. overlapped by compute", "kernels",
)  # fmt: skip


def _gpu_cells(g: GpuTime) -> tuple[object, ...]:
    idle = f"{100 * g.idle_ms / g.window_ms:.1f}%" if g.window_ms > 0 else "-"
    overlap = "-" if g.comm_comp_overlap_pct is None else f"{g.comm_comp_overlap_pct:.1f}%"
    return (
        fmt(g.window_ms), fmt(g.idle_ms), idle, fmt(g.compute_ms), fmt(g.non_compute_ms),
        fmt(g.communication_ms), fmt(g.memory_ms), overlap, g.kernels,
    )  # fmt: skip


def _gpu(s: SessionSummary) -> str:
    """The GPU time section: a stacked bar and a row per track, the stages folded away."""
    if not s.gpu:
        return "<p class='muted'>No device events (kernels, memcpys, memsets): CPU-only traces.</p>"
    legend = "".join(
        f'<span><i class="sw" style="background:{c}"></i>{escape(name)}</span>'
        for name, c in GPU_PARTS
    )
    tracks = _table(("track", *_GPU_HEAD), ((g.track, *_gpu_cells(g)) for g in s.gpu))
    stages = _table(
        ("track", "stage", *_GPU_HEAD),
        ((g.track, r.stage or "(outside stages)", *_gpu_cells(r)) for g in s.gpu for r in g.stages),
        left=2,
    )
    return (
        "<p class='muted'>As HTA (Holistic Trace Analysis) defines them, per file: the window "
        "runs from the first kernel start to the last kernel end inside the profiled steps; "
        "idle is the window with no kernel, memcpy or memset running (on any stream); "
        "non-compute is time only communication or memory kernels run; the overlap is the "
        "share of communication time with computation running. A track adds up its files. "
        "Per stage, a kernel counts in the stage that launched it and idle time in the stage "
        "the host was in (docs/gpu-breakdown.md).</p>"
        f'<div class="legend">{legend}</div>{gpu_bars_svg(s)}{tracks}'
        f"<details><summary>Per stage</summary>{stages}</details>"
    )


_STATS_HEAD = (
    "step", "stage", "role", "ranks", "min ms", "median ms", "max ms", "end spread ms", "ended last"
)  # fmt: skip


def _tables(s: SessionSummary) -> dict[str, str]:
    """Every table of the report, by name."""
    stats = (
        (
            x.step,
            x.stage,
            x.role or "-",
            x.ranks,
            fmt(x.wall_min_ms),
            fmt(x.wall_median_ms),
            fmt(x.wall_max_ms),
            fmt(x.end_spread_ms),
            x.slowest,
        )
        for x in s.stage_stats
    )
    per_rank = (
        (r.step, r.stage, r.track, fmt(r.start_ms), fmt(r.end_ms), fmt(r.wall_ms), r.calls)
        for r in s.stage_times
    )
    steps = (
        (x.step, x.track, fmt(x.wall_ms), fmt(x.stages_ms), fmt(x.idle_ms)) for x in s.step_times
    )
    gaps = (
        (g.step, g.track, g.after, g.before, fmt(g.start_ms), fmt(g.gap_ms)) for g in s.idle_gaps
    )
    minis = (
        (m.step, m.stage or "-", m.track, m.index, fmt(m.wall_ms), m.micro_batches)
        for m in s.mini_batches
    )
    files = (
        (
            f.name,
            f.track,
            f"{f.json_bytes / 1e6:,.1f}",
            f.events,
            f.parse,
            f"{f.seconds:.3f}",
            ", ".join(map(str, f.partial_steps)),  # left out of the step and stage times
        )
        for f in s.files
    )
    return {
        "stats": _table(_STATS_HEAD, stats, left=3),
        "per_rank": _table(
            ("step", "stage", "track", "start ms", "end ms", "wall ms", "calls"), per_rank, left=3
        ),
        "steps": _table(("step", "track", "wall ms", "in stages ms", "idle ms"), steps, left=2),
        "gaps": _table(("step", "track", "after", "before", "at ms", "gap ms"), gaps, left=4),
        "minis": _table(
            ("step", "stage", "track", "mini-batch", "wall ms", "micro-batches"), minis, left=3
        ),
        "files": _table(
            ("file", "track", "MB (json)", "events", "parse", "s", "partial steps"), files, left=2
        ),
        "skipped": _table(("file", "reason"), ((x.name, x.reason) for x in s.skipped), left=2)
        if s.skipped
        else "",
    }


def render_html(s: SessionSummary) -> str:
    """The whole report as one HTML document."""
    t = _tables(s)
    colors = stage_colors(s)
    title = "profd summary" + (f" — {', '.join(s.session_ids)}" if s.session_ids else "")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>
<style>{_CSS}</style></head><body>
<h1>{escape(title)}</h1>
{_clock_warning(s)}
{_overview(s)}
<h2>Stragglers</h2>{_stragglers(s)}
<h2>Stage timeline</h2>
<p class="muted">Per track, each step is a light band and its stages are drawn inside it;
the band showing through is idle time. Milliseconds after t0 (the first event); hover a
shape for its times.</p>
{_legend(colors)}{timeline_svg(s)}
<h2>Wall time per stage: mean per step</h2>
<p class="muted">A bar is the track's wall time in the stage in one step (the summed
duration of its ranges), averaged over the steps it ran the stage in; the number is that
mean in ms. The notes name the steps in which the track was a straggler, and why.</p>
{_legend(colors, bars=True)}{_bars(s)}
<h2>Stages across ranks</h2>{t["stats"]}
<details><summary>Every stage on every track</summary>{t["per_rank"]}</details>
<h2>Steps and idle time</h2>{t["steps"]}
<details><summary>Idle gaps between stages ({len(s.idle_gaps)})</summary>{t["gaps"]}</details>
<h2>Mini-batches</h2>
<details><summary>{len(s.mini_batches)} mini-batch ranges</summary>{t["minis"]}</details>
<h2 id="gpu">GPU time</h2>{_gpu(s)}
<h2>Top operators by self time</h2>{_ops(s)}
<h2 id="files">Files</h2>{t["files"]}{t["skipped"]}
</body></html>
"""


def write_html(s: SessionSummary, path: Path | str) -> Path:
    """Write :func:`render_html` to ``path`` (UTF-8)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(s), encoding="utf-8")
    return out
