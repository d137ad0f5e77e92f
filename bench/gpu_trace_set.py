"""Synthetic GPU traces for ``bench/analysis.py``: one Kineto-layout file per rank, in the text
Kineto writes before torch 2.13 (``classic``: an event's keys up to ``tid`` on one line, then
``ts`` and ``dur``) or torch 2.13's (one key per line, ``"args"`` after a lone comma), flow
events beside the launches and kernels, Kineto's span last; GPU figures known by construction.

Every rank runs ``steps`` steps (``ProfilerStep#<n>`` rows on the host thread, one after the
other, as ``prof.step()`` writes them; profd stage ranges ``generate_sequences``,
``compute_log_prob`` and ``update_actor`` inside them) of ``layers`` identical layers each.
A layer of rank ``r`` lasts ``L = 1100 + 20 r`` µs on the GPU; each step ends with
``GAP_US`` µs of GPU idle time (the host preparing the next batch). Device events of one
layer, in µs after the layer's start (every one launched by a ``cuda_runtime`` call with its
correlation id, 40 µs before it starts, inside a ``cpu_op`` parent)::

    event         category    class  stream  runs
    gemm          kernel      comp   7       [  0, 300)
    elementwise   kernel      comp   7       [320, 400)
    attention     kernel      comp   20      [350, 500)    overlaps elementwise on [350, 400)
    all-reduce    kernel      comm   28      [450, C)      C = 750 + 10 r; overlaps attention
                                                           on [450, 500), gemm2 on [600, 700)
    gemm2         kernel      comp   7       [600, 700)
    Memcpy HtoD   gpu_memcpy  mem    7       [840, 880)
    Memset        gpu_memset  mem    7       [900, 910)
    Memcpy DtoH   gpu_memcpy  mem    7       [930, 980)

so, per layer, by hand (:func:`expected`): busy (union over streams) = 300 + (C - 320) + 40 +
10 + 50 = C + 80; compute (union of the comp kernels) = 300 + (500 - 320) + 100 = 580;
communication = C - 450; memory = 100; overlap of communication with computation = 50 + 100 =
150; summed kernel durations: comp 300 + 80 + 150 + 100 = 630, comm C - 450, mem 100. With
``n = steps * layers`` layers, the window (first start to last end) is
``(n - 1) L + (steps - 1) GAP_US + 980``.

Names vary by layer (three GEMMs, two element-wise kernels) so the kernel breakdown has more
than one row per class. Pure standard library plus profd's file naming; deterministic.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from profd.core.naming import trace_stem

__all__ = ["GAP_US", "LAYOUTS", "Expected", "expected", "layer_bytes", "write_rank", "write_set"]

BASE_NS = 1_790_000_000_000_000_000  # baseTimeNanoseconds: ts are µs after it
T0 = 7_000_000  # µs: where the first step starts on every rank
GAP_US = 2000  # GPU idle at the end of each step
HOST = "bench-node"
HOST_PID = 4242
MAIN, SIDE, COMM = 7, 20, 28  # CUDA streams (the device events' tid)
STAGES = ("generate_sequences", "compute_log_prob", "update_actor")

GEMMS = (
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_"
    "segment_k_off_kernel__5x_cublas",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize256x128x64_warpgroupsize2x1x1_execute_"
    "segment_k_off_kernel__5x_cublas",
    "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn",
)
ELEMENTWISE = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>"
    ", std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "std::array<char*, 3ul>)",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::"
    "TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#4}"
    "::operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, at::native::"
    "GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()"
    "() const::{lambda()#4}::operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, "
    "2ul>)",
)
ATTENTION = (
    "void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<128, 128, 64, 4,"
    " false, false, cutlass::bfloat16_t, pytorch_flash::Flash_kernel_traits<128, 128, 64, 4, "
    "cutlass::bfloat16_t> >, false, true, false, false, true, true, false>(pytorch_flash::"
    "Flash_fwd_params)"
)
NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
HTOD = "Memcpy HtoD (Pageable -> Device)"
MEMSET = "Memset (Device)"
DTOH = "Memcpy DtoH (Device -> Pinned)"


def layer_us(rank: int) -> int:
    return 1100 + 20 * rank


def comm_end(rank: int) -> int:
    return 750 + 10 * rank


@dataclass(frozen=True, slots=True)
class Expected:
    """A rank's figures by construction (µs; kernel sums are summed durations per class)."""

    window: float
    idle: float
    compute: float
    non_compute: float
    communication: float
    memory: float
    overlap: float
    kernels: int
    sum_comp: float
    sum_comm: float
    sum_mem: float

    def pct(self) -> dict[str, float]:
        """idle / compute / non-compute as % of the window, overlap as % of communication."""
        return {
            "idle": 100 * self.idle / self.window,
            "compute": 100 * self.compute / self.window,
            "non_compute": 100 * self.non_compute / self.window,
            "overlap": 100 * self.overlap / self.communication,
        }


