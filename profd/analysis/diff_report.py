"""A self-contained HTML view of a :class:`~profd.analysis.diff.SessionDiff`: the stage table
with verdicts and bars of A against B, the ranks that changed, GPU time per step, the
operators that changed most. No scripts, no network; every string from the traces is escaped."""

from __future__ import annotations

from html import escape
from pathlib import Path

from profd.analysis.diff import SessionDiff, StageChange, Verdict
from profd.analysis.diff_gpu import GpuChange, GpuScope

__all__ = ["render_diff_html", "write_diff_html"]

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222}h1{font-size:20px}
h2{font-size:16px;margin-top:24px;border-bottom:1px solid #ddd}table{border-collapse:collapse}
td,th{padding:3px 8px;border-bottom:1px solid #eee;text-align:right}
td.l,th.l{text-align:left}th{background:#f6f6f6}.slower{color:#d62728;font-weight:600}
.faster{color:#2ca02c;font-weight:600}.bar{display:inline-block;height:9px;margin:1px 0}
.a{background:#9ab}.b{background:#4e79a7}
"""
_BAR_PX = 220


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def _signed(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:+,.1f}{unit}"


def _cell(text: object, left: bool = False, cls: str = "") -> str:
    classes = " ".join(c for c in ("l" if left else "", cls) if c)
    attr = f' class="{classes}"' if classes else ""
    return f"<td{attr}>{escape(str(text))}</td>"


def _bars(c: StageChange, scale: float) -> str:
    def bar(v: float | None, kind: str) -> str:
        width = 0 if v is None else max(1, round(v * scale))
        return f'<span class="bar {kind}" style="width:{width}px"></span>'

    return f'<td class="l">{bar(c.a_ms, "a")}<br>{bar(c.b_ms, "b")}</td>'


def _verdict_cell(v: Verdict) -> str:
    cls = v.value if v in (Verdict.SLOWER, Verdict.FASTER) else ""
    return _cell(v.value, left=True, cls=cls)


def _stages(d: SessionDiff) -> str:
    most = max([x for c in d.stages for x in (c.a_ms, c.b_ms) if x is not None] or [1.0])
    scale = _BAR_PX / most if most > 0 else 0.0
    rows = [
        "<tr>" + _cell(c.stage, True) + _cell(c.role or "-", True) + _cell(_ms(c.a_ms))
        + _cell(_ms(c.b_ms)) + _cell(_signed(c.delta_ms)) + _cell(_signed(c.delta_pct, "%"))
        + _cell(_ms(c.threshold_ms)) + _verdict_cell(c.verdict) + _bars(c, scale) + "</tr>"
        for c in d.stages
    ]  # fmt: skip
    head = (
        '<tr><th class="l">stage</th><th class="l">role</th><th>A ms</th><th>B ms</th>'
        '<th>change ms</th><th>%</th><th>noise ms</th><th class="l">verdict</th>'
        '<th class="l">A (grey) / B (blue)</th></tr>'
    )
    return f"<table>{head}{''.join(rows)}</table>"


def _ranks(d: SessionDiff) -> str:
    moved = [c for c in d.ranks if c.verdict in (Verdict.SLOWER, Verdict.FASTER)]
    if not moved:
        return "<p>No rank's stage changed beyond the noise.</p>"
    rows = [
        "<tr>" + _cell(c.stage, True) + _cell(c.role or "-", True) + _cell(c.rank)
        + _cell(_ms(c.a_ms)) + _cell(_ms(c.b_ms)) + _cell(_signed(c.delta_ms))
        + _verdict_cell(c.verdict) + "</tr>"
        for c in moved
    ]  # fmt: skip
    head = (
        '<tr><th class="l">stage</th><th class="l">role</th><th>rank</th><th>A ms</th>'
        '<th>B ms</th><th>change ms</th><th class="l">verdict</th></tr>'
    )
    return f"<table>{head}{''.join(rows)}</table>"


def _gpu_cells(c: GpuChange) -> str:
    cells = []
    for field in ("idle_ms", "compute_ms", "non_compute_ms", "comm_comp_overlap_pct"):
        a = None if c.a is None else getattr(c.a, field)
        b = None if c.b is None else getattr(c.b, field)
        cells.append(_cell(_ms(a)) + _cell(_ms(b)))
    return "".join(cells)


def _gpu(d: SessionDiff) -> str:
    if not d.gpu:
        return "<p>Neither session has device events.</p>"

    def where(c: GpuChange) -> str:
        if c.scope is GpuScope.WINDOW:
            return "(window)"
        return c.stage if c.stage is not None else "(outside stages)"

    rows = [
        "<tr>" + _cell(where(c), True) + _cell(c.role or "-", True)
        + _cell("all" if c.rank is None else c.rank) + _gpu_cells(c) + "</tr>"
        for c in d.gpu
    ]  # fmt: skip
    pairs = ("idle", "compute", "non-compute", "overlap %")
    head = (
        '<tr><th class="l">stage</th><th class="l">role</th><th>rank</th>'
        + "".join(f"<th>{p} A</th><th>{p} B</th>" for p in pairs)
        + "</tr>"
    )
    return f"<table>{head}{''.join(rows)}</table>"


def _ops(d: SessionDiff) -> str:
    rows = [
        "<tr>" + _cell(o.stage or "-", True) + _cell(o.device, True) + _cell(o.name, True)
        + _cell(o.a_calls) + _cell(o.b_calls) + _cell(_ms(o.a_self_ms)) + _cell(_ms(o.b_self_ms))
        + _cell(_signed(o.delta_ms)) + "</tr>"
        for o in d.ops
    ]  # fmt: skip
    head = (
        '<tr><th class="l">stage</th><th class="l">device</th><th class="l">operator</th>'
        "<th>calls A</th><th>calls B</th><th>self ms A</th><th>self ms B</th><th>change</th></tr>"
    )
    return f"<table>{head}{''.join(rows)}</table>"


def render_diff_html(d: SessionDiff) -> str:
    rule = d.rule
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>profd diff</title>'
        f"<style>{_CSS}</style></head><body><h1>profd diff</h1>"
        f"<p>A: {escape(d.a)}<br>B: {escape(d.b)}</p>"
        f"<h2>Stages: median wall time per step, B against A</h2>{_stages(d)}"
        f"<p>A change counts beyond max({rule.k:g} × A's spread (scaled MAD), "
        f"{rule.abs_floor_ms:g} ms, {rule.rel_floor:.0%} of A).</p>"
        f"<h2>Ranks whose stage changed</h2>{_ranks(d)}"
        f"<h2>GPU time per step (ms): each role (all ranks) and rank</h2>{_gpu(d)}"
        f"<h2>Operators and kernels that changed most</h2>{_ops(d)}</body></html>"
    )


def write_diff_html(d: SessionDiff, path: Path | str) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_diff_html(d), encoding="utf-8")
    return out
