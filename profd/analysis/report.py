"""A self-contained HTML report of a :class:`SessionSummary`: inline SVG plots and tables, no
scripts, no network — it opens from a file, a mail attachment or an artefact store.

Plots: a stage timeline per track (where did each rank spend the step, who finished late)
and per-stage bars (wall time of each track in each stage, against the median).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from html import escape
from pathlib import Path
from statistics import mean, median

from profd.analysis.models import SessionSummary, StageTime

__all__ = ["render_html", "stage_bars_svg", "timeline_svg", "write_html"]

PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#b07aa1",
    "#76b7b2",
    "#edc948",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
    "#e15759",
)
LATE = "#d62728"
LABEL_W = 300
PLOT_W = 900
ROW_H = 22

_CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222}
h1{font-size:20px}h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0}td,th{padding:3px 8px;border-bottom:1px solid #eee;
text-align:right}td:first-child,th:first-child,td.l,th.l{text-align:left}th{background:#f6f6f6}
.late{color:#d62728;font-weight:600}.muted{color:#777}.legend span{display:inline-block;
margin-right:12px}.sw{display:inline-block;width:12px;height:12px;margin-right:4px;
vertical-align:middle}svg text{font:11px sans-serif}details{margin:8px 0}
"""


def _fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:,.1f}"


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


def _colors(s: SessionSummary) -> dict[str, str]:
    return {stage: PALETTE[i % len(PALETTE)] for i, stage in enumerate(s.stages)}


def _legend(colors: dict[str, str]) -> str:
    items = "".join(
        f'<span><i class="sw" style="background:{c}"></i>{escape(name)}</span>'
        for name, c in colors.items()
    )
    return f'<div class="legend">{items}</div>'


def _ticks(span: float, width: int, x0: int, y: int, height: int) -> str:
    if span <= 0:
        return ""
    raw = span / 8
    step = next(m * 10**e for e in range(-3, 12) for m in (1, 2, 5) if m * 10**e >= raw)
    out = []
    t = 0.0
    while t <= span + 1e-9:
        x = x0 + t / span * width
        out.append(
            f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + height}" stroke="#eee"/>'
            f'<text x="{x:.1f}" y="{y + height + 14}" text-anchor="middle">{t:g}</text>'
        )
        t += step
    return "".join(out)


def timeline_svg(s: SessionSummary) -> str:
    """Stage bars per track on the shared clock (ms after the first event)."""
    tracks = [t.track for t in s.tracks]
    if not tracks:
        return "<p class='muted'>No tracks.</p>"
    colors = _colors(s)
    late = {(x.track, x.step, x.stage) for x in s.stragglers}
    span = max(s.span_ms, 1e-6)
    height = len(tracks) * ROW_H
    scale = PLOT_W / span
    parts = [_ticks(span, PLOT_W, LABEL_W, 0, height)]
    row = {t: i for i, t in enumerate(tracks)}
    for st in s.step_times:
        y = row[st.track] * ROW_H
        parts.append(
            f'<rect x="{LABEL_W + st.start_ms * scale:.1f}" y="{y + 2}" '
            f'width="{max(st.wall_ms * scale, 0.5):.1f}" height="{ROW_H - 4}" fill="#f1f1f1" '
            f'stroke="#ccc"><title>step {st.step}: {_fmt(st.wall_ms)} ms, idle '
            f"{_fmt(st.idle_ms)} ms</title></rect>"
        )
    for r in s.stage_times:
        y = row[r.track] * ROW_H
        is_late = (r.track, r.step, r.stage) in late
        stroke = f' stroke="{LATE}" stroke-width="2"' if is_late else ""
        parts.append(
            f'<rect x="{LABEL_W + r.start_ms * scale:.1f}" y="{y + 5}" '
            f'width="{max((r.end_ms - r.start_ms) * scale, 0.5):.1f}" height="{ROW_H - 10}" '
            f'fill="{colors.get(r.stage, "#888")}"{stroke}><title>{escape(r.stage)} '
            f"(step {r.step}) on {escape(r.track)}: {_fmt(r.wall_ms)} ms"
            f"{' — LATE' if is_late else ''}</title></rect>"
        )
    for t, i in row.items():
        parts.append(
            f'<text x="{LABEL_W - 6}" y="{i * ROW_H + ROW_H / 2 + 4}" text-anchor="end">'
            f"{escape(t)}</text>"
        )
    w, h = LABEL_W + PLOT_W + 20, height + 24
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'viewBox="0 0 {w} {h}" role="img" aria-label="stage timeline">{"".join(parts)}</svg>'
    )


def stage_bars_svg(s: SessionSummary, stage: str, rows: Sequence[StageTime]) -> str:
    """Mean wall time of ``stage`` per track, a dashed line at the median."""
    per: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        per[r.track].append(r.wall_ms)
    order = [t.track for t in s.tracks if t.track in per]
    values = {t: mean(per[t]) for t in order}
    late = {x.track for x in s.stragglers if x.stage == stage}
    top = max(values.values(), default=0.0) or 1.0
    scale = (PLOT_W - 80) / top
    parts = []
    for i, t in enumerate(order):
        y = i * ROW_H
        fill = LATE if t in late else PALETTE[s.stages.index(stage) % len(PALETTE)]
        parts.append(
            f'<text x="{LABEL_W - 6}" y="{y + ROW_H / 2 + 4}" text-anchor="end">{escape(t)}</text>'
            f'<rect x="{LABEL_W}" y="{y + 4}" width="{max(values[t] * scale, 0.5):.1f}" '
            f'height="{ROW_H - 8}" fill="{fill}"><title>{_fmt(values[t])} ms</title></rect>'
            f'<text x="{LABEL_W + values[t] * scale + 4:.1f}" y="{y + ROW_H / 2 + 4}">'
            f"{_fmt(values[t])} ms</text>"
        )
    if values:
        x = LABEL_W + median(values.values()) * scale
        parts.append(
            f'<line x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{len(order) * ROW_H}" '
            f'stroke="#333" stroke-dasharray="4 3"><title>median</title></line>'
        )
    w, h = LABEL_W + PLOT_W, len(order) * ROW_H + 4
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'viewBox="0 0 {w} {h}" role="img" aria-label="{escape(stage)} per track">'
        f"{''.join(parts)}</svg>"
    )


