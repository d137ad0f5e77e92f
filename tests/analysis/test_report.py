"""The HTML report (``profd summarize DIR --html``) on a summary computed from trace files:
four actor ranks, three steps of three stages, rank 1's first stage running long in step 2 so
that its two later stages start late; plus a file on a clock of its own.

What it must show: bars that say what they are (wall time per step, mean over steps) with the
value at each bar; red only for the stage that ran long, the stages it pushed marked as late
starts; a timeline of stages inside light step bands; a clock warning when a file is off the
timeline or placed by metadata. The page is opened in a real headless Chromium and kept as
``test-artifacts/report.png``.
"""

from __future__ import annotations

import gzip
import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from statistics import mean
from typing import Any

import pytest
from browser import headless_chrome

from profd.analysis.models import (
    AlignedFile,
    LateCause,
    SessionSummary,
    SkippedFile,
    StageTime,
    Straggler,
    StragglerRule,
)
from profd.analysis.report import clock_skipped, render_html, write_html
from profd.analysis.report_svg import LATE, LATE_START, PLOT_W, STEP_BG, nice_step, short
from profd.analysis.stragglers import detect_stragglers, late_cause
from profd.analysis.summary import summarize_files

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
SVG = "{http://www.w3.org/2000/svg}"
BASE_NS = 1_800_000_000_000_000_000  # 2027 on the wall clock
HOST = "gpu-node-017.cluster.example.internal"  # long: labels get shortened
ROLE = "actor_rollout_ref"
WORLD = 4
STEPS = (1, 2, 3)
PERIOD_MS = 1500.0
STEP_MS = 900.0
# stage -> (start, duration) in ms after the step starts
PLAN = {"generate_sequences": (50.0, 300.0), "compute_log_prob": (380.0, 100.0),
        "update_actor": (500.0, 300.0)}  # fmt: skip
SLOW = (1, 2, "generate_sequences", 200.0)  # rank, step, stage, extra ms
PUSHED = ("compute_log_prob", "update_actor")  # start late on the slow rank in that step
SKEW_MS = 0.4  # per-rank jitter, well under the 5 ms floor


def _event(name: str, cat: str, ts_ms: float, dur_ms: float, tid: int = 1) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 100, "tid": tid,
            "ts": round(ts_ms * 1000, 3), "dur": round(dur_ms * 1000, 3)}  # fmt: skip


def rank_events(rank: int) -> list[dict[str, Any]]:
    """Step ranges and stage ranges (with an operator inside each) of one rank."""
    out = []
    for step in STEPS:
        t = (step - 1) * PERIOD_MS + rank * SKEW_MS
        shift, step_ms = 0.0, STEP_MS
        for stage, (start, dur) in PLAN.items():
            extra = SLOW[3] if (rank, step, stage) == SLOW[:3] else 0.0
            out.append(_event(stage, "user_annotation", t + start + shift, dur + extra))
            out.append(_event(f"aten::{stage[:4]}", "cpu_op", t + start + shift + 1, dur - 2))
            shift += extra
            step_ms += extra
        out.append(_event(f"step{step}", "user_annotation", t, step_ms))
    return out


def write_trace(path: Path, events: list[dict[str, Any]], header: dict[str, Any]) -> Path:
    doc = {"schemaVersion": 1, **header, "traceEvents": events}
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path


def write_session(directory: Path) -> list[Path]:
    """The four ranks on the wall clock, and a rollout trace with ``ts`` from 0 (no clock)."""
    paths = []
    for rank in range(WORLD):
        meta = {"role": ROLE, "rank": rank, "world_size": WORLD, "topology": {"dp": rank},
                "hostname": HOST, "session_id": "sess-report"}  # fmt: skip
        header = {"baseTimeNanoseconds": BASE_NS, "profd": meta}
        paths.append(write_trace(directory / f"{ROLE}_rank{rank}.pt.trace.json.gz",
                                 rank_events(rank), header))  # fmt: skip
    rollout = [_event("execute_model_0", "user_annotation", 0.0, 0.8)]
    paths.append(write_trace(directory / "rollout-replica1-globalrank2_c.pt.trace.json.gz",
                             rollout, {}))  # fmt: skip
    return paths


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> SessionSummary:
    paths = write_session(tmp_path_factory.mktemp("report-session"))
    return summarize_files([str(p) for p in paths], source="synthetic session", workers=1)


