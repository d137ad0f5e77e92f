"""Benchmark: ``profd summarize`` with its GPU breakdown against HTA doing the same work, on
the same files, in fresh processes, in alternating rounds.

    python bench/analysis.py [--ranks 8] [--steps 4] [--target-mb 100] [--rounds 3]
                             [--layout classic|2.13] [--gzip] [--keep DIR | --reuse DIR]
                             [--no-sample]

1. Writes a trace set (``gpu_trace_set.py``): one Kineto-layout file per rank, in the text
   Kineto writes before torch 2.13 (``--layout classic``, the default: the torch of most GPU
   jobs, as recorded on an H200 in ``tests/fixtures/cuda``) or in torch 2.13's
   (``--layout 2.13``), ``--target-mb`` MB of JSON in total (``.json``; ``--gzip``: ``.json.gz``),
   with ``ProfilerStep#<n>`` rows, profd stage ranges, kernels on two compute streams, NCCL
   kernels on a communication stream partly overlapping them, memcpy / memset events, their
   ``cuda_runtime`` launches (correlation ids) and flow events. Its figures are known by
   construction (``gpu_trace_set.expected``). ``--reuse DIR`` reads any trace set instead
   (real traces: only the tools' agreement is checked).
2. Alternates, ``--rounds`` times, a fresh process per measurement, imports done before the
   clock starts in both:

   * profd: ``summarize_dir(DIR)``, the default summary, which includes the GPU breakdown per
     track and per stage (``SessionSummary.gpu``; nothing to switch on) besides the step,
     stage and operator tables;
   * HTA 0.5.0: ``TraceAnalysis(trace_dir=DIR, include_last_profiler_step=True)`` (reading:
     parse, align, filter; ``hta_read_s``), then ``get_temporal_breakdown``,
     ``get_gpu_kernel_breakdown`` and ``get_comm_comp_overlap`` (``visualize=False``, other
     arguments HTA's defaults). ``include_last_profiler_step``: profd counts every profiled
     step, so HTA is told to keep the last one too.

   Timing headline: the median of the rounds' wall times (``profd_s``, ``hta_s``,
   ``speedup``); the best round is reported beside it (``*_best_s``, ``speedup_best``), and
   the median CPU time (user + system, workers included: ``profd_cpu_s``, ``hta_cpu_s``,
   ``cpu_ratio``), which other work on the machine disturbs less than the wall time. Both
   tools parse in one process per CPU (HTA: a pool of ``min(ranks, CPUs)``; profd: one
   worker per CPU, at most 8).
3. Checks, and exits non-zero without a RESULT line when one fails: for every rank, idle,
   compute and non-compute time as % of the window and the communication-computation overlap
   % of both tools within 1 percentage point of each other and (generated sets) of the
   figures by construction; each kernel's total time summed over ranks (profd's device
   operator tables against HTA's kernel breakdown) within 1 % of the total kernel time; and
   HTA's ranks equal to the ``distributedInfo`` ranks of the files.

Memory. ``peak_abs_mb``: the absolute peak of the summarising process tree, interpreter
included: the summarising process's own peak resident memory over its whole life
(``VmHWM``: imports and the call), plus, for each worker process, its peak above what it
held when it started (profd's ``worker_memory_mb``: each worker resets ``VmHWM`` through
``/proc/self/clear_refs`` when it starts). The workers are forked from the summarising
process, so the pages they start with are its pages, counted once, in its figure; summing
the workers' peaks assumes they all peaked at once. A worker's copy-on-write copy of a page
it inherited does not raise its resident size (the page was counted already), so one more,
untimed, round per tool samples the proportional set size (``Pss`` of
``/proc/PID/smaps_rollup``: shared pages split among the processes sharing them) of the
whole process tree every 10 ms: ``profd_pss_mb`` / ``hta_pss_mb``, the largest sum seen
(``--no-sample`` skips it). The target is checked on the larger of ``peak_abs_mb`` and
``profd_pss_mb``: at most 2x the raw JSON size. HTA's peaks from the timed rounds:
``hta_self_mb`` (its process) and ``hta_child_mb`` (its largest parsing worker), both
absolute.

Targets: at least 20x faster than HTA, every figure within 1 percentage point, peak at most
2x the raw JSON size. The speed target is judged on the smaller of the median wall-time
ratio and the CPU-time ratio: other work on the machine stretches wall times unevenly (HTA's
run is the longer, so it catches more of it), which can flatter the wall-time ratio.
HTA is installed for this script only, without its declared
dependencies (``tests/hta_install.py``); it is not a dependency of profd.

The last line is ``RESULT hta_work=breakdown layout=... parse=... ranks=... bytes=...
profd_s=... hta_s=... speedup=... (best rounds) profd_cpu_s=... hta_cpu_s=... cpu_ratio=...
rank0_profd_idle_pct=... rank0_hta_idle_pct=... (compute, non-compute, overlap)
max_diff_pp=... peak_abs_mb=... raw_mb=... peak_ratio=... targets=... load=...``
(``load``: the 1-minute load average when it ended; ``load_start`` when it began;
``parse``: how profd read the files, ``fast`` unless a file fell back to the generic parser).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _analysis_report import report

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
LAYOUT = "bench-layout.txt"  # the generator's parameters, beside the traces (not a trace)


# -- measuring (each in a fresh process) -----------------------------------------------------
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(field)


def _cpu_s() -> float:
    """CPU time (user + system) of this process and of its children that have ended."""
    import resource

    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _pct(window: float, idle: float, compute: float, non_compute: float, overlap: float | None):
    return {
        "window_us": window,
        "idle": 100 * idle / window,
        "compute": 100 * compute / window,
        "non_compute": 100 * non_compute / window,
        "overlap": overlap,
    }


def measure_profd(directory: Path) -> dict[str, Any]:
    import resource

    from profd.analysis import summarize_dir

    start_hwm = _status_kb("VmHWM:")  # the interpreter and the imports
    before = _status_kb("VmRSS:")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM so the peak below is this call's
    except OSError:
        pass
    cpu, t = _cpu_s(), time.perf_counter()
    summary = summarize_dir(directory)
    elapsed, cpu = time.perf_counter() - t, _cpu_s() - cpu
    call_hwm = _status_kb("VmHWM:")
    parent_abs = max(start_hwm, call_hwm) / 1024
    workers_mb = summary.processing.worker_memory_mb or 0.0
    rank_of = {t.track: t.rank for t in summary.tracks}
    ranks = {}
    for g in summary.gpu:
        if rank_of.get(g.track) is None:
            continue  # a file with no rank (not a training rank's trace): HTA reads it as 0
        ranks[rank_of[g.track]] = _pct(
            g.window_ms * 1e3,
            g.idle_ms * 1e3,
            g.compute_ms * 1e3,
            g.non_compute_ms * 1e3,
            g.comm_comp_overlap_pct,
        )
    kernels: dict[str, float] = {}
    for group in summary.top_ops:
        if group.device == "gpu":
            for op in group.ops:
                kernels[op.name] = kernels.get(op.name, 0.0) + op.total_ms * 1e3
    return {
        "seconds": elapsed,
        "cpu_s": cpu,
        "parent_abs_mb": parent_abs,
        "parent_growth_mb": max(0, call_hwm - before) / 1024,
        "workers_mb": workers_mb,
        "largest_worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "peak_abs_mb": parent_abs + workers_mb,
        "mode": summary.processing.mode,
        "workers": summary.processing.workers,
        "start_method": summary.processing.start_method,
        "parse": sorted({f.parse for f in summary.files}),
        "ranks": ranks,
        "kernels": kernels,
    }


def measure_hta(directory: Path) -> dict[str, Any]:
    import logging
    import resource
    import warnings

    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    from hta.trace_analysis import TraceAnalysis

    cpu, t = _cpu_s(), time.perf_counter()
    analysis = TraceAnalysis(trace_dir=str(directory), include_last_profiler_step=True)
    loaded = time.perf_counter()
    temporal = analysis.get_temporal_breakdown(visualize=False)
    t_temporal = time.perf_counter()
    _, per_kernel = analysis.get_gpu_kernel_breakdown(visualize=False)
    t_kernels = time.perf_counter()
    overlap = analysis.get_comm_comp_overlap(visualize=False)
    end, cpu = time.perf_counter(), _cpu_s() - cpu
    ranks = {}
    overlap_of = dict(zip(overlap["rank"], overlap["comp_comm_overlap_pctg"], strict=True))
    for row in temporal.to_dict("records"):
        rank = int(row["rank"])
        pct = overlap_of.get(row["rank"])
        ranks[rank] = _pct(
            float(row["kernel_time(us)"]),
            float(row["idle_time(us)"]),
            float(row["compute_time(us)"]),
            float(row["non_compute_time(us)"]),
            None if pct is None or pct != pct else float(pct),  # NaN: no communication
        )
    kernels = per_kernel.groupby("name")["sum (us)"].sum()
    return {
        "seconds": end - t,
        "cpu_s": cpu,
        "read_s": loaded - t,
        "temporal_s": t_temporal - loaded,
        "kernels_s": t_kernels - t_temporal,
        "overlap_s": end - t_kernels,
        "hta_ranks": sorted(int(r) for r in analysis.t.traces),
        "self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "child_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "ranks": ranks,
        "kernels": {str(k): float(v) for k, v in kernels.items()},
    }


def _command(flag: str, directory: Path) -> list[str]:
    return [sys.executable, str(HERE), flag, str(directory)]


def _parse(flag: str, rc: int, out: str, err: str) -> dict[str, Any]:
    if rc != 0:
        raise SystemExit(f"{flag} failed:\n{out[-2000:]}\n{err[-4000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result["ranks"] = {int(k): v for k, v in result["ranks"].items()}
    return result


def _child(flag: str, directory: Path, env: dict[str, str] | None) -> dict[str, Any]:
    proc = subprocess.run(_command(flag, directory), capture_output=True, text=True, env=env)
    return _parse(flag, proc.returncode, proc.stdout, proc.stderr)


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux ``/proc/PID/task/TID/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass  # it just ended
    return out


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def sampled(flag: str, directory: Path, env: dict[str, str] | None) -> tuple[dict, float]:
    """One untimed run whose process tree's summed PSS is sampled every 10 ms; its peak."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(_command(flag, directory), stdout=out, stderr=err, env=env)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, sum(_pss_kb(p) for p in _tree(proc.pid)))
            time.sleep(0.01)
        out.seek(0)
        err.seek(0)
        return _parse(flag, proc.returncode, out.read(), err.read()), peak / 1024