def expected(rank: int, steps: int, layers: int) -> Expected:
    """The module docstring's arithmetic (independent of both tools)."""
    n = steps * layers
    c = comm_end(rank)
    window = (n - 1) * layer_us(rank) + (steps - 1) * GAP_US + 980
    busy = n * (c + 80)
    return Expected(
        window=window,
        idle=window - busy,
        compute=n * 580,
        non_compute=busy - n * 580,
        communication=n * (c - 450),
        memory=n * 100,
        overlap=n * 150,
        kernels=n * 8,
        sum_comp=n * 630,
        sum_comm=n * (c - 450),
        sum_mem=n * 100,
    )


# -- the text: torch 2.13's layout, or Kineto's classic one ----------------------------------------
class Text213:
    """Event texts as torch 2.13 writes them: one key per line, "args" after a lone comma."""

    name = "2.13"

    def x(self, cat: str, name: str, pid: int, tid: int, ts: int, dur: int, args: str) -> str:
        return (
            f'  {{\n    "ph": "X",\n    "cat": "{cat}",\n    "name": {json.dumps(name)},\n'
            f'    "pid": {pid},\n    "tid": {tid},\n    "ts": {ts}.000,\n    "dur": {dur}.000\n'
            f'    ,\n    "args": {{\n      {args}\n    }}\n  }}'
        )

    def flow(self, ph: str, corr: int, pid: int, tid: int, ts: int) -> str:
        tail = ',\n    "bp": "e"' if ph == "f" else ""
        return (
            f'  {{\n    "ph": "{ph}",\n    "id": {corr},\n    "pid": {pid},\n    "tid": {tid},\n'
            f'    "ts": {ts}.000,\n    "cat": "ac2g",\n    "name": "ac2g"{tail}\n  }}'
        )

    def meta(self, pid: int, tid: int, key: str, value: str) -> str:
        return (
            f'  {{\n    "ph": "M",\n    "name": "{key}",\n    "ts": {T0}.000,\n    "pid": {pid},\n'
            f'    "tid": {tid},\n    "args": {{\n      "name": {json.dumps(value)}\n    }}\n  }}'
        )

    def span(self, ts: int, dur: int) -> str:
        """Kineto's own span over the recording (one per file)."""
        return self.x("Trace", "PyTorch Profiler (0)", '"Spans"', '"PyTorch Profiler"', ts, dur,
                      '"Op count": 0')  # fmt: skip

    def args(self, pairs: list[str]) -> str:
        return ",\n      ".join(pairs)


class TextClassic(Text213):
    """Kineto's classic layout (torch before 2.13: most GPU jobs' torch), as recorded on an
    H200 (tests/fixtures/cuda): ph, cat, name, pid and tid on one line, ts and dur on the
    next; Kineto's span in its own key order."""

    name = "classic"

    def x(self, cat: str, name: str, pid: int, tid: int, ts: int, dur: int, args: str) -> str:
        return (
            f'  {{\n    "ph": "X", "cat": "{cat}", "name": {json.dumps(name)}, "pid": {pid}, '
            f'"tid": {tid},\n    "ts": {ts}.000, "dur": {dur}.000,\n'
            f'    "args": {{\n      {args}\n    }}\n  }}'
        )

    def flow(self, ph: str, corr: int, pid: int, tid: int, ts: int) -> str:
        tail = ', "bp": "e"' if ph == "f" else ""
        return (
            f'  {{\n    "ph": "{ph}", "id": {corr}, "pid": {pid}, "tid": {tid}, "ts": {ts}.000,\n'
            f'    "cat": "ac2g", "name": "ac2g"{tail}\n  }}'
        )

    def meta(self, pid: int, tid: int, key: str, value: str) -> str:
        return (
            f'  {{\n    "name": "{key}", "ph": "M", "ts": {T0}.000, "pid": {pid}, "tid": {tid},\n'
            f'    "args": {{\n      "name": {json.dumps(value)}\n    }}\n  }}'
        )

    def span(self, ts: int, dur: int) -> str:
        return (
            f'  {{\n    "ph": "X", "cat": "Trace", "ts": {ts}.000, "dur": {dur}.000,\n'
            '    "pid": "Spans", "tid": "PyTorch Profiler",\n    "name": "PyTorch Profiler (0)",\n'
            '    "args": {\n      "Op count": 0\n    }\n  }'
        )

    def args(self, pairs: list[str]) -> str:
        return ", ".join(pairs)  # Kineto's own spacing varies; one line either way


