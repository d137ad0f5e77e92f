"""Benchmark: ``profd summarize`` against HTA's ``TraceAnalysis`` load, same files, same run.

    python bench/analysis.py [--ranks 8] [--target-mb 100] [--rounds 3] [--keep DIR | --reuse DIR]

1. Records a trace set with profd: ``--ranks`` real ``ProfilerAgent`` s (in-process
   coordinator, CPU loop with generate / compute_log_prob / update_actor stages and
   mini-/micro-batches), one profiled step each, sized to about ``--target-mb`` MB of JSON
   in total (a probe window calibrates the loop length). Written by profd: ``.json.gz`` files.
2. Alternates, ``--rounds`` times, a fresh process running ``summarize_dir`` on the directory
   and a fresh process running ``hta.trace_analysis.TraceAnalysis(trace_dir=...)`` on the same
   directory. Imports are done before the clock starts in both. The best round of each is
   reported.
3. Checks that HTA read each file's rank from ``distributedInfo`` (its rank set equals the
   ranks written inside the traces).

Memory (profd_peak_mb, the largest over rounds): the summarising process's peak resident
memory above what it held before the call (``VmHWM`` after resetting it through
``/proc/self/clear_refs``, minus ``VmRSS`` before), plus, for each worker process, its peak
resident memory above what it held when it started (the same reset, done by profd in each
worker). Summing the workers' peaks assumes they all peaked at once: an upper bound. Target:
at most 2x the raw JSON size.

HTA is installed for this script only, without its declared dependencies (see
``../shared/reference/environment.md``); it is not a dependency of profd.

The last line is ``RESULT bytes=... profd_s=... hta_s=... speedup=... profd_peak_mb=...``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROLE = "actor_rollout_ref"


# -- recording ------------------------------------------------------------------------------
def _wait(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def rl_step(agent: Any, model: Any, n: int, inner: int) -> None:
    """One RL-shaped training step: generation, log-probs, an update loop of mini-batches."""
    import torch

    with agent.step(n):
        with agent.stage("generate_sequences"), torch.no_grad():
            for _ in range(inner // 2):
                model(torch.randn(8, 16))
        with agent.stage("compute_log_prob"), torch.no_grad():
            for _ in range(inner // 2):
                model(torch.randn(8, 16))
        with agent.stage("update_actor", update_loop=True):
            for i in range(2):
                with agent.mini_batch(i):
                    for j in range(2):
                        with agent.micro_batch(j):
                            for _ in range(max(1, inner // 8)):
                                model(torch.randn(4, 16)).sum().backward()


def profile_window(owner: Any, agents: list[Any], model: Any, step: int, inner: int) -> list[Path]:
    """Profile ``step`` on ``agents`` (one after the other: one profiler per process)."""
    roles = {"actor": {"ranks": [a.info.rank for a in agents]}}
    view = owner.call("create_session", {"steps": [step], "roles": roles})
    for a in agents:
        _wait(lambda a=a: any(w.session_id == view.session_id for w in a.plan.windows), 30, "plan")
    for n in (step, step + 1):
        for a in agents:
            rl_step(a, model, n, inner)

    def written() -> Any:
        v = owner.call("get_session", view.session_id)
        busy = any(t.state in ("armed", "recording", "collecting") for t in v.targets)
        return v if v.state.is_terminal and not busy else None

    return [Path(t.path) for t in _wait(written, 300, "traces written").traces]


def record(out: Path, ranks: int, target_mb: float) -> None:
    """Record one profiled step per rank with real profd agents (runs in its own process)."""
    import torch

    from profd.actors.coordinator import ProfileCoordinator
    from profd.agent import ProfilerAgent
    from profd.analysis.jsonscan import json_size_hint
    from profd.core.settings import CoordinatorSettings
    from profd.testing.coordinator import InProcessCoordinator

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    settings = CoordinatorSettings(
        save_root=str(out / "profile"), base_dir=str(out), poll_timeout_s=1.0, tick_s=0.2
    )
    owner = InProcessCoordinator(ProfileCoordinator(settings))
    agents = [
        ProfilerAgent(ROLE, r, ranks, {"tp": r % 2, "dp": r // 2}, find_link=owner.link).start()
        for r in range(ranks)
    ]
    _wait(lambda: all(a.connected for a in agents), 30, "agents registered")
    for a in agents:
        rl_step(a, model, 0, 4)
    probe_inner = 40  # a probe window calibrates bytes per loop iteration
    (probe,) = profile_window(owner, agents[:1], model, 1, probe_inner)
    per_inner = json_size_hint(probe) / probe_inner
    probe.unlink()
    inner = max(8, int(target_mb * 1e6 / ranks / per_inner))
    files = profile_window(owner, agents, model, 3, inner)
    for a in agents:
        a.close()
    owner.close()
    for f in files:
        shutil.move(str(f), out / f.name)
    print(f"recorded {len(files)} traces, loop length {inner}", flush=True)


# -- measuring (each in a fresh process) -----------------------------------------------------
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(field)


def measure_profd(directory: Path) -> dict[str, Any]:
    from profd.analysis.summary import summarize_dir

    before = _status_kb("VmRSS:")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM so the peak below is this call's
    except OSError:
        pass
    t = time.perf_counter()
    summary = summarize_dir(directory)
    elapsed = time.perf_counter() - t
    parent_mb = max(0, _status_kb("VmHWM:") - before) / 1024
    workers_mb = summary.processing.worker_memory_mb or 0.0
    return {
        "seconds": elapsed,
        "parent_mb": parent_mb,
        "workers_mb": workers_mb,
        "peak_mb": parent_mb + workers_mb,
        "mode": summary.processing.mode,
        "workers": summary.processing.workers,
        "start_method": summary.processing.start_method,
        "tracks": len(summary.tracks),
        "parse": sorted({f.parse for f in summary.files}),
    }


def measure_hta(directory: Path) -> dict[str, Any]:
    import logging
    import resource

    logging.disable(logging.WARNING)
    from hta.trace_analysis import TraceAnalysis

    t = time.perf_counter()
    analysis = TraceAnalysis(trace_dir=str(directory))
    elapsed = time.perf_counter() - t
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {
        "seconds": elapsed,
        "ranks": sorted(int(r) for r in analysis.t.traces),
        "self_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "largest_child_peak_mb": children,
    }


def _child(flag: str, directory: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(HERE), flag, str(directory)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"{flag} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def distributed_ranks(directory: Path) -> list[int]:
    from profd.analysis.jsonscan import TraceStream
    from profd.analysis.sources import discover

    ranks = []
    for path in discover(directory):
        stream = TraceStream(path)
        next(stream.raw_segments(), None)  # reads just the header before the events
        ranks.append(int(stream.quick_header()["distributedInfo"]["rank"]))
    return sorted(ranks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--target-mb", type=float, default=100.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="Record into this directory and keep it.")
    ap.add_argument("--reuse", type=Path, help="Skip recording; use the traces in this directory.")
    ap.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--measure-profd", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--measure-hta", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.record:
        record(args.record, args.ranks, args.target_mb)
        return
    if args.measure_profd:
        print(json.dumps(measure_profd(args.measure_profd)))
        return
    if args.measure_hta:
        print(json.dumps(measure_hta(args.measure_hta)))
        return
    run(args)


def prepare(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """The trace directory, and what to delete afterwards."""
    if args.reuse:
        return args.reuse, None
    directory = args.keep or Path(tempfile.mkdtemp(prefix="profd-bench-"))
    directory.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    rec = [
        sys.executable,
        str(HERE),
        "--record",
        str(directory),
        "--ranks",
        str(args.ranks),
        "--target-mb",
        str(args.target_mb),
    ]
    subprocess.run(rec, check=True, stderr=subprocess.DEVNULL)
    print(f"recording took {time.perf_counter() - t:.1f} s", flush=True)
    return directory, None if args.keep else directory


def rounds(directory: Path, n: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Alternate profd and HTA, each in a fresh process, so both see the same machine load."""
    profd_runs, hta_runs = [], []
    for i in range(n):
        profd_runs.append(_child("--measure-profd", directory))
        hta_runs.append(_child("--measure-hta", directory))
        print(
            f"round {i + 1}: profd {profd_runs[-1]['seconds']:.3f} s "
            f"(peak {profd_runs[-1]['peak_mb']:.1f} MB), HTA {hta_runs[-1]['seconds']:.3f} s",
            flush=True,
        )
    return profd_runs, hta_runs