# -- the trace set ------------------------------------------------------------------------------
def prepare(args: argparse.Namespace) -> tuple[Path, Path | None, dict[str, int] | None]:
    """The trace directory, what to delete afterwards, and the generator's layout (None for
    traces the generator did not write)."""
    if args.reuse:
        layout = args.reuse / LAYOUT
        return args.reuse, None, json.loads(layout.read_text()) if layout.exists() else None
    import gpu_trace_set

    directory = args.keep or Path(tempfile.mkdtemp(prefix="profd-bench-"))
    directory.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    layers, files = gpu_trace_set.write_set(
        directory, args.ranks, args.steps, args.target_mb, args.layout
    )
    if args.gzip:
        for f in files:
            with open(f, "rb") as src, gzip.open(f"{f}.gz", "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
            f.unlink()
    layout = {"ranks": args.ranks, "steps": args.steps, "layers": layers, "text": args.layout}
    (directory / LAYOUT).write_text(json.dumps(layout))
    print(
        f"wrote {len(files)} traces ({args.steps} steps x {layers} layers per rank) "
        f"in {time.perf_counter() - t:.1f} s",
        flush=True,
    )
    return directory, None if args.keep else directory, layout


def distributed_ranks(directory: Path) -> list[int]:
    from profd.analysis.jsonscan import TraceStream
    from profd.analysis.sources import discover

    ranks = []
    for path in discover(directory):
        stream = TraceStream(path)
        next(stream.raw_segments(), None)  # reads just the header before the events
        ranks.append(int(stream.quick_header()["distributedInfo"]["rank"]))
    return sorted(ranks)


def rounds(
    directory: Path, n: int, hta_env: dict[str, str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Alternate profd and HTA, each in a fresh process, so both see the same machine load."""
    profd_runs, hta_runs = [], []
    for i in range(n):
        profd_runs.append(_child("--measure-profd", directory, None))
        hta_runs.append(_child("--measure-hta", directory, hta_env))
        p, h = profd_runs[-1], hta_runs[-1]
        print(
            f"round {i + 1}: profd {p['seconds']:.3f} s (CPU {p['cpu_s']:.2f} s, peak "
            f"{p['peak_abs_mb']:.0f} MB), HTA {h['seconds']:.2f} s (CPU {h['cpu_s']:.1f} s; "
            f"read {h['read_s']:.2f}, temporal {h['temporal_s']:.2f}, "
            f"kernels {h['kernels_s']:.2f}, overlap {h['overlap_s']:.2f}), "
            f"load average {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    return profd_runs, hta_runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="ProfilerStep rows per rank.")
    ap.add_argument("--target-mb", type=float, default=100.0, help="JSON in total, all ranks.")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gzip", action="store_true", help="Write .json.gz instead of .json.")
    ap.add_argument(
        "--layout", choices=("classic", "2.13"), default="classic",
        help="The text of the traces: Kineto's classic layout (torch < 2.13) or torch 2.13's.",
    )  # fmt: skip
    ap.add_argument("--keep", type=Path, help="Write the traces into this directory, keep them.")
    ap.add_argument("--reuse", type=Path, help="Skip writing; use the traces in this directory.")
    ap.add_argument("--no-sample", action="store_true", help="Skip the sampled-memory rounds.")
    ap.add_argument(
        "--hta-keep-ns", action="store_true",
        help="Run HTA with HTA_DISABLE_NS_ROUNDING=1 (real traces: see docs/hta-export.md).",
    )  # fmt: skip
    ap.add_argument("--measure-profd", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--measure-hta", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure_profd:
        print(json.dumps(measure_profd(args.measure_profd)))
        return
    if args.measure_hta:
        print(json.dumps(measure_hta(args.measure_hta)))
        return
    run(args)


def run(args: argparse.Namespace) -> None:
    from profd.analysis.jsonscan import json_size_hint
    from profd.analysis.sources import discover

    sys.path.insert(0, str(HERE.parent))  # gpu_trace_set
    sys.path.insert(0, str(REPO / "tests"))  # hta_install
    import hta_install

    load_start = os.getloadavg()[0]
    hta_env = hta_install.hta_env()
    if args.hta_keep_ns:
        hta_env["HTA_DISABLE_NS_ROUNDING"] = "1"
    directory, scratch, layout = prepare(args)
    try:
        files = discover(directory)
        raw = sum(json_size_hint(f) for f in files)
        on_disk = sum(f.stat().st_size for f in files)
        print(f"{len(files)} traces, {raw / 1e6:.1f} MB of JSON ({on_disk / 1e6:.1f} MB on disk)")
        profd_runs, hta_runs = rounds(directory, args.rounds, hta_env)
        pss_p = pss_h = None
        if not args.no_sample:
            _, pss_p = sampled("--measure-profd", directory, None)
            _, pss_h = sampled("--measure-hta", directory, hta_env)
            print(f"sampled PSS peak of the process tree: profd {pss_p:.0f} MB, HTA {pss_h:.0f} MB")
        expected_ranks = distributed_ranks(directory)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    hta_ns = "kept" if args.hta_keep_ns else "rounded"
    report(raw, profd_runs, hta_runs, pss_p, pss_h, expected_ranks, layout, load_start, hta_ns)


if __name__ == "__main__":
    main()
