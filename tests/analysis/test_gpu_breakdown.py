"""GPU time per track and per stage (HTA's temporal breakdown and communication-computation
overlap), on small Kineto-layout traces whose every figure is worked out by hand below.

Timeline of the GPU file (ms after the file's ts origin; one file per step, the second one
is the same 200 ms later). Host thread: ``step<n>`` [0, 100], stages ``generate`` [0, 40]
and ``update`` [50, 100]; each kernel is launched by a ``cuda_runtime`` call (same
correlation id) at the time in the last column, which says its stage::

    event   class  stream  runs       launched at
    K1      comp   7       [ 5, 15]   2   generate
    K7      comp   20      [10, 18]   3   generate  (overlaps K1 on another stream)
    K2      comp   7       [20, 30]   18  generate
    M1      mem    7       [32, 34]   -   own start 32: generate (no correlation)
    K3      comp   7       [45, 60]   38  generate  (runs after the stage ended)
    N1      comm   20      [55, 70]   52  update    (overlaps K3 on [55, 60], K6 on [62, 64])
    K6      comp   7       [62, 64]   45  outside every stage (between the two)
    S1      mem    7       [72, 73]   71  update
    K4      comp   7       [80, 90]   -   own start 80: update (its correlation has no launch)
    K5      comp   7       [106, 108] 105 after the step: not counted
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import orjson
import pytest
from gpu_traces import (
    CPU_PID,
    CPU_TID,
    HOST,
    MS,
    NCCL,
    cpu_only_events,
    gpu_events,
    header,
    kineto_text,
    shifted,
    x,
)
from typer.testing import CliRunner

from profd.analysis import render_html, summarize_dir
from profd.analysis.digest import digest_file
from profd.analysis.gpu import GpuTimes, KernelClass, kernel_class
from profd.analysis.models import SessionSummary
from profd.cli.main import app

TRACK0 = f"actor rank 0 @{HOST}"


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rank 0 with a GPU (steps 1 and 2, one file each), rank 1 CPU-only (step 1)."""
    root = tmp_path_factory.mktemp("gpu-session")
    (root / "actor_train_step1_rank0-of-2.json").write_text(
        kineto_text(header(0, 1), gpu_events(1))
    )
    (root / "actor_train_step2_rank0-of-2.json").write_text(
        kineto_text(header(0, 2), shifted(gpu_events(2), 200))
    )
    (root / "actor_train_step1_rank1-of-2.json").write_text(
        kineto_text(header(1, 1), cpu_only_events(1))
    )
    return root


@pytest.fixture(scope="module")
def summary(session: Path) -> SessionSummary:
    return summarize_dir(session, workers=1)


# -- the figures, by hand ---------------------------------------------------------------------
# Kept: every event but K5. Window [5, 90] = 85. Busy (union over both streams):
# [5,18] 13 + [20,30] 10 + [32,34] 2 + [45,70] 25 + [72,73] 1 + [80,90] 10 = 61; idle 24.
# Compute: [5,18] 13 + [20,30] 10 + [45,60] 15 + [62,64] 2 + [80,90] 10 = 50 (per stream it
# would be 58: K1 and K7 overlap). Non-compute = busy - compute = 11: M1 2 + S1 1 + the part
# of N1 with no computation ([60,62] + [64,70] = 8). Communication 15, memory 3, overlap of
# communication with computation [55,60] + [62,64] = 7 → 100 * 7 / 15 %.
FILE = GpuTimes(
    kernels=9, window=85e3, idle=24e3, compute=50e3, non_compute=11e3,
    communication=15e3, memory=3e3, overlap=7e3,
)  # fmt: skip
# Per stage (kernels by launch; idle by where the host was; idle gaps [18,20] [30,32]
# [34,45] [70,72] [73,80]):
# generate: K1 K7 K2 M1 K3: busy 13 + 10 + 2 + 15 = 40, compute 38, memory 2; idle in
#   [0,40]: 2 + 2 + 6 = 10; window 50.
# update: N1 S1 K4: busy 15 + 1 + 10 = 26, compute 10, communication 15, memory 1, overlap 0
#   (its communication overlaps other stages' kernels only); idle in [50,100]: 2 + 7 = 9.
# outside: K6: busy 2, compute 2; idle in (40,50): [40,45] = 5; window 7.
STAGES = {
    "generate": GpuTimes(5, 50e3, 10e3, 38e3, 2e3, 0.0, 2e3, 0.0),
    "update": GpuTimes(3, 35e3, 9e3, 10e3, 16e3, 15e3, 1e3, 0.0),
    None: GpuTimes(1, 7e3, 5e3, 2e3, 0.0, 0.0, 0.0, 0.0),
}


