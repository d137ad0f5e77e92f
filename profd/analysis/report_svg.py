"""The inline SVG plots of the HTML report (:mod:`profd.analysis.report`): a stage timeline
per track and per-stage bars of the wall time per step. Pure string building, no scripts.

Colours carry one meaning each: a stage has its palette colour (no red or orange in the
palette), red marks a stage that *ran long* against its peers, orange a stage that only
*started late* because something before it ran late.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from html import escape
from statistics import mean, median

from profd.analysis.models import SessionSummary, StageTime, Straggler

__all__ = [
    "BAR_W",
    "GPU_PARTS",
    "LATE",
    "LATE_START",
    "PALETTE",
    "PLOT_W",
    "STEP_BG",
    "BarRow",
    "bar_caption",
    "bar_rows",
    "fmt",
    "gpu_bars_svg",
    "late_marks",
    "nice_step",
    "short",
    "stage_bars_svg",
    "stage_colors",
    "timeline_svg",
]

# Tableau-like, without the red and orange that mean "late" here.
PALETTE = (
    "#4e79a7",
    "#59a14f",
    "#b07aa1",
    "#76b7b2",
    "#edc948",
    "#9c755f",
    "#a0cbe8",
    "#8cd17d",
    "#d4a6c8",
    "#79706e",
)
LATE = "#d62728"  # ran long: the stage itself is slow
LATE_START = "#ff7f0e"  # started late: pushed by an earlier stage
STEP_BG = "#e9edf2"
#: GPU time parts: computation, communication / memory alone, idle.
GPU_PARTS = (("compute", "#4e79a7"), ("non-compute", "#b07aa1"), ("idle", "#d9d9d9"))
LABEL_W = 260
PLOT_W = 960
BAR_W = 560
ROW_H = 28
TOP = 22  # room for the step labels above the timeline rows
AXIS_H = 40  # tick labels and the axis title below a plot
LABEL_CHARS = 40  # what fits in LABEL_W at 11px


def fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:,.1f}"


def short(text: str, limit: int = LABEL_CHARS) -> str:
    """``text`` cut to ``limit`` characters; the head (role, rank) is what tells rows apart."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def stage_colors(s: SessionSummary) -> dict[str, str]:
    return {stage: PALETTE[i % len(PALETTE)] for i, stage in enumerate(s.stages)}


def late_marks(s: SessionSummary) -> dict[tuple[str, int | None, str], Straggler]:
    """(track, step, stage) → its straggler row."""
    return {(x.track, x.step, x.stage): x for x in s.stragglers}


def nice_step(span: float, target: int = 8) -> float:
    """A 1/2/5 × 10^n tick step giving about ``target`` ticks over ``span``."""
    raw = span / target
    return next(m * 10**e for e in range(-3, 15) for m in (1, 2, 5) if m * 10**e >= raw)


def _axis(span: float, x0: float, width: float, y: float, height: float, title: str) -> str:
    """Grid lines and labels every :func:`nice_step` from 0 to ``span``, and the axis title."""
    out = [f'<g class="axis"><line x1="{x0}" y1="{y + height}" x2="{x0 + width}" '
           f'y2="{y + height}" stroke="#999"/>']  # fmt: skip
    if span > 0:
        step = nice_step(span)
        digits = 0 if step >= 1 else len(f"{step:g}".split(".")[1])
        n = 0
        while n * step <= span * (1 + 1e-9):
            t = n * step
            x = x0 + t / span * width
            out.append(
                f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + height + 4}" stroke="#ddd"/>'
                f'<text x="{x:.1f}" y="{y + height + 15}" text-anchor="middle">'
                f"{t:,.{digits}f}</text>"
            )
            n += 1
    out.append(
        f'<text class="axis-title" x="{x0 + width / 2:.1f}" y="{y + height + 32}" '
        f'text-anchor="middle">{escape(title)}</text></g>'
    )
    return "".join(out)


def _svg(width: float, height: float, label: str, body: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{escape(label)}">'
        f"{body}</svg>"
    )


def _row_label(y: float, track: str) -> str:
    return (
        f'<text class="track" x="{LABEL_W - 6}" y="{y + ROW_H / 2 + 4:.1f}" text-anchor="end">'
        f"<title>{escape(track)}</title>{escape(short(track))}</text>"
    )


def _late_text(x: Straggler) -> str:
    """Tooltip line for a straggler mark."""
    if x.cause is None:  # a summary from before causes were recorded
        return f"LATE: ended {fmt(x.late_ms)} ms after the peers' median end"
    parts = [f"LATE ({x.cause.value}): ended {fmt(x.late_ms)} ms after the peers' median end"]
    if x.start_late_ms is not None:
        parts.append(f"started {fmt(x.start_late_ms)} ms after the peers' median start")
    if x.extra_wall_ms is not None:
        parts.append(f"ran {fmt(x.extra_wall_ms)} ms longer than the peers' median")
    return "; ".join(parts)