def run(args: argparse.Namespace) -> None:
    from profd.analysis.jsonscan import json_size_hint
    from profd.analysis.sources import discover

    directory, scratch = prepare(args)
    try:
        files = discover(directory)
        raw = sum(json_size_hint(f) for f in files)
        on_disk = sum(f.stat().st_size for f in files)
        print(f"{len(files)} traces, {raw / 1e6:.1f} MB of JSON ({on_disk / 1e6:.1f} MB gzip)")
        profd_runs, hta_runs = rounds(directory, args.rounds)
        expected = distributed_ranks(directory)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    best_p = min(profd_runs, key=lambda r: r["seconds"])
    best_h = min(hta_runs, key=lambda r: r["seconds"])
    peak = max(r["peak_mb"] for r in profd_runs)
    speedup = best_h["seconds"] / best_p["seconds"]
    ranks_ok = all(r["ranks"] == expected for r in hta_runs)
    print(
        f"profd: {best_p['mode']} x{best_p['workers']} ({best_p['start_method']}), parse "
        f"{best_p['parse']}; memory: summarising process +{best_p['parent_mb']:.1f} MB, "
        f"workers +{best_p['workers_mb']:.1f} MB"
    )
    print(
        f"HTA: peak {best_h['self_peak_mb']:.0f} MB in its process, "
        f"{best_h['largest_child_peak_mb']:.0f} MB in its largest worker"
    )
    print(
        f"HTA ranks {hta_runs[0]['ranks']} vs distributedInfo ranks {expected}: "
        f"{'match' if ranks_ok else 'MISMATCH'}"
    )
    limit = 2 * raw / 1e6
    print(
        f"targets: speedup {speedup:.1f} >= 10 {'ok' if speedup >= 10 else 'MISSED'}; "
        f"peak {peak:.1f} MB <= {limit:.0f} MB {'ok' if peak <= limit else 'MISSED'}"
    )
    print(
        f"RESULT bytes={raw} profd_s={best_p['seconds']:.3f} hta_s={best_h['seconds']:.3f} "
        f"speedup={speedup:.1f} profd_peak_mb={peak:.1f}",
        flush=True,
    )
    if not ranks_ok:
        sys.exit("HTA did not read the ranks written in distributedInfo")


if __name__ == "__main__":
    main()