def test_kernel_classes_follow_hta() -> None:
    assert kernel_class("kernel", NCCL) is KernelClass.COMMUNICATION
    assert kernel_class("kernel", "ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)") == 1
    assert kernel_class("kernel", "void ncclKernel_x()") is KernelClass.COMMUNICATION
    assert kernel_class("gpu_memcpy", "Memcpy DtoD (Device -> Device)") is KernelClass.MEMORY
    assert kernel_class("kernel", "Memset (Device)") is KernelClass.MEMORY
    assert kernel_class("kernel", "hipMemcpyAsync") is KernelClass.MEMORY
    assert kernel_class("kernel", "Cijk_Alik_Bljk_SB_MT64x16x32") is KernelClass.COMPUTATION
    assert kernel_class("kernel", "hip_fused_gemm") is KernelClass.COMPUTATION


def test_one_file_by_hand_on_both_parsers(session: Path) -> None:
    path = session / "actor_train_step1_rank0-of-2.json"
    fast, generic = digest_file(path), digest_file(path, force_generic=True)
    assert (fast.mode, generic.mode) == ("fast", "generic")
    assert fast.gpu == generic.gpu
    assert fast.gpu is not None
    assert fast.gpu.total == FILE
    assert fast.gpu.stages == STAGES
    t = fast.gpu.total
    assert t.idle + t.compute + t.non_compute == t.window
    cpu = digest_file(session / "actor_train_step1_rank1-of-2.json")
    assert cpu.mode == "fast" and cpu.error is None and cpu.gpu is None


def test_without_step_ranges_every_device_event_counts_as_in_hta(tmp_path: Path) -> None:
    # The step-1 file without its step range: K5 counts too. Window [5, 108] = 103, busy
    # 61 + 2 = 63, idle 40, compute 52, non-compute 11, overlap 7 of 15. HTA 0.5.0 on this
    # very file (no ProfilerStep rows: it keeps every kernel) gives get_temporal_breakdown
    # idle 40000 / compute 52000 / non-compute 11000 / kernel_time 103000 µs and
    # get_comm_comp_overlap 46.67 %.
    path = tmp_path / "no_steps.json"
    events = [e for e in gpu_events(1) if e["name"] != "step1"]
    path.write_text(kineto_text(header(0, 1), events))
    d = digest_file(path)
    assert d.mode == "fast" and d.gpu is not None
    assert d.gpu.total == GpuTimes(10, 103e3, 40e3, 52e3, 11e3, 15e3, 3e3, 7e3)


def test_parsers_agree_in_other_layouts_and_fall_back_when_unsure(
    session: Path, tmp_path: Path
) -> None:
    path = session / "actor_train_step1_rank0-of-2.json"
    original = digest_file(path)
    small = digest_file(path, segment_bytes=4096)  # many cuts
    assert small.mode == "fast" and small.gpu == original.gpu and small.ops == original.ops
    compact = tmp_path / "compact.json"  # no whitespace at all: the flexible pattern
    compact.write_bytes(orjson.dumps(json.loads(path.read_text())))
    d = digest_file(compact, segment_bytes=4096)
    assert d.mode == "fast" and d.gpu == original.gpu
    # a correlation id where the scan does not look (after a nested object; in a cpu_op):
    # the fast path does not guess, the generic path reads the same figures
    events = gpu_events(1)
    for e in events:
        if e["name"] == "gemm_a":
            e["args"] = {"External id": 9, "meta": {"x": 1}} | e["args"]
    odd = tmp_path / "odd.json"
    odd.write_text(kineto_text(header(0, 1), events))
    d = digest_file(odd)
    assert d.mode == "generic" and d.gpu == original.gpu
    events = [*gpu_events(1), x("cpu_op", "aten::odd", CPU_PID, CPU_TID, 3, 1, correlation=77)]
    odd.write_text(kineto_text(header(0, 1), sorted(events, key=lambda e: e["ts"])))
    d = digest_file(odd)
    assert d.mode == "generic" and d.gpu == original.gpu