def label(rank: int) -> str:
    return f"{ROLE} rank {rank} (dp{rank}) @{HOST}"


def svgs(html: str) -> dict[str, ET.Element]:
    """Every inline SVG of the page, parsed, by its aria-label."""
    found = re.findall(r"<svg .*?</svg>", html, flags=re.S)
    return {(e := ET.fromstring(s)).get("aria-label") or "": e for s in found}


def title(e: ET.Element) -> str:
    t = e.find(f"{SVG}title")
    return "" if t is None else t.text or ""


def displayed(e: ET.Element) -> str:
    """The text an element displays: its own text and that of its children, less <title>."""
    parts = [e.text or ""]
    for child in e:
        if child.tag != f"{SVG}title":
            parts.append("".join(child.itertext()))
        parts.append(child.tail or "")
    return "".join(parts)


# -- straggler causes -------------------------------------------------------------------------


def row(rank: int, stage: str, start: float, wall: float) -> StageTime:
    return StageTime(step=1, stage=stage, track=f"r{rank}", role="actor", rank=rank,
                     start_ms=start, end_ms=start + wall, wall_ms=wall, calls=1)  # fmt: skip


def test_a_long_stage_is_long_duration_and_the_stage_it_pushes_a_late_start() -> None:
    rows = []
    for rank in range(4):
        extra = 120.0 if rank == 2 else 0.0
        rows += [row(rank, "A", 0.0, 100.0 + extra), row(rank, "B", 110.0 + extra, 50.0)]
    found = {x.stage: x for x in detect_stragglers(rows, StragglerRule())}
    assert set(found) == {"A", "B"} and {x.rank for x in found.values()} == {2}
    a, b = found["A"], found["B"]
    assert a.cause is LateCause.LONG_DURATION and a.cause.long
    assert a.extra_wall_ms == pytest.approx(120) and a.start_late_ms == pytest.approx(0)
    assert b.cause is LateCause.LATE_START and not b.cause.long
    assert b.start_ms == 230.0 and b.peer_median_start_ms == 110.0
    assert b.start_late_ms == pytest.approx(120) and b.extra_wall_ms == pytest.approx(0)
    assert b.late_ms == pytest.approx(120) and b.peer_median_wall_ms == 50.0


def test_late_start_and_long_duration_together_and_the_split_case() -> None:
    rule = StragglerRule()
    starts, walls = [0.0, 0.0, 0.0, 40.0], [100.0, 100.0, 100.0, 160.0]
    start, wall, cause = late_cause(starts, walls, 3, rule)
    assert cause is LateCause.BOTH and start.late == 40 and wall.late == 60
    # late by 8 ms, neither part past the 5 ms floor alone: the larger part is named
    start, wall, cause = late_cause([0, 0, 0, 3.5], [100, 100, 100, 104.5], 3, rule)
    assert start.late < start.threshold and wall.late < wall.threshold
    assert cause is LateCause.LONG_DURATION
    _, _, cause = late_cause([0, 0, 0, 4.5], [100, 100, 100, 103.5], 3, rule)
    assert cause is LateCause.LATE_START


def test_a_straggler_saved_before_causes_still_loads_and_renders(summary) -> None:
    old = summary.stragglers[0].model_dump(mode="json")
    for key in ("start_ms", "peer_median_start_ms", "start_late_ms", "extra_wall_ms", "cause"):
        del old[key]
    x = Straggler.model_validate(old)
    assert x.cause is None and x.start_late_ms is None
    html = render_html(summary.model_copy(update={"stragglers": [x]}))
    assert "not recorded" in html


def test_the_summary_names_the_slow_stage_and_the_stages_it_pushed(summary) -> None:
    rank, step, stage, extra = SLOW
    got = {(x.rank, x.step, x.stage): x for x in summary.stragglers}
    assert set(got) == {(rank, step, s) for s in (stage, *PUSHED)}
    assert got[rank, step, stage].cause is LateCause.LONG_DURATION
    assert got[rank, step, stage].extra_wall_ms == pytest.approx(extra, abs=1)
    for s in PUSHED:
        x = got[rank, step, s]
        assert x.cause is LateCause.LATE_START and x.start_late_ms == pytest.approx(extra, abs=1)
        assert abs(x.extra_wall_ms or 0) < 1 and x.late_ms == pytest.approx(extra, abs=1)


