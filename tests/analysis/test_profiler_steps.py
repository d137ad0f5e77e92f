"""Any torch trace, not only profd's: a real torch.profiler trace with a schedule and
``prof.step()`` gets its steps from torch's ``ProfilerStep#<n>`` rows; a file with profd's
own step ranges keeps them (never both); ROCm-style traces (HIP names, RCCL, no "cuda" in
any kernel name) and traces without ``distributedInfo`` are read, never skipped."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule

from profd.analysis import summarize_dir
from profd.analysis.digest import digest_file
from profd.analysis.gpu import GpuTimes, union_length
from profd.analysis.ranges import Range, step_ranges

MODEL = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
MS = 1000.0
T0 = 4_203_669_000_000.0  # µs, a ROCm trace's ts origin
ELEMENTWISE = (
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<"
    "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() "
    "const::{lambda(float)#1}>(at::TensorIteratorBase&)::{lambda(int)#1}>(int)"
)


@pytest.fixture(scope="module")
def torch_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real trace of three profiled steps: schedule wait=0 warmup=0 active=3."""
    root = tmp_path_factory.mktemp("torch-steps")
    path = root / "plain_torch.pt.trace.json"
    torch.set_num_threads(1)
    with warnings.catch_warnings():  # "won't be using warmup": warmup=0 is the point here
        warnings.simplefilter("ignore", UserWarning)
        sched = schedule(wait=0, warmup=0, active=3, repeat=1)
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=sched,
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
    ) as prof:
        for _ in range(3):
            MODEL(torch.randn(4, 8)).sum().backward()
            prof.step()
    return path


