"""Hand-computable GPU traces in torch 2.13's Kineto layout, shared by the GPU breakdown tests
(``analysis/test_gpu_breakdown.py``, where every figure is worked out by hand) and the HTA
export tests (``analysis/test_hta_export.py``, which run HTA on the same traces).

Timeline of one step (ms after the file's ts origin): host thread ``step<n>`` [0, 100],
stages ``generate`` [0, 40] and ``update`` [50, 100]; the device events are :data:`GPU_EVENTS`
(see ``test_gpu_breakdown.py``'s docstring for the table and the figures).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "BASE_NS",
    "CPU_PID",
    "CPU_TID",
    "GPU_EVENTS",
    "HOST",
    "MS",
    "NCCL",
    "T0",
    "classic_event",
    "classic_head",
    "classic_span",
    "cpu_only_events",
    "device",
    "gpu_events",
    "header",
    "kineto_text",
    "launch",
    "shifted",
    "x",
]

MS = 1000.0  # µs
T0 = 7_000_000.0  # µs: the files' ts origin (Kineto ts are relative to baseTimeNanoseconds)
BASE_NS = 1_790_000_000_000_000_000
HOST = "h<1>"  # markup in the host name: the HTML must escape it
CPU_PID, CPU_TID = 4242, 4242
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"

Event = tuple[str, str, int, float, float, int | None, float | None]


def x(cat: str, name: str, pid: int, tid: int, start_ms: float, dur_ms: float, **args: Any):
    """One complete ('X') event; ``args`` in the order given."""
    e = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid}
    e |= {"ts": T0 + start_ms * MS, "dur": dur_ms * MS}
    return e | ({"args": args} if args else {})


def kineto_text(header: dict[str, Any], events: list[dict[str, Any]], layout: str = "2.13") -> str:
    """The text torch.profiler writes. ``"2.13"``: one key per line, "args" after a lone comma;
    ``"classic"``: Kineto's layout before torch 2.13 (:func:`classic_event`), ending with
    Kineto's own span, as in the trace recorded on an H200 (``tests/fixtures/cuda``)."""
    if layout == "classic":
        out = [classic_event(e) for e in events]
        first = min((e["ts"] for e in events), default=T0)
        last = max((e["ts"] + e["dur"] for e in events), default=T0)
        out.append(classic_span(first, last - first))
    else:
        out = [_event_213(e) for e in events]
    head = ",\n".join(f'  "{k}": {json.dumps(v)}' for k, v in header.items())
    return "{\n" + head + ',\n  "traceEvents": [\n' + ",\n".join(out) + '\n  ],\n  "x": 0\n}\n'


def _event_213(e: dict[str, Any]) -> str:
    lines = [f'    "{k}": {json.dumps(e[k])},' for k in ("ph", "cat", "name", "pid", "tid")]
    lines += [f'    "ts": {e["ts"]:.3f},', f'    "dur": {e["dur"]:.3f}']
    if "args" in e:
        inner = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in e["args"].items())
        lines += ["    ,", '    "args": {', f"      {inner}", "    }"]
    return "  {\n" + "\n".join(lines) + "\n  }"


def classic_head(e: dict[str, Any]) -> str:
    """An X event's first two lines in Kineto's classic layout (names unescaped, as Kineto
    writes them)."""
    head = ", ".join(
        f"{json.dumps(k)}: {json.dumps(e[k], ensure_ascii=False)}"
        for k in ("ph", "cat", "name", "pid", "tid")
    )
    return f'    {head},\n    "ts": {e["ts"]:.3f}, "dur": {e["dur"]:.3f}'


def classic_event(e: dict[str, Any]) -> str:
    args = e.get("args", {})
    inner = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in args.items())
    return "  {\n" + classic_head(e) + ',\n    "args": {\n      ' + inner + "\n    }\n  }"


def classic_span(ts: float, dur: float) -> str:
    """Kineto's span of the whole recording, in its own key order (classic layout)."""
    return (
        f'  {{\n    "ph": "X", "cat": "Trace", "ts": {ts:.3f}, "dur": {dur:.3f},\n'
        '    "pid": "Spans", "tid": "PyTorch Profiler",\n    "name": "PyTorch Profiler (0)",\n'
        '    "args": {\n      "Op count": 0\n    }\n  }'
    )


