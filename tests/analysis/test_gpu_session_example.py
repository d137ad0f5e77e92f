"""``docs/examples/gpu_session.py``: the synthetic GPU sessions the README's GPU tables come
from. Their figures are the ones its docstring works out by hand, and the rows the README
quotes are the rows ``profd summarize`` and ``profd diff`` print."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
from typer.testing import CliRunner

from profd.analysis import summarize_dir
from profd.analysis.diff import DIFF_TOP_OPS, Verdict, diff_summaries
from profd.analysis.diff_report import render_diff_html
from profd.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "examples" / "gpu_session.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_session_example", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gpu-example")
    assert load_script().main([str(root)]) == 0
    return root


def test_the_figures_are_the_docstrings(out: Path) -> None:
    a = summarize_dir(out / "baseline", workers=1, top=DIFF_TOP_OPS)
    b = summarize_dir(out / "slower", workers=1, top=DIFF_TOP_OPS)
    assert [len(s.files) for s in (a, b)] == [4, 4] and not a.skipped and not b.skipped
    # per track (two one-step files): baseline 2 x (91, 27, 55, 9, 20, 4, 15); slower 2 x
    # (111, 27, 75, 9, 20, 4, 15)
    for summary, window, compute in ((a, 182.0, 110.0), (b, 222.0, 150.0)):
        assert [g.track for g in summary.gpu] == ["actor rank 0", "actor rank 1"]
        for g in summary.gpu:
            got = (g.window_ms, g.idle_ms, g.compute_ms, g.non_compute_ms)
            assert got == pytest.approx((window, 54.0, compute, 18.0))
            assert (g.communication_ms, g.memory_ms) == pytest.approx((40.0, 8.0))
            assert g.comm_comp_overlap_pct == pytest.approx(75.0)
    diff = diff_summaries(a, b, top=3)
    verdicts = {(s.stage, s.verdict, s.delta_ms) for s in diff.stages}
    assert verdicts == {("generate", Verdict.SAME, 0.0), ("update_actor", Verdict.SLOWER, 20.0)}
    first = diff.ops[0]
    assert (first.name, first.device, first.a_self_ms, first.b_self_ms) == (
        "sm90_gemm_bf16_tn", "gpu", 120.0, 200.0,
    )  # fmt: skip
    assert all(o.delta_ms == 0 for o in diff.ops[1:])
    # per step and rank (one file each): (idle, compute, non-compute, overlap) by hand —
    # the window 27/55/9/75 % -> 27/75/9/75 %; update_actor's GEMMs 2 x 15 -> 2 x 25 ms
    gpu = {(g.scope.value, g.stage, g.rank): g for g in diff.gpu}
    want = {
        ("window", None): ((27, 55, 9, 75), (27, 75, 9, 75)),
        ("stage", "update_actor"): ((10, 30, 7, 75), (10, 50, 7, 75)),
        ("stage", "generate"): ((12, 25, 2, None), (12, 25, 2, None)),
    }
    for (scope, stage), figures in want.items():
        for rank in (None, 0, 1):
            g = gpu[(scope, stage, rank)]
            for x, fig in zip((g.a, g.b), figures, strict=True):
                got = (x.idle_ms, x.compute_ms, x.non_compute_ms, x.comm_comp_overlap_pct)
                assert got == pytest.approx(fig), (scope, stage, rank)
            assert (g.a.steps, g.b.steps) == ((4, 4) if rank is None else (2, 2))
    assert gpu[("window", None, None)].compute_delta_ms == pytest.approx(20.0)
    html = render_diff_html(diff)
    assert (
        '<td class="l">update_actor</td><td class="l">actor</td><td>all</td>'
        "<td>10.0</td><td>10.0</td><td>30.0</td><td>50.0</td>"
    ) in html


def _rows(text: str) -> set[str]:
    """Table rows with their box characters and runs of spaces squeezed out."""
    return {re.sub(r"\s+", " ", re.sub(r"[│┃]", " ", ln)).strip() for ln in text.splitlines()}


def test_the_readme_quotes_the_real_output(out: Path) -> None:
    runner = CliRunner()
    summary = runner.invoke(app, ["summarize", str(out / "baseline"), "--workers", "1"])
    diff = runner.invoke(
        app,
        ["diff", str(out / "baseline"), str(out / "slower"), "--top", "3", "--workers", "1"],
        env={"COLUMNS": "100"},
    )
    assert summary.exit_code == 0 and diff.exit_code == 0, summary.output + diff.output
    readme = _rows((ROOT / "README.md").read_text())
    quoted = [
        "actor r0 182.0 29.7% 110.0 18.0 40.0 8.0 75.0%",
        "update_actor 188.0 21.3% 120.0 28.0 80.0 75.0%",
        "update_actor actor 55.0 75.0 +20.0 +36.4% slower",
        "update_actor sm90_gemm_bf16_tn 8 8 120.0 200.0 +80.0",
        "update_actor actor 10.0 → 10.0 30.0 → 50.0 7.0 → 7.0 75.0 → 75.0",
    ]
    printed = _rows(summary.output) | _rows(diff.output)
    assert [q for q in quoted if q not in printed] == []
    assert [q for q in quoted if q not in readme] == []