def _mark(x: Straggler | None) -> str:
    """Outline attributes of a stage shape: red when it ran long, dashed orange when it only
    started late (a shifted stage is not a slow one)."""
    if x is None:
        return ""
    if x.cause is None or x.cause.long:
        return f' stroke="{LATE}" stroke-width="2"'
    return f' stroke="{LATE_START}" stroke-width="2" stroke-dasharray="4 2"'


def _step_rects(s: SessionSummary, row: dict[str, int], scale: float) -> list[str]:
    out = []
    for st in s.step_times:
        y = TOP + row[st.track] * ROW_H
        out.append(
            f'<rect class="step" data-step="{st.step}" x="{LABEL_W + st.start_ms * scale:.2f}" '
            f'y="{y + 2}" width="{max(st.wall_ms * scale, 0.5):.2f}" height="{ROW_H - 4}" '
            f'fill="{STEP_BG}"><title>step {st.step} on {escape(st.track)}: '
            f"{fmt(st.wall_ms)} ms, {fmt(st.stages_ms)} ms in stages, {fmt(st.idle_ms)} ms idle"
            "</title></rect>"
        )
    return out


def _stage_rect(r: StageTime, y: float, scale: float, color: str, hit: Straggler | None) -> str:
    span = r.end_ms - r.start_ms
    calls = f", {r.calls} calls over {fmt(span)} ms" if r.calls > 1 else ""
    late = f"\n{_late_text(hit)}" if hit else ""
    return (
        f'<rect class="stage" data-stage="{escape(r.stage)}" data-track="{escape(r.track)}" '
        f'data-step="{r.step}" x="{LABEL_W + r.start_ms * scale:.2f}" y="{y + 6}" '
        f'width="{max(span * scale, 0.5):.2f}" height="{ROW_H - 12}" fill="{color}"'
        f"{_mark(hit)}><title>{escape(r.stage)} (step {r.step}) on {escape(r.track)}: "
        f"{fmt(r.start_ms)} – {fmt(r.end_ms)} ms, wall {fmt(r.wall_ms)} ms{calls}"
        f"{escape(late)}</title></rect>"
    )


def _step_labels(s: SessionSummary, scale: float) -> list[str]:
    first: dict[int, float] = {}
    for st in s.step_times:
        first[st.step] = min(first.get(st.step, st.start_ms), st.start_ms)
    return [
        f'<text class="step-label" x="{LABEL_W + t * scale + 2:.1f}" y="{TOP - 6}">step {n}</text>'
        for n, t in sorted(first.items())
    ]


def timeline_svg(s: SessionSummary) -> str:
    """Per track: each step as a light band, the stages inside it in their colours, on the
    shared clock (ms after t0); stragglers outlined by cause."""
    tracks = [t.track for t in s.tracks]
    if not tracks:
        return "<p class='muted'>No tracks.</p>"
    colors = stage_colors(s)
    marks = late_marks(s)
    span = max(s.span_ms, 1e-6)
    scale = PLOT_W / span
    row = {t: i for i, t in enumerate(tracks)}
    height = len(tracks) * ROW_H
    parts = [_axis(span, LABEL_W, PLOT_W, TOP, height, "ms after t0 (the first event)")]
    parts += _step_rects(s, row, scale)
    for r in sorted(s.stage_times, key=lambda r: r.start_ms):  # later stages drawn on top
        hit = marks.get((r.track, r.step, r.stage))
        y = TOP + row[r.track] * ROW_H
        parts.append(_stage_rect(r, y, scale, colors.get(r.stage, "#888"), hit))
    parts += _step_labels(s, scale)
    parts += [_row_label(TOP + i * ROW_H, t) for t, i in row.items()]
    return _svg(LABEL_W + PLOT_W + 30, TOP + height + AXIS_H, "stage timeline", "".join(parts))


class BarRow:
    """One track's bar in a stage chart: mean wall time per step and its straggler rows."""

    def __init__(self, track: str, walls: list[float], late: list[Straggler]) -> None:
        self.track = track
        self.n = len(walls)
        self.value = mean(walls)
        self.late = sorted(late, key=lambda x: (x.step is None, x.step or 0))

    @property
    def long(self) -> bool:
        return any(x.cause is None or x.cause.long for x in self.late)


def bar_rows(s: SessionSummary, stage: str, rows: Sequence[StageTime]) -> list[BarRow]:
    per: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        per[r.track].append(r.wall_ms)
    late: dict[str, list[Straggler]] = defaultdict(list)
    for x in s.stragglers:
        if x.stage == stage:
            late[x.track].append(x)
    return [BarRow(t.track, per[t.track], late[t.track]) for t in s.tracks if t.track in per]


def bar_caption(stage: str, rows: Sequence[StageTime]) -> tuple[str, str]:
    """What a stage's bars show: (chart heading, axis title)."""
    steps = {r.step for r in rows if r.step is not None}
    if not steps:  # traces without step markers: one value per track
        return f"{stage}: wall time (ms), no step marked", "wall time (ms), all of the trace"
    counts: dict[str, int] = defaultdict(int)
    for r in rows:
        counts[r.track] += 1
    n = max(counts.values())
    return (
        f"{stage}: wall time per step, mean over {n} step(s) (ms)",
        f"wall time per step (ms), mean over the {n} step(s) each track ran {stage}",
    )