LAYOUTS = {t.name: t for t in (Text213(), TextClassic())}


def _kernel_args(text: Text213, ext: int, stream: int, corr: int, grid: int) -> str:
    return text.args([
        f'"External id": {ext}', '"queued": 0', '"device": 0', '"context": 1',
        f'"stream": {stream}', f'"correlation": {corr}', '"registers per thread": 168',
        '"shared memory": 213248', f'"blocks per SM": {grid / 132:.6f}',
        f'"warps per SM": {grid * 12 / 132:.6f}', f'"grid": [{grid}, 1, 1]',
        '"block": [384, 1, 1]', '"est. achieved occupancy %": 19',
    ])  # fmt: skip


def _memory_args(text: Text213, ext: int, corr: int, nbytes: int, dur: int) -> str:
    return text.args([
        f'"External id": {ext}', '"device": 0', '"context": 1', f'"stream": {MAIN}',
        f'"correlation": {corr}', f'"bytes": {nbytes}',
        f'"memory bandwidth (GB/s)": {nbytes / dur / 1000:.6f}',
    ])  # fmt: skip


# one layer: (host op, parent op or "", device name, category, stream, start, end or None: C)
_LAYER = (
    ("aten::addmm", "aten::linear", GEMMS, "kernel", MAIN, 0, 300),
    ("aten::add", "", ELEMENTWISE, "kernel", MAIN, 320, 400),
    ("aten::_flash_attention_forward", "aten::scaled_dot_product_attention", (ATTENTION,),
     "kernel", SIDE, 350, 500),
    ("nccl:all_reduce", "record_param_comms", (NCCL,), "kernel", COMM, 450, None),
    ("aten::mm", "aten::matmul", GEMMS, "kernel", MAIN, 600, 700),
    ("aten::copy_", "aten::to", (HTOD,), "gpu_memcpy", MAIN, 840, 880),
    ("aten::zero_", "", (MEMSET,), "gpu_memset", MAIN, 900, 910),
    ("aten::copy_", "aten::_to_copy", (DTOH,), "gpu_memcpy", MAIN, 930, 980),
)  # fmt: skip
_LAUNCHERS = {
    "kernel": "cudaLaunchKernel",
    "gpu_memcpy": "cudaMemcpyAsync",
    "gpu_memset": "cudaMemsetAsync",
}
_CBID = {"kernel": 211, "gpu_memcpy": 41, "gpu_memset": 51}
LAUNCH_LEAD_US = 40  # a launch starts this long before its device event
# Correlation and External ids count every CUDA call since the process started, so a trace
# taken after a while has large ones. (Small ones also break HTA 0.5 on pandas 3: it
# downcasts the correlation column to int16 and then stores row indices in a copy of it.)
FIRST_ID = 1_000_000


def _layer(
    text: Text213, rank: int, index: int, at: int, corr: int, ext: int
) -> tuple[list, list, int, int]:
    """Host and device event texts (with their ts, for ordering) of one layer at GPU time
    ``at``; the next free correlation and External ids."""
    host, dev = [], []

    def on_host(cat: str, name: str, ts: int, dur: int, args: str) -> None:
        host.append((ts, text.x(cat, name, HOST_PID, HOST_PID, ts, dur, args)))

    for op, parent, names, cat, stream, start, end in _LAYER:
        end = comm_end(rank) if end is None else end
        name = names[index % len(names)]
        launch = at + start - LAUNCH_LEAD_US
        op_args = f'"External id": {ext},"Record function id": 0, "Ev Idx": {ext}'
        if parent:
            on_host("cpu_op", parent, launch - 10, 22, op_args)
        on_host("cpu_op", op, launch - 6, 15, op_args)
        run_args = f'"External id": {ext}, "cbid": {_CBID[cat]}, "correlation": {corr}'
        on_host("cuda_runtime", _LAUNCHERS[cat], launch, 5, run_args)
        host.append((launch, text.flow("s", corr, HOST_PID, HOST_PID, launch)))
        ts, dur = at + start, end - start
        if cat == "kernel":
            args = _kernel_args(text, ext, stream, corr, 132 * (1 + index % 4))
        else:
            args = _memory_args(text, ext, corr, 1 << 20, dur)
        dev.append((ts, text.x(cat, name, 0, stream, ts, dur, args)))
        dev.append((ts, text.flow("f", corr, 0, stream, ts)))
        corr, ext = corr + 1, ext + 1
    return host, dev, corr, ext