def launch(at_ms: float, corr: int) -> dict[str, Any]:
    return x(
        "cuda_runtime", "cudaLaunchKernel", CPU_PID, CPU_TID, at_ms, 0.5,
        **{"External id": corr + 500, "cbid": 211, "correlation": corr},
    )  # fmt: skip


def device(
    name: str, stream: int, start: float, end: float, corr: int | None, cat: str = "kernel"
) -> dict[str, Any]:
    args: dict[str, Any] = {"External id": 9, "queued": 0, "device": 0, "context": 1}
    args["stream"] = stream
    if corr is not None:
        args["correlation"] = corr
    args |= {"registers per thread": 32, "grid": [8, 1, 1], "block": [128, 1, 1]}
    return x(cat, name, 0, stream, start, end - start, **args)


# (name, category, stream, start, end, correlation, launched at); None: no launch event
GPU_EVENTS: list[Event] = [
    ("gemm_a", "kernel", 7, 5, 15, 1, 2),
    ("gemm_side", "kernel", 20, 10, 18, 7, 3),
    ("gemm_b", "kernel", 7, 20, 30, 2, 18),
    ("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 7, 32, 34, None, None),
    ("gemm_c", "kernel", 7, 45, 60, 4, 38),
    (NCCL, "kernel", 20, 55, 70, 5, 52),
    ("add_kernel", "kernel", 7, 62, 64, 6, 45),
    ("Memset (Device)", "gpu_memset", 7, 72, 73, 10, 71),
    ("relu_kernel", "kernel", 7, 80, 90, 999, None),
    ("late_kernel", "kernel", 7, 106, 108, 8, 105),
]


def shifted(events: list[dict[str, Any]], ms: float) -> list[dict[str, Any]]:
    return [e | {"ts": e["ts"] + ms * MS} for e in events]


def gpu_events(
    step: int, device_events: list[Event] | None = None, corr_offset: int = 0
) -> list[dict[str, Any]]:
    """Host ranges, a few operators, the launches and the device events of one step
    (:data:`GPU_EVENTS` unless ``device_events``; correlation ids plus ``corr_offset``)."""
    events = [
        x("user_annotation", f"step{step}", CPU_PID, CPU_TID, 0, 100),
        x("user_annotation", "generate", CPU_PID, CPU_TID, 0, 40),
        x("cpu_op", "aten::mm", CPU_PID, CPU_TID, 1, 3, **{"External id": 1}),
        x("user_annotation", "update", CPU_PID, CPU_TID, 50, 50),
        x("cpu_op", "aten::add", CPU_PID, CPU_TID, 51, 2, **{"External id": 2}),
    ]
    for name, cat, stream, start, end, corr, at in device_events or GPU_EVENTS:
        corr = None if corr is None else corr + corr_offset
        if at is not None and corr is not None:
            events.append(launch(at, corr))
        events.append(device(name, stream, start, end, corr, cat))
    return sorted(events, key=lambda e: e["ts"])


def header(
    rank: int, step: int, *, role: str = "actor", world_size: int = 2, session: str = "s-gpu"
) -> dict[str, Any]:
    meta = {"role": role, "rank": rank, "world_size": world_size, "step": step, "scope": "train"}
    return {
        "schemaVersion": 1,
        "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}],
        "profd": meta | {"session_id": session, "pid": CPU_PID},
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world_size},
        "baseTimeNanoseconds": BASE_NS,
        "host_name": HOST,
    }


def cpu_only_events(step: int) -> list[dict[str, Any]]:
    return [
        x("user_annotation", f"step{step}", 77, 77, 0, 100),
        x("user_annotation", "generate", 77, 77, 0, 40),
        x("cpu_op", "aten::mm", 77, 77, 1, 30, **{"External id": 1}),
        x("user_annotation", "update", 77, 77, 50, 50),
    ]
