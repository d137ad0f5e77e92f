"""Write two small synthetic GPU sessions, for trying ``profd summarize`` and ``profd diff`` on
GPU traces without a GPU (the README's GPU tables come from them)::

    python docs/examples/gpu_session.py /tmp/profd-gpu
    profd summarize /tmp/profd-gpu/baseline
    profd diff /tmp/profd-gpu/baseline /tmp/profd-gpu/slower

Each session is what profd writes for an ``actor`` role of two ranks (world size 2), steps 1
and 2, one ``.json.gz`` per rank and step, in the Kineto layout torch 2.13 writes (one key per
line, ``"args"`` after a lone comma) with profd's header (``profd``, ``distributedInfo``,
``baseTimeNanoseconds``). Both ranks run the same timeline; nothing here is measured.

Timeline of one step of ``baseline`` (ms after the step's start; the host thread holds
``step<n>`` [0, 100], stage ``generate`` [0, 40] and stage ``update_actor`` [45, 100]; every
device event is launched by a ``cuda_runtime`` call with its correlation id, inside a
``cpu_op``)::

    device event                                 class  stream  runs      launched  stage
    Memcpy HtoD (Pageable -> Device)             mem    7       [ 1,  3]   0.5      generate
    flash_fwd_kernel                             comp   7       [ 4, 24]   1.0      generate
    elementwise_kernel                           comp   7       [25, 30]   2.0      generate
    sm90_gemm_bf16_tn                            comp   7       [46, 61]  45.5      update_actor
    ncclDevKernel_AllReduce_Sum_bf16_RING_LL     comm   20      [58, 78]  57.0      update_actor
    sm90_gemm_bf16_tn                            comp   7       [66, 81]  60.0      update_actor
    Memcpy DtoH (Device -> Pageable)             mem    7       [90, 92]  89.0      update_actor

By hand, per file: window [1, 92] = 91 ms; busy (union over both streams) 2 + 20 + 5 + 35 + 2
= 64, idle 27; compute 20 + 5 + 15 + 15 = 55; non-compute 64 - 55 = 9 (the two copies, 4, and
the all-reduce while no GEMM runs, [61, 66]); communication 20, memory 4, overlap 15 (75 %).
A track (a rank: two files) is twice that: window 182, idle 54 (29.7 %), compute 110.

``slower`` is ``baseline`` with one injected slowdown: both ``sm90_gemm_bf16_tn`` kernels take
25 ms instead of 15, so ``update_actor`` runs [45, 120] and the step 120 ms (the all-reduce
starts at 68, the second GEMM at 76, the last copy at 110). Per file: window 111, busy 84,
idle 27, compute 75, non-compute 9, communication 20, overlap 15 (75 %). ``profd diff`` then
calls ``update_actor`` 55 -> 75 ms slower, ``generate`` the same, and puts the GEMM first
among the kernels that changed.

Standard library and ``profd.core.naming`` only (no torch, no Ray); deterministic output.
"""

from __future__ import annotations

import gzip
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from profd.core.naming import trace_stem

MS = 1000.0  # µs
BASE_NS = 1_790_000_000_000_000_000  # the files' wall clock (2026-09-21)
PID = 4242
COMP, COMM = 7, 20  # streams
NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
GEMM = "sm90_gemm_bf16_tn"

# (name, category, stream, start, end, launched at, launching cpu_op) in ms after the step
Device = tuple[str, str, int, float, float, float, str]
BASELINE: list[Device] = [
    ("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", COMP, 1, 3, 0.5, "aten::copy_"),
    ("flash_fwd_kernel", "kernel", COMP, 4, 24, 1, "aten::_flash_attention_forward"),
    ("elementwise_kernel", "kernel", COMP, 25, 30, 2, "aten::add"),
    (GEMM, "kernel", COMP, 46, 61, 45.5, "aten::mm"),
    (NCCL, "kernel", COMM, 58, 78, 57, "c10d::allreduce_"),
    (GEMM, "kernel", COMP, 66, 81, 60, "aten::mm"),
    ("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy", COMP, 90, 92, 89, "aten::copy_"),
]
SLOWER: list[Device] = [
    *BASELINE[:3],
    (GEMM, "kernel", COMP, 46, 71, 45.5, "aten::mm"),
    (NCCL, "kernel", COMM, 68, 88, 67, "c10d::allreduce_"),
    (GEMM, "kernel", COMP, 76, 101, 70, "aten::mm"),
    ("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy", COMP, 110, 112, 109, "aten::copy_"),
]
SESSIONS = {"baseline": (BASELINE, 100.0), "slower": (SLOWER, 120.0)}  # device events, step ms


