"""``profd diff``: two sessions of one workload, B with a slower stage and a heavier operator.
The verdicts by hand first, then two real recordings through the CLI (its own process), the
HTTP route and the HTML view."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import torch

from profd.analysis.diff import DiffRule, Verdict, diff_summaries
from profd.analysis.diff_report import render_diff_html
from profd.analysis.models import (
    OpStat,
    ProcessingStats,
    SessionSummary,
    StageOps,
    StageTime,
    StragglerRule,
)

from helpers import AUTH, start_agents, wait_armed, wait_terminal

PROFD = [sys.executable, "-m", "profd.cli.main"]


def summary(rows: list[tuple[str, int, int, float]], ops=(), source="s") -> SessionSummary:
    """rows: (stage, rank, step, wall ms) of role actor; ops: (stage, name, calls, self ms)."""
    stage_times = [
        StageTime(step=step, stage=st, track=f"actor rank {rank}", role="actor", rank=rank,
                  start_ms=0.0, end_ms=wall, wall_ms=wall, calls=1)
        for st, rank, step, wall in rows
    ]  # fmt: skip
    groups: dict[str, list[OpStat]] = {}
    for st, name, calls, ms in ops:
        groups.setdefault(st, []).append(
            OpStat(name=name, category="cpu_op", calls=calls, self_ms=ms, total_ms=ms, share=0.0)
        )
    return SessionSummary(
        source=source, session_ids=[], t0_epoch_us=None, span_ms=0.0, steps=[1, 2, 3],
        stages=list(dict.fromkeys(r[0] for r in rows)), tracks=[], files=[], skipped=[],
        stage_times=stage_times, step_times=[], stage_stats=[], mini_batches=[],
        idle_gaps=[],
        top_ops=[StageOps(stage=s, device="cpu", self_ms=0.0, ops=o) for s, o in groups.items()],
        stragglers=[], straggler_rule=StragglerRule(),
        processing=ProcessingStats(files=0, json_bytes=0, wall_s=0.0, mode="serial", workers=1,
                                   start_method=None, worker_memory_mb=None),
    )  # fmt: skip


def test_verdicts_by_hand_beyond_the_noise_only() -> None:
    # gen: A 10/10/10 and 10/10/10 ms; B 10.4 (within 1 ms / 5 %): same.
    # upd: A 20, 22, 21 on each rank; B 30: +9.5 ms against a threshold of
    #      max(3 x 1.4826 x MAD, 1 ms, 5 % of 21) = max(3 x 1.4826 x 1, 1, 1.05) = 4.45: slower.
    # log: A 50 with a noisy rank (30..70): B 40 is within its spread: same.
    a_rows, b_rows = [], []
    for rank in (0, 1):
        for step, wall in zip((1, 2, 3), (20.0, 22.0, 21.0), strict=True):
            a_rows += [("gen", rank, step, 10.0), ("upd", rank, step, wall)]
            b_rows += [("gen", rank, step, 10.4), ("upd", rank, step, 30.0)]
    a_rows += [("log", 0, s, w) for s, w in ((1, 30.0), (2, 50.0), (3, 70.0))]
    b_rows += [("log", 0, s, 40.0) for s in (1, 2, 3)]
    b_rows += [("new", 1, 1, 5.0)]
    a = summary(a_rows, ops=[("upd", "aten::mm", 6, 12.0), ("upd", "aten::add", 6, 1.0)])
    b = summary(b_rows, ops=[("upd", "aten::mm", 60, 70.0), ("upd", "aten::add", 6, 1.1)])
    d = diff_summaries(a, b)
    by = {c.stage: c for c in d.stages}
    assert by["gen"].verdict is Verdict.SAME and by["gen"].delta_ms == pytest.approx(0.4)
    assert by["upd"].verdict is Verdict.SLOWER and by["upd"].delta_ms == pytest.approx(9.0)
    assert by["upd"].threshold_ms == pytest.approx(3 * 1.4826 * 1.0)
    assert by["log"].verdict is Verdict.SAME  # -10 ms, but its steps vary by 20 ms
    assert by["new"].verdict is Verdict.ONLY_B and by["new"].a_ms is None
    assert [c.stage for c in d.stages] == ["gen", "upd", "log", "new"]  # A's order, then B's
    assert {(c.stage, c.rank) for c in d.ranks} == {("gen", 0), ("gen", 1), ("upd", 0),
                                                    ("upd", 1), ("log", 0)}  # fmt: skip
    top = d.ops[0]
    assert (top.name, top.a_calls, top.b_calls, top.delta_ms) == ("aten::mm", 6, 60, 58.0)
    faster = diff_summaries(b, a)
    assert {c.stage: c.verdict for c in faster.stages}["upd"] is Verdict.FASTER
    loose = diff_summaries(a, b, DiffRule(rel_floor=0.5))  # 50 % of 21 ms: not beyond it
    assert {c.stage: c.verdict for c in loose.stages}["upd"] is Verdict.SAME
    with pytest.raises(ValueError, match="top"):
        diff_summaries(a, b, top=0)


def test_the_html_view_escapes_names_from_the_traces() -> None:
    a = summary([("<b>st</b>", 0, 1, 1.0)], ops=[("<b>st</b>", "<script>x()</script>", 1, 1.0)])
    html = render_diff_html(diff_summaries(a, a))
    assert "<script>x()" not in html and "&lt;script&gt;x()&lt;/script&gt;" in html
    assert "<b>st</b>" not in html and "&lt;b&gt;st&lt;/b&gt;" in html


def _step(agent, step: int, heavy: bool) -> None:
    x = torch.randn(96, 96)
    with agent.step(step):
        with agent.stage("generate"):
            time.sleep(0.02)
            torch.relu(x)
        with agent.stage("update"):
            # the injected slowdown: a longer wait and many more (and larger) matmuls
            time.sleep(0.15 if heavy else 0.02)
            n = 192 if heavy else 96
            y, w = torch.randn(n, n), torch.randn(n, n) / n**0.5  # stays bounded
            for _ in range(40 if heavy else 2):
                y = torch.mm(y, w)


def _record(owner, heavy: bool) -> str:
    # One intra-op thread: on 2 shared cores the first parallel op after a sleep waited up to
    # 5 ms for the pool to wake (a 192x192 division "took" 30 ms over a recording), which
    # drowned the injected matmuls in the operator diff.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _recorded(owner, heavy)
    finally:
        torch.set_num_threads(threads)


def _recorded(owner, heavy: bool) -> str:
    agents = start_agents(owner, 2)
    for a in agents:
        _step(a, 0, heavy)
    view = owner.call("create_session", {"next_steps": 3, "roles": {"actor": {"all_ranks": True}}})
    for a in agents:
        wait_armed(a, view.session_id)
    # the window starts where the coordinator put it (at least align_lead_s ahead by the live
    # step times, so a few steps on when these short steps are already timed): run past it
    for s in range(1, max(view.steps) + 2):
        for a in agents:
            _step(a, s, heavy)
    view = wait_terminal(owner, view.session_id, timeout=60)
    assert view.state.value == "done", view.reason
    for a in agents:
        a.close()
    return view


def test_two_recordings_through_the_cli_the_route_and_the_html(sidecar, tmp_path) -> None:
    owner = sidecar.owner
    a, b = _record(owner, heavy=False), _record(owner, heavy=True)
    env = dict(os.environ, HOME=str(tmp_path), COLUMNS="100")
    run = subprocess.run(
        # a 10 ms floor: a shared 2-core box jitters a 20 ms sleep by a few ms
        [*PROFD, "diff", a.save_dir, b.save_dir, "--json", "--html", str(tmp_path / "d.html"),
         "--noise-floor-ms", "10"],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    d = json.loads(run.stdout)
    verdicts = {(c["stage"], c["role"]): c["verdict"] for c in d["stages"]}
    assert verdicts[("update", "actor")] == "slower", json.dumps(d["stages"], indent=1)
    assert verdicts[("generate", "actor")] == "same", d["stages"]
    assert all(c["verdict"] == "slower" for c in d["ranks"] if c["stage"] == "update")
    top = d["ops"][0]
    assert top["stage"] == "update" and "mm" in top["name"] and top["b_calls"] > top["a_calls"]
    html = (tmp_path / "d.html").read_text()
    assert "<h1>profd diff</h1>" in html and 'class="l slower">slower</td>' in html
    table = subprocess.run(
        [*PROFD, "diff", a.save_dir, b.save_dir], env=env, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    assert table.returncode == 0 and "slower" in table.stdout and "Noise:" in table.stdout

    url = f"{sidecar.url}/api/v1/sessions/{a.session_id}/diff/{b.session_id}"
    got = httpx.get(url, headers=AUTH, timeout=120)
    assert got.status_code == 200, got.text
    api = {(c["stage"], c["role"]): c for c in got.json()["stages"]}
    assert api.keys() == verdicts.keys() and api[("update", "actor")]["verdict"] == "slower"
    cli_a = {(c["stage"], c["role"]): c["a_ms"] for c in d["stages"]}
    assert all(api[k]["a_ms"] == pytest.approx(cli_a[k]) for k in api)  # the same summaries
    missing = httpx.get(f"{sidecar.url}/api/v1/sessions/{a.session_id}/diff/nope", headers=AUTH)
    assert missing.status_code == 404
    bad = subprocess.run([*PROFD, "diff", str(tmp_path / "none"), b.save_dir], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "no such directory" in bad.stderr