# -- the report -------------------------------------------------------------------------------


def test_bars_say_what_they_show_and_red_is_only_the_stage_that_ran_long(summary) -> None:
    html = render_html(summary)
    charts = svgs(html)
    rank, step, slow, _ = SLOW
    late = {x.stage: x.late_ms for x in summary.stragglers}
    for stage in PLAN:
        assert f"{stage}: wall time per step, mean over {len(STEPS)} step(s) (ms)</h3>" in html
        chart = charts[f"{stage}: mean wall time per step, per track"]
        axis = "".join(t.text or "" for t in chart.iter(f"{SVG}text") if t.get("class"))
        assert f"wall time per step (ms), mean over the {len(STEPS)} step(s)" in axis
        bars = {b.get("data-track"): b for b in chart.iter(f"{SVG}rect")}
        values = [t for t in chart.iter(f"{SVG}text") if t.get("class") == "value"]
        assert len(bars) == len(values) == WORLD
        for r, (b, v) in enumerate(zip(bars.values(), values, strict=True)):
            walls = [
                x.wall_ms for x in summary.stage_times if (x.stage, x.track) == (stage, label(r))
            ]
            assert (v.text or "").startswith(f"{mean(walls):,.1f} ms")  # the value at its bar
            slow_here = (r, stage) == (rank, slow)
            pushed_here = r == rank and stage in PUSHED
            assert (b.get("fill") == LATE) == slow_here, (stage, r)
            assert (b.get("stroke") == LATE_START) == pushed_here, (stage, r)
            note = "".join(v.itertext())
            if slow_here:
                assert f"long duration in step {step} (+{late[stage]:,.1f} ms)" in note
            elif pushed_here:
                assert f"late start in step {step} (+{late[stage]:,.1f} ms)" in note
                assert "LATE (late start)" in title(b)
            else:
                assert "late" not in note


def test_timeline_draws_every_stage_inside_light_step_bands(summary) -> None:
    timeline = svgs(render_html(summary))["stage timeline"]
    rects = list(timeline.iter(f"{SVG}rect"))
    stages = [r for r in rects if r.get("class") == "stage"]
    steps = [r for r in rects if r.get("class") == "step"]
    assert len(stages) == len(summary.stage_times) == WORLD * len(STEPS) * len(PLAN)
    assert len(steps) == WORLD * len(STEPS) and {r.get("fill") for r in steps} == {STEP_BG}
    scale = PLOT_W / summary.span_ms
    shown = {(r.get("data-track"), r.get("data-step"), r.get("data-stage")): r for r in stages}
    for st in summary.stage_times:
        r = shown[(st.track, str(st.step), st.stage)]
        assert float(r.get("width") or 0) == pytest.approx(
            (st.end_ms - st.start_ms) * scale, abs=0.01
        )
        assert float(r.get("height") or 0) > 0.5 * float(steps[0].get("height") or 0)
    rank, step, slow, _ = SLOW
    red = [r for r in stages if r.get("stroke") == LATE]
    orange = [r for r in stages if r.get("stroke") == LATE_START]
    assert [(r.get("data-track"), r.get("data-stage")) for r in red] == [(label(rank), slow)]
    assert {r.get("data-stage") for r in orange} == set(PUSHED)
    assert all(r.get("data-step") == str(step) and r.get("stroke-dasharray") for r in orange)
    assert "LATE (long duration)" in title(red[0])
    texts = list(timeline.iter(f"{SVG}text"))
    ticks = [float(t.text.replace(",", "")) for t in texts if (t.text or "")[:1].isdigit()]
    assert ticks[0] == 0 and len(ticks) >= 5 and ticks[1] == nice_step(summary.span_ms)
    assert any("ms after t0" in (t.text or "") for t in texts)
    assert [t.text for t in texts if t.get("class") == "step-label"] == [f"step {n}" for n in STEPS]
    tracks = [t for t in texts if t.get("class") == "track"]
    assert [title(t) for t in tracks] == [label(r) for r in range(WORLD)]  # full name on hover
    for r, t in enumerate(tracks):
        assert displayed(t) == short(label(r)) and displayed(t).endswith("…")