def test_track_and_stage_figures(summary: SessionSummary) -> None:
    assert [g.track for g in summary.gpu] == [TRACK0]  # the CPU-only rank has none
    (g,) = summary.gpu
    # two files of one step each: their windows add up (the 115 ms between them is not idle)
    assert g.kernels == 2 * 9
    assert (g.window_ms, g.idle_ms, g.compute_ms, g.non_compute_ms) == (170, 48, 100, 22)
    assert (g.communication_ms, g.memory_ms) == (30, 6)
    assert g.comm_comp_overlap_pct == 100 * 7 / 15
    rows = {r.stage: r for r in g.stages}
    assert [r.stage for r in g.stages] == ["generate", "update", None]
    for stage, t in STAGES.items():
        r = rows[stage]
        assert r.kernels == 2 * t.kernels
        assert r.window_ms == 2 * t.window / MS and r.idle_ms == 2 * t.idle / MS
        assert r.compute_ms == 2 * t.compute / MS and r.non_compute_ms == 2 * t.non_compute / MS
        assert r.communication_ms == 2 * t.communication / MS
        assert r.memory_ms == 2 * t.memory / MS
    assert rows["update"].comm_comp_overlap_pct == 0.0
    assert rows["generate"].comm_comp_overlap_pct is None  # no communication
    # the stages' idle time is the track's, split by where the host was
    assert sum(r.idle_ms for r in g.stages) == g.idle_ms


def test_cpu_only_rank_is_read_not_skipped(summary: SessionSummary) -> None:
    assert summary.skipped == []
    assert {f.track for f in summary.files} == {TRACK0, f"actor rank 1 @{HOST}"}
    ranks = {(r.rank, r.stage) for r in summary.stage_times if r.step == 1}
    assert {(1, "generate"), (1, "update"), (0, "generate"), (0, "update")} == ranks


def test_device_operators_are_in_the_stage_of_their_launch(summary: SessionSummary) -> None:
    gpu = {g.stage: {o.name for o in g.ops} for g in summary.top_ops if g.device == "gpu"}
    assert "gemm_c" in gpu["generate"]  # ran after generate ended, launched inside it
    assert "add_kernel" in gpu[None]  # launched between the stages, ran inside update
    assert "relu_kernel" in gpu["update"]  # no launch found: its own start
    assert "late_kernel" in gpu[None]  # after the step: an operator, but no GPU time


def run(*args: str) -> str:
    r = CliRunner().invoke(app, ["summarize", *args])
    assert r.exit_code == 0, r.output
    return r.stdout


def table(out: str, title: str) -> list[list[str]]:
    """Cells of the rows of the table whose title starts with ``title``."""
    lines = out.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith(title))
    rule = next(i for i in range(top, len(lines)) if set(lines[i].strip()) == {"─"})
    rows = []
    for line in lines[rule + 1 :]:
        if not line.startswith(" ") or not line.strip():  # a note or a blank line ends it
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_cli_default_view_has_the_gpu_tables_in_80_columns(session: Path) -> None:
    out = run(str(session))
    assert max(len(line) for line in out.splitlines()) <= 80
    (row,) = table(out, "GPU time per track")
    assert row == ["actor r0", "170.0", "28.2%", "100.0", "22.0", "30.0", "6.0", "46.7%"]
    stages = table(out, "GPU time per stage")
    assert [r[0] for r in stages] == ["generate", "update", "(outside)"]
    assert stages[1] == ["update", "70.0", "25.7%", "20.0", "32.0", "30.0", "0.0%"]
    assert stages[0][-1] == "-"  # no communication: no overlap to speak of


def test_cli_per_step_and_json_carry_it(session: Path) -> None:
    out = run(str(session), "--per-step")
    assert "GPU time per track" in out and "GPU time per track x stage" in out
    doc = json.loads(run(str(session), "--json"))
    assert doc["gpu"][0]["track"] == TRACK0 and doc["gpu"][0]["window_ms"] == 170
    old = {k: v for k, v in doc.items() if k != "gpu"}  # a summary from before this field
    assert SessionSummary.model_validate(old).gpu == []


def test_cpu_only_session_prints_no_gpu_table(session: Path, tmp_path: Path) -> None:
    only = tmp_path / "cpu"
    only.mkdir()
    (only / "a.json").symlink_to(session / "actor_train_step1_rank1-of-2.json")
    out = run(str(only))
    assert "GPU time" not in out and "Stage wall time" in out
    assert summarize_dir(only, workers=1).gpu == []


def test_html_report_has_a_gpu_section(summary: SessionSummary) -> None:
    html = render_html(summary)
    section = html[html.index('<h2 id="gpu">') :]
    section = section[: section.index("<h2", 5)]
    assert "GPU time" in section and "<table>" in section and "<svg" in section
    assert "h&lt;1&gt;" in section and HOST not in section  # the track name, escaped
    assert section.count('class="gpu-part"') == 3  # compute, non-compute, idle of one track
    assert "46.7%" in section