def _x(cat: str, name: str, tid: int, start_ms: float, dur_ms: float, **args: Any) -> dict:
    pid = 0 if cat in ("kernel", "gpu_memcpy") else PID  # device lane 0, or the host process
    event = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid}
    event |= {"ts": start_ms * MS, "dur": dur_ms * MS}
    return event | ({"args": args} if args else {})


def step_events(step: int, t0: float, devices: list[Device], step_ms: float) -> list[dict]:
    """Host ranges, operators, launches and device events of one step starting at ``t0`` ms."""
    events = [
        _x("user_annotation", f"step{step}", PID, t0, step_ms),
        _x("user_annotation", "generate", PID, t0, 40),
        _x("user_annotation", "update_actor", PID, t0 + 45, step_ms - 45),
    ]
    for corr, (name, cat, stream, start, end, at, op) in enumerate(devices, start=step * 100):
        launch = "cudaMemcpyAsync" if cat == "gpu_memcpy" else "cudaLaunchKernel"
        events.append(_x("cpu_op", op, PID, t0 + at - 0.1, 0.4, **{"External id": corr}))
        events.append(_x("cuda_runtime", launch, PID, t0 + at, 0.2, correlation=corr))
        args = {"device": 0, "stream": stream, "correlation": corr, "External id": corr}
        events.append(_x(cat, name, stream, t0 + start, end - start, **args))
    return sorted(events, key=lambda e: e["ts"])


def kineto_text(header: dict[str, Any], events: list[dict[str, Any]]) -> str:
    """The text torch.profiler writes: one key per line, "args" after a lone comma."""
    out = []
    for e in events:
        lines = [f'    "{k}": {json.dumps(e[k])},' for k in ("ph", "cat", "name", "pid", "tid")]
        lines += [f'    "ts": {e["ts"]:.3f},', f'    "dur": {e["dur"]:.3f}']
        if "args" in e:
            inner = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in e["args"].items())
            lines += ["    ,", '    "args": {', f"      {inner}", "    }"]
        out.append("  {\n" + "\n".join(lines) + "\n  }")
    head = ",\n".join(f'  "{k}": {json.dumps(v)}' for k, v in header.items())
    return "{\n" + head + ',\n  "traceEvents": [\n' + ",\n".join(out) + '\n  ],\n  "x": 0\n}\n'


def write_session(directory: Path, name: str) -> list[Path]:
    """Write session ``name`` (``baseline`` or ``slower``) into ``directory``; its files."""
    devices, step_ms = SESSIONS[name]
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for rank in (0, 1):
        for step in (1, 2):
            t0 = 7000.0 + (step - 1) * 1000.0  # ms after BASE_NS: one step per second
            meta = {"session_id": f"gpu-{name}", "role": "actor", "rank": rank, "pid": PID}
            meta |= {"world_size": 2, "step": step, "scope": "train"}
            header = {
                "schemaVersion": 1,
                "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}],
                "profd": meta,
                "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2},
                "baseTimeNanoseconds": BASE_NS,
            }
            when = datetime(2026, 9, 21, 12, 0, step)
            stem = trace_stem(rank=rank, pid=PID, when=when, prefix="actor", scope="train",
                              step=step, world_size=2)  # fmt: skip
            path = directory / f"{stem}.json.gz"
            text = kineto_text(header, step_events(step, t0, devices, step_ms))
            path.write_bytes(gzip.compress(text.encode(), mtime=0))
            written.append(path)
    return written


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python docs/examples/gpu_session.py OUT_DIR\n")
        return 2
    out = Path(argv[0])
    for name in SESSIONS:
        files = write_session(out / name, name)
        sys.stdout.write(f"{out / name}: {len(files)} traces\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