def _header(rank: int, world: int) -> str:
    device = {"id": 0, "name": "NVIDIA H200", "totalGlobalMem": 150_754_820_096}
    device |= {"computeMajor": 9, "computeMinor": 0, "numSms": 132, "warpSize": 32}
    dist = {"backend": "nccl", "rank": rank, "world_size": world, "pg_count": 1}
    profd = {"session_id": "s-bench-gpu", "role": "actor", "rank": rank, "world_size": world}
    profd |= {"topology": {"dp": rank}, "scope": "train", "step": None, "hostname": HOST}
    head = {
        "schemaVersion": 1,
        "deviceProperties": [device],
        "distributedInfo": dist,
        "profd": profd | {"pid": HOST_PID},
        "trace_id": f"BENCH{rank:027d}",
        "host_name": HOST,
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": BASE_NS,
    }
    return "{\n" + "".join(f'  "{k}": {json.dumps(v)},\n' for k, v in head.items())


def _events(text: Text213, rank: int, steps: int, layers: int) -> Iterator[str]:
    """Every event's text: metadata, the host thread's events, the device's (the order
    Kineto writes them: CPU activity first, then the GPU buffers), then Kineto's span."""
    yield text.meta(HOST_PID, 0, "process_name", "python")
    yield text.meta(HOST_PID, HOST_PID, "thread_name", f"thread {HOST_PID} (python)")
    yield text.meta(0, 0, "process_name", "python")
    for stream in (MAIN, SIDE, COMM):
        yield text.meta(0, stream, "thread_name", f"stream {stream}")
    length = layer_us(rank)
    step_us = layers * length + GAP_US
    corr, ext = FIRST_ID, FIRST_ID  # ids of a process that ran a while (HTA: see FIRST_ID)
    host: list[tuple[int, str]] = []
    dev: list[tuple[int, str]] = []
    for s in range(steps):
        start = T0 + s * step_us
        step_args = f'"External id": {ext}'
        step_row = text.x("user_annotation", f"ProfilerStep#{s}", HOST_PID, HOST_PID,
                          start - 100, step_us, step_args)  # fmt: skip
        host.append((start - 100, step_row))
        third = layers // 3
        cuts = [start - 90, start + third * length - 100, start + 2 * third * length - 100]
        ends = [*cuts[1:], start + layers * length - 100 + GAP_US // 2]
        for name, a, b in zip(STAGES, cuts, ends, strict=True):
            row = text.x("user_annotation", name, HOST_PID, HOST_PID, a, b - a, step_args)
            host.append((a, row))
        for i in range(layers):
            h, d, corr, ext = _layer(text, rank, i, start + i * length, corr, ext)
            host += h
            dev += d
    host.sort(key=lambda e: e[0])
    dev.sort(key=lambda e: e[0])
    yield from (event for _, event in host)
    yield from (event for _, event in dev)
    yield text.span(T0 - 200, steps * step_us + 1000)


def write_rank(
    path: Path, rank: int, world: int, steps: int, layers: int, text: Text213 = LAYOUTS["2.13"]
) -> int:
    """Write one rank's file; its size in bytes."""
    with open(path, "w") as f:
        f.write(_header(rank, world) + '  "traceEvents": [\n')
        f.write(",\n".join(_events(text, rank, steps, layers)))
        f.write(f'\n  ],"traceName": "{path.name}" }}')
    return path.stat().st_size


def layer_bytes(text: Text213 = LAYOUTS["2.13"]) -> float:
    """Bytes of text per layer (a probe of 30 layers, the header left out)."""
    return len(",\n".join(_events(text, 0, 1, 30))) / 30


def write_set(
    out: Path, ranks: int, steps: int, target_mb: float, layout: str = "2.13"
) -> tuple[int, list[Path]]:
    """``ranks`` files of about ``target_mb`` MB in total, in ``layout`` (a key of
    :data:`LAYOUTS`); (layers per step, the files)."""
    text = LAYOUTS[layout]
    layers = max(3, round(target_mb * 1e6 / ranks / steps / layer_bytes(text)))
    when = datetime(2026, 12, 1, 12, 0, 0)
    files = []
    for r in range(ranks):
        stem = trace_stem(
            prefix="actor", scope="train", rank=r, world_size=ranks, topology={"dp": r},
            pid=HOST_PID, when=when,
        )  # fmt: skip
        path = out / f"{stem}.json"
        write_rank(path, r, ranks, steps, layers, text)
        files.append(path)
    return layers, files