def profiler_steps(doc: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [e for e in doc["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]
    return sorted(rows, key=lambda e: e["ts"])


def test_real_trace_gets_its_steps_from_profiler_step_rows(torch_trace: Path) -> None:
    doc = json.loads(torch_trace.read_text())
    rows = profiler_steps(doc)
    # what torch 2.13 writes: user_annotation rows, numbered from 0, no distributedInfo
    assert [e["name"] for e in rows] == ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2"]
    assert {e["cat"] for e in rows} == {"user_annotation"} and "distributedInfo" not in doc
    d = digest_file(torch_trace)
    assert d.mode == "fast" and d.error is None and d.gpu is None
    s = summarize_dir(torch_trace.parent, workers=1)
    assert s.skipped == [] and len(s.files) == 1 and s.files[0].parse == "fast"
    assert s.steps == [0, 1, 2]
    assert [(t.step, t.wall_ms) for t in s.step_times] == [
        (i, e["dur"] / MS) for i, e in enumerate(rows)
    ]
    # the trace's activity, per step: a stage row per step, the step's own range
    assert [(r.step, r.stage) for r in s.stage_times] == [(i, "(trace)") for i in range(3)]
    walls = [r.wall_ms for r in s.stage_times]
    assert walls == pytest.approx([e["dur"] / MS for e in rows], abs=1e-6)
    assert s.gpu == []  # CPU only: read, no GPU entry


def add_device_events(doc: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[float, float]]]:
    """The real trace plus one launch and one kernel (30 µs, 20 µs into the step) per
    ProfilerStep row, and one launched before the first step (not counted)."""
    events = list(doc["traceEvents"])
    cpu = profiler_steps(doc)[0]
    kernels = []
    launches = [(cpu["ts"] - 40.0, 100)] + [
        (e["ts"] + 10.0, i) for i, e in enumerate(profiler_steps(doc))
    ]
    for at, corr in launches:
        events.append(
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": cpu["pid"],
             "tid": cpu["tid"], "ts": at, "dur": 4.0,
             "args": {"cbid": 211, "correlation": corr}}
        )  # fmt: skip
        start = at + 10.0
        events.append(
            {"ph": "X", "cat": "kernel", "name": f"gemm_{corr}", "pid": 0, "tid": 7,
             "ts": start, "dur": 30.0, "args": {"stream": 7, "correlation": corr}}
        )  # fmt: skip
        if corr != 100:
            kernels.append((start, start + 30.0))
    return doc | {"traceEvents": events}, kernels


def test_device_time_of_a_torch_trace_counts_its_profiler_steps(
    torch_trace: Path, tmp_path: Path
) -> None:
    doc, kernels = add_device_events(json.loads(torch_trace.read_text()))
    path = tmp_path / "with_gpu.json"
    path.write_bytes(orjson.dumps(doc))  # compact, Kineto's key order: still the fast path
    fast = digest_file(path, pseudo_stage="(trace)")
    generic = digest_file(path, pseudo_stage="(trace)", force_generic=True)
    assert fast.mode == "fast" and fast.gpu == generic.gpu and fast.gpu is not None
    window = kernels[-1][1] - kernels[0][0]
    busy = 3 * 30.0
    t = fast.gpu.total
    assert (t.kernels, t.compute, t.non_compute, t.communication) == (3, busy, 0.0, 0.0)
    assert t.window == pytest.approx(window, abs=1e-6)
    assert t.idle == pytest.approx(window - busy, abs=1e-6)
    # the idle time while the host was inside a step (the "(trace)" stage), the rest between
    rows = profiler_steps(doc)
    inside = [
        (max(e["ts"], kernels[0][0]), min(e["ts"] + e["dur"], kernels[-1][1], nxt))
        for e, nxt in zip(rows, [r["ts"] for r in rows[1:]] + [float("inf")], strict=True)
    ]
    stage_idle = sum(b - a for a, b in inside if b > a) - busy
    assert fast.gpu.stages["(trace)"].idle == pytest.approx(stage_idle, abs=1e-6)
    assert fast.gpu.stages["(trace)"].kernels == 3
    rest = fast.gpu.stages.get(None, GpuTimes())
    assert rest.kernels == 0 and rest.idle == pytest.approx(t.idle - stage_idle, abs=1e-6)
    s = summarize_dir(_alone(path, tmp_path), workers=1)
    assert s.steps == [0, 1, 2] and s.gpu[0].kernels == 3


def _alone(path: Path, tmp_path: Path) -> Path:
    d = tmp_path / "alone"
    d.mkdir()
    (d / path.name).symlink_to(path)
    return d


def test_profd_steps_win_over_profiler_step_rows() -> None:
    ranges = [
        Range("ProfilerStep#7", 0.0, 100.0, 0),
        Range("step3", 1.0, 98.0, 0),
        Range("generate", 2.0, 50.0, 0),
    ]
    assert [(n, r.name) for n, r in step_ranges(ranges)] == [(3, "step3")]
    torch_only = [Range("ProfilerStep#7", 0.0, 100.0, 0), Range("ProfilerStep#8", 100.0, 9.0, 0)]
    assert [n for n, _ in step_ranges(torch_only)] == [7, 8]


def test_a_profd_trace_with_torch_step_rows_counts_each_step_once(tmp_path: Path) -> None:
    ev = [
        ("ProfilerStep#0", 0, 100), ("step3", 1, 98), ("generate", 2, 40), ("update", 50, 40),
    ]  # fmt: skip
    events = [
        {"ph": "X", "cat": "user_annotation", "name": n, "pid": 1, "tid": 1, "ts": T0 + a * MS,
         "dur": d * MS}
        for n, a, d in ev
    ]  # fmt: skip
    meta = {"role": "actor", "rank": 0, "world_size": 1, "step": 3}
    doc = {"schemaVersion": 1, "profd": meta, "baseTimeNanoseconds": 1, "traceEvents": events}
    (tmp_path / "both.json").write_bytes(orjson.dumps(doc))
    s = summarize_dir(tmp_path, workers=1)
    assert s.steps == [3] and [(t.step, t.wall_ms) for t in s.step_times] == [(3, 98.0)]
    assert [(r.step, r.stage) for r in s.stage_times] == [(3, "generate"), (3, "update")]


# -- a ROCm-style trace: Kineto's one-line event heads, HIP runtime names, no distributedInfo --
def rocm_event(cat: str, name: str, pid: int, tid: int, start: float, dur: float, args: str):
    head = json.dumps({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid})[1:-1]
    tail = f',\n    "args": {{\n      {args}\n    }}' if args else ""
    return f'  {{\n    {head},\n    "ts": {T0 + start * MS:.3f}, "dur": {dur * MS:.3f}{tail}\n  }}'


def hip_launch(at: float, corr: int, kernel: str = ELEMENTWISE) -> str:
    # as roctracer writes it: the kernel's name (braces and all) before the correlation id
    args = (
        f'"External id": {corr + 10},          "kernel": {json.dumps(kernel)}, "cid": 107, '
        f'"correlation": {corr},      "stream": "0x0",      "grid": [3, 1, 1]'
    )
    return rocm_event("cuda_runtime", "hipLaunchKernel", 500, 500, at, 0.1, args)


def rocm_device(cat: str, name: str, tid: int, start: float, end: float, corr: int) -> str:
    args = f'"External id": 13,      "device": 2, "stream": {tid},      "correlation": {corr}'
    return rocm_event(cat, name, 2, tid, start, end - start, args + ', "kind": "Dispatch Kernel"')


GEMM = "Cijk_Alik_Bljk_SB_MT64x16x32_MI16x16x1_SN_LDSB0"
RCCL = "ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)"


def rocm_text() -> str:
    events = [
        rocm_event("user_annotation", "ProfilerStep#0", 500, 500, 0, 10, '"External id": 1'),
        rocm_event("user_annotation", "ProfilerStep#1", 500, 500, 10, 10, '"External id": 2'),
        rocm_event("cpu_op", "aten::mm", 500, 500, 0.5, 2, '"External id": 3'),
        hip_launch(1, 1, GEMM),
        rocm_device("kernel", GEMM, 0, 2, 6, 1),
        hip_launch(2, 2),
        rocm_device("kernel", ELEMENTWISE, 0, 6, 7, 2),
        hip_launch(11, 3, "hipMemcpyWithStream"),
        rocm_device("gpu_memcpy", "Memcpy HtoD (Host -> Device)", 0, 11, 12, 3),
        hip_launch(12, 4, RCCL),
        rocm_device("kernel", RCCL, 1, 12, 16, 4),
        hip_launch(12.5, 6, GEMM),
        rocm_device("kernel", GEMM, 0, 14, 15, 6),
        hip_launch(21, 5),
        rocm_device("kernel", ELEMENTWISE, 0, 21.5, 22, 5),  # launched after the steps
    ]
    return (
        '{\n  "schemaVersion": 1,\n  "deviceProperties": [\n    {"id": 2, "name": "AMD Radeon '
        'Graphics", "warpSize": 64}\n  ],\n  "record_shapes": 1,\n  "traceEvents": [\n'
        + ",\n".join(events)
        + '\n  ],\n  "traceName": "mi250.json",\n  "displayTimeUnit": "ms",\n'
        '  "baseTimeNanoseconds": 1735632360000000000\n}\n'
    )


# Kept: all but the last. Window [2, 16] = 14; busy [2,7] 5 + [11,16] 5 = 10, idle [7,11] 4;
# compute [2,7] 5 + [14,15] 1 = 6; non-compute 4 (the memcpy 1, the RCCL kernel's 4 minus
# its 1 ms with the GEMM); communication 4, memory 1, overlap 1 (25 %). Every launch is in
# a ProfilerStep row: all of it is the "(trace)" stage's.
ROCM = GpuTimes(
    kernels=5, window=14e3, idle=4e3, compute=6e3, non_compute=4e3, communication=4e3,
    memory=1e3, overlap=1e3,
)  # fmt: skip


def test_rocm_style_trace_without_distributed_info(tmp_path: Path) -> None:
    path = tmp_path / "mi250.json"
    path.write_text(rocm_text())
    fast, generic = (
        digest_file(path, pseudo_stage="(trace)"),
        digest_file(path, pseudo_stage="(trace)", force_generic=True),
    )
    assert (fast.mode, generic.mode) == ("fast", "generic")
    assert "distributedInfo" not in fast.header
    assert fast.gpu == generic.gpu and fast.gpu is not None
    assert fast.gpu.total == ROCM and fast.gpu.stages == {"(trace)": ROCM}
    s = summarize_dir(tmp_path, workers=1)
    assert s.skipped == [] and s.steps == [0, 1] and s.tracks[0].kind == "file"
    (g,) = s.gpu
    assert (g.window_ms, g.idle_ms, g.compute_ms, g.non_compute_ms) == (14, 4, 6, 4)
    assert (g.communication_ms, g.memory_ms, g.comm_comp_overlap_pct) == (4, 1, 25.0)
    assert [r.stage for r in g.stages] == ["(trace)"]


def test_union_is_over_streams_not_per_stream() -> None:
    import numpy as np

    start, end = np.array([0.0, 5.0, 20.0]), np.array([10.0, 12.0, 21.0])
    assert union_length(start, end) == 13.0  # not 10 + 7 + 1