def _overview(s: SessionSummary) -> str:
    p = s.processing
    facts = [
        ("source", s.source),
        ("sessions", ", ".join(s.session_ids) or "-"),
        ("tracks", str(len(s.tracks))),
        (
            "files",
            f"{len(s.files)} read, {len(s.skipped)} skipped, "
            f"{p.json_bytes / 1e6:,.1f} MB of JSON in {p.wall_s:.2f} s ({p.mode}, "
            f"{p.workers} worker(s))",
        ),
        ("steps", ", ".join(map(str, s.steps)) or "-"),
        ("span", f"{_fmt(s.span_ms)} ms"),
    ]
    return _table(("", ""), facts, left=2)


def _stragglers(s: SessionSummary) -> str:
    if not s.stragglers:
        r = s.straggler_rule
        return (
            f"<p>No straggler: no rank ended a stage later than its peers by more than "
            f"max({r.k:g} × MAD, {r.abs_floor_ms:g} ms, {r.rel_floor:.0%} of the stage).</p>"
        )
    rows = [
        (
            x.track,
            x.step,
            x.stage,
            _Raw(f'<span class="late">{_fmt(x.late_ms)}</span>'),
            _fmt(x.threshold_ms),
            _fmt(x.wall_ms),
            _fmt(x.peer_median_wall_ms),
        )
        for x in s.stragglers
    ]
    head = ("track", "step", "stage", "late ms", "threshold ms", "wall ms", "peers' wall ms")
    return _table(head, rows, left=3)


def _ops(s: SessionSummary) -> str:
    out = []
    for group in s.top_ops:
        title = f"{group.stage or '(outside stages)'} — {group.device}, {_fmt(group.self_ms)} ms"
        rows = [
            (o.name, o.category, o.calls, _fmt(o.self_ms), _fmt(o.total_ms), f"{o.share:.1%}")
            for o in group.ops
        ]
        out.append(
            f"<h3>{escape(title)}</h3>"
            + _table(
                ("operator", "category", "calls", "self ms", "total ms", "share"), rows, left=2
            )
        )
    return "".join(out) or "<p class='muted'>No operator events.</p>"


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
            _fmt(x.wall_min_ms),
            _fmt(x.wall_median_ms),
            _fmt(x.wall_max_ms),
            _fmt(x.end_spread_ms),
            x.slowest,
        )
        for x in s.stage_stats
    )
    per_rank = (
        (r.step, r.stage, r.track, _fmt(r.start_ms), _fmt(r.end_ms), _fmt(r.wall_ms), r.calls)
        for r in s.stage_times
    )
    steps = (
        (x.step, x.track, _fmt(x.wall_ms), _fmt(x.stages_ms), _fmt(x.idle_ms)) for x in s.step_times
    )
    gaps = (
        (g.step, g.track, g.after, g.before, _fmt(g.start_ms), _fmt(g.gap_ms)) for g in s.idle_gaps
    )
    minis = (
        (m.step, m.stage or "-", m.track, m.index, _fmt(m.wall_ms), m.micro_batches)
        for m in s.mini_batches
    )
    files = (
        (f.name, f.track, f"{f.json_bytes / 1e6:,.1f}", f.events, f.parse, f"{f.seconds:.3f}")
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
        "files": _table(("file", "track", "MB (json)", "events", "parse", "s"), files, left=2),
        "skipped": _table(("file", "reason"), ((x.name, x.reason) for x in s.skipped), left=2)
        if s.skipped
        else "",
    }


def render_html(s: SessionSummary) -> str:
    """The whole report as one HTML document."""
    by_stage: dict[str, list[StageTime]] = defaultdict(list)
    for r in s.stage_times:
        by_stage[r.stage].append(r)
    bars = "".join(
        f"<h3>{escape(stage)}</h3>{stage_bars_svg(s, stage, by_stage[stage])}" for stage in s.stages
    )
    t = _tables(s)
    title = "profd summary" + (f" — {', '.join(s.session_ids)}" if s.session_ids else "")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>
<style>{_CSS}</style></head><body>
<h1>{escape(title)}</h1>
{_overview(s)}
<h2>Stragglers</h2>{_stragglers(s)}
<h2>Stage timeline</h2>{_legend(_colors(s))}{timeline_svg(s)}
<p class="muted">Grey: step ranges. Red outline: a straggler. Milliseconds after the first
event.</p>
<h2>Wall time per stage</h2>{bars}
<h2>Stages across ranks</h2>{t["stats"]}
<details><summary>Every stage on every track</summary>{t["per_rank"]}</details>
<h2>Steps and idle time</h2>{t["steps"]}
<details><summary>Idle gaps between stages ({len(s.idle_gaps)})</summary>{t["gaps"]}</details>
<h2>Mini-batches</h2>
<details><summary>{len(s.mini_batches)} mini-batch ranges</summary>{t["minis"]}</details>
<h2>Top operators by self time</h2>{_ops(s)}
<h2>Files</h2>{t["files"]}{t["skipped"]}
</body></html>
"""


def write_html(s: SessionSummary, path: Path | str) -> Path:
    """Write :func:`render_html` to ``path`` (UTF-8)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(s), encoding="utf-8")
    return out