def _bar_note(b: BarRow) -> tuple[str, str]:
    """Short text after the bar (and its colour): per cause, the late steps and the worst
    lateness, e.g. 'long duration in step 2 (+150.0 ms)'."""
    if not b.late:
        return "", ""
    by_cause: dict[str, list[Straggler]] = defaultdict(list)
    for x in b.late:
        by_cause[x.cause.value if x.cause else "late"].append(x)
    bits = []
    for cause, xs in by_cause.items():
        steps = ", ".join(str(x.step) for x in xs[:4]) + (", …" if len(xs) > 4 else "")
        worst = max(x.late_ms for x in xs)
        bits.append(
            f"{cause} in step{'s' if len(xs) > 1 else ''} {steps} "
            f"({'up to ' if len(xs) > 1 else ''}+{fmt(worst)} ms)"
        )
    return "; ".join(bits), LATE if b.long else LATE_START


def stage_bars_svg(s: SessionSummary, stage: str, rows: Sequence[StageTime]) -> str:
    """Mean wall time per step of ``stage`` on each track, the value on each bar, a dashed
    line at the median over tracks; red when the track ran long in a step, an orange dashed
    outline when it only started late."""
    bars = bar_rows(s, stage, rows)
    top = max((b.value for b in bars), default=0.0) or 1.0
    scale = BAR_W / top
    color = PALETTE[s.stages.index(stage) % len(PALETTE)] if stage in s.stages else "#888"
    common = max((b.n for b in bars), default=0)
    height = len(bars) * ROW_H
    parts = [_axis(top, LABEL_W, BAR_W, 0, height, bar_caption(stage, rows)[1])]
    if bars:  # under the bars and their numbers
        mid = median(b.value for b in bars)
        x = LABEL_W + mid * scale
        parts.append(
            f'<line class="median" x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{height}" '
            f'stroke="#333" stroke-dasharray="4 3"><title>median over tracks: {fmt(mid)} ms'
            "</title></line>"
        )
    for i, b in enumerate(bars):
        y = i * ROW_H
        note, note_color = _bar_note(b)
        fill = LATE if b.long else color
        mark = "" if b.long or not b.late else _mark(b.late[0])
        width = b.value * scale
        n = "" if b.n == common else f" (mean of {b.n})"
        tip = f"{stage} on {b.track}: {fmt(b.value)} ms per step, mean of {b.n} step(s)"
        tip += "".join(f"\n{_late_text(x)} (step {x.step})" for x in b.late)
        parts.append(
            _row_label(y, b.track)
            + f'<rect class="bar" data-track="{escape(b.track)}" x="{LABEL_W}" y="{y + 5}" '
            f'width="{max(width, 0.5):.2f}" height="{ROW_H - 10}" fill="{fill}"{mark}>'
            f"<title>{escape(tip)}</title></rect>"
            f'<text class="value" x="{LABEL_W + width + 4:.1f}" y="{y + ROW_H / 2 + 4:.1f}" '
            'stroke="#fff" stroke-width="3" paint-order="stroke">'
            f"{fmt(b.value)} ms{n}"
            + (f' <tspan fill="{note_color}">{escape(note)}</tspan>' if note else "")
            + "</text>"
        )
    w = LABEL_W + BAR_W + 420
    return _svg(w, height + AXIS_H, f"{stage}: mean wall time per step, per track", "".join(parts))


def gpu_bars_svg(s: SessionSummary) -> str:
    """One bar per track with GPU time: its window split into compute, non-compute (only
    communication or memory running) and idle, as shares; the idle share written after it."""
    rows = s.gpu
    height = len(rows) * ROW_H
    scale = BAR_W / 100.0
    parts = [_axis(100.0, LABEL_W, BAR_W, 0, height, "share of the GPU window (%)")]
    for i, g in enumerate(rows):
        y = i * ROW_H
        x = float(LABEL_W)
        parts.append(_row_label(y, g.track))
        values = (g.compute_ms, g.non_compute_ms, g.idle_ms)
        for (label, color), ms in zip(GPU_PARTS, values, strict=True):
            pct = 100.0 * ms / g.window_ms if g.window_ms > 0 else 0.0
            tip = f"{label} on {g.track}: {fmt(ms)} ms, {pct:.1f}% of {fmt(g.window_ms)} ms"
            parts.append(
                f'<rect class="gpu-part" data-part="{label}" x="{x:.2f}" y="{y + 5}" '
                f'width="{pct * scale:.2f}" height="{ROW_H - 10}" fill="{color}">'
                f"<title>{escape(tip)}</title></rect>"
            )
            x += pct * scale
        idle = 100.0 * g.idle_ms / g.window_ms if g.window_ms > 0 else 0.0
        parts.append(
            f'<text class="value" x="{LABEL_W + BAR_W + 6}" y="{y + ROW_H / 2 + 4:.1f}">'
            f"{idle:.1f}% idle of {fmt(g.window_ms)} ms</text>"
        )
    return _svg(LABEL_W + BAR_W + 240, height + AXIS_H, "GPU time per track", "".join(parts))