def test_straggler_table_shows_the_cause_and_what_pushed_it(summary) -> None:
    html = render_html(summary)
    table = html[html.index("<h2>Stragglers</h2>") : html.index("<h2>Stage timeline</h2>")]
    assert table.count("<tr>") == 1 + len(summary.stragglers)
    assert table.count('<span class="late">long duration</span>') == 1
    assert table.count('<span class="lstart">late start</span>') == len(PUSHED)
    assert table.count(f"(after {SLOW[2]} ran long)") == len(PUSHED)
    assert "started late by ms" in table and "ran longer by ms" in table


def test_clock_warning_names_files_kept_apart_or_placed_and_only_then(summary) -> None:
    (apart,) = clock_skipped(summary)  # the rollout trace with ts from 0
    assert apart.name == "rollout-replica1-globalrank2_c.pt.trace.json.gz"
    html = render_html(summary)
    box = html[html.index('<div class="warn" id="clock-warning"') :]
    box = box[: box.index("</div>")]
    assert html.index("clock-warning") < html.index("<h2>Stragglers</h2>")  # near the top
    assert apart.name in box and "not on the wall clock" in box and "1 file(s) kept off" in box
    quiet = summary.model_copy(update={"skipped": []})
    assert "clock-warning" not in render_html(quiet)
    unreadable = SkippedFile(
        name="merged.json.gz", reason="a merged trace written by `profd merge`"
    )
    assert "clock-warning" not in render_html(quiet.model_copy(update={"skipped": [unreadable]}))
    placed = AlignedFile(name="engine-0.trace.json.gz", offset_ms=12.5, uncertainty_ms=3.25,
                         source="profd window start (replica 0)")  # fmt: skip
    html = render_html(quiet.model_copy(update={"aligned": [placed]}))
    box = html[html.index("clock-warning") :]
    box = box[: box.index("</div>")]
    assert placed.name in box and placed.source in box and "± 3.2 ms" in box and "12.5 ms" in box


# -- in a browser -----------------------------------------------------------------------------


@pytest.fixture
def chrome() -> Iterator[Any]:
    with headless_chrome("report test", "1400,1000") as drv:
        yield drv


SHAPES = """
const box = e => { const r = e.getBoundingClientRect(); return [r.top, r.width, r.height]; };
return {
  warn: box(document.getElementById('clock-warning')),
  late: box([...document.querySelectorAll('h2')].find(h => h.textContent === 'Stragglers')),
  stages: [...document.querySelectorAll('svg rect.stage')].map(box),
  bars: [...document.querySelectorAll('svg rect.bar')].map(box),
  overflow: document.documentElement.scrollWidth > window.innerWidth,
  height: document.documentElement.scrollHeight,
};
"""


def screenshot(drv: Any, path: Path) -> bytes:
    """The whole page as a PNG, kept at ``path``."""
    import base64

    shot = drv.execute_cdp_cmd(
        "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}
    )
    data = base64.b64decode(shot["data"])
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return data


def test_report_renders_in_chromium(chrome, summary, tmp_path) -> None:
    page = write_html(summary, tmp_path / "report.html")
    chrome.get(page.as_uri())
    assert chrome.title == "profd summary — sess-report"
    got = chrome.execute_script(SHAPES)
    assert 0 < got["warn"][0] < got["late"][0] and got["warn"][2] > 20  # warning on top
    assert len(got["stages"]) == len(summary.stage_times) and len(got["bars"]) == WORLD * 3
    assert all(w > 1 and h > 10 for _, w, h in got["stages"] + got["bars"])  # drawn, not 0x0
    assert not got["overflow"]  # the plots fit the window
    chrome.set_window_size(1400, min(got["height"] + 100, 8000))
    data = screenshot(chrome, ARTIFACTS / "report.png")
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 1000 and height >= 1500 and len(data) > 50_000  # a rendered page
