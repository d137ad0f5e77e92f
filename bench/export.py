"""Training-thread stall when a ~100 MB torch.profiler window ends: profd vs torch's export.

Two variants record the same CPU workload (same op count) and end the window:

* ``torch_json``: ``prof.stop()`` then torch's own ``export_chrome_trace("x.json")`` (plain
  JSON, the cheapest export torch has), both on the training thread;
* ``profd``: profd's torch collection ``close()`` (stops the profiler) and the hand-off to
  profd's exporter thread, which then runs Kineto's JSON export, gzip (level 6) and
  publishing while the training thread goes on.

Measured per run, on the training thread:

* ``stall``: from the end of the window until the training thread may continue;
* ``delay``: how much longer the training work right after the window takes than the same
  work before it (chunks of CPU-bound torch ops, run until the export is over). Kineto's export
  holds the GIL, so a CPU-bound loop waits for it either way; a GPU loop waiting on its device
  (GIL released) would not.

The variants run interleaved, each run in a fresh process (earlier windows' memory cannot
slow a later one), in an order that rotates from round to round. Medians over the rounds and
their spread are reported; ``stall_ratio`` is the median of the per-round profd/torch ratios.
Size: profd's file vs a gzip of torch's JSON at profd's level (6); torch's own ``.json.gz``
(level 9, about 9 s per 100 MB) is computed once, off the clock.

Targets: stall ≤ 0.3x torch's plain-JSON export, file ≤ 1.15x torch's gzip.

    python bench/export.py [--iters 40000] [--rounds 5]     # --iters 4000: a 10 MB window
    python bench/export.py --device cuda [--iters ...]      # on a GPU: CUDA activity too

Last line: ``RESULT device=... mb=... stall_ratio=... size_ratio=... busy_ratio=... stall_s=...
torch_json_s=... load=...`` (``mb``: torch's JSON of the window; ``busy_ratio``: stall +
delay, profd over torch; ``load``: 1-minute load average at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from profd.agent.export import Exporter, ExportJob
from profd.backends.base import CollectionSpec
from profd.backends.torch_backend import TorchBackend
from profd.core.files import gzip_file

VARIANTS = ("torch_json", "profd")
CHUNK_ITERS = 2000  # one chunk of follow-up work: a few tens of ms


def workload(iters: int, device: str = "cpu") -> None:
    x = torch.ones(4, device=device)
    for _ in range(iters):
        x = x.add(1).mul(1)
    if device == "cuda":  # a step ends with its device work done
        torch.cuda.synchronize()


def chunk_baseline() -> float:
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        workload(CHUNK_ITERS)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def follow_up(done: threading.Event, baseline: float) -> float:
    """Run chunks until ``done`` is set; the time beyond what they cost before the window."""
    t0, chunks = time.perf_counter(), 0
    while True:
        workload(CHUNK_ITERS)
        chunks += 1
        if done.is_set():
            return max(0.0, time.perf_counter() - t0 - chunks * baseline)


def run_torch_json(iters: int, out_dir: Path, level9: bool, device: str) -> dict[str, float]:
    baseline = chunk_baseline()
    path = out_dir / "t.json"
    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    prof.start()
    workload(iters, device)
    t0 = time.perf_counter()
    prof.stop()
    t1 = time.perf_counter()
    prof.export_chrome_trace(str(path))
    stall = time.perf_counter() - t0
    finished = threading.Event()
    finished.set()
    delay = follow_up(finished, baseline)
    gz6 = out_dir / "t6.json.gz"
    gzip_file(path, gz6, level=6)
    result = {"stall": stall, "stop": t1 - t0, "delay": delay, "background": 0.0}
    result.update(json_bytes=path.stat().st_size, gz6_bytes=gz6.stat().st_size)
    if level9:
        gzip_file(path, out_dir / "t9.json.gz", level=9)
        result["gz9_bytes"] = (out_dir / "t9.json.gz").stat().st_size
    return result


def run_profd(iters: int, out_dir: Path, device: str) -> dict[str, float]:
    baseline = chunk_baseline()
    done = threading.Event()
    written: list[Path] = []
    errors: list[str] = []

    def on_done(job, files, error) -> None:
        if error:
            errors.append(error)
        written.extend(f.path for f in files)
        done.set()

    exporter = Exporter(on_done)
    spec = CollectionSpec(out_dir, "actor_train_step1_rank0_pid1_20260101000000000", {})
    coll = TorchBackend({"contents": ["cpu", device] if device == "cuda" else ["cpu"]}).open(spec)
    workload(iters, device)
    t0 = time.perf_counter()
    outputs = coll.close()
    t1 = time.perf_counter()
    for out in outputs:
        exporter.submit(ExportJob("bench", (1,), "train", "torch", out))
    stall = time.perf_counter() - t0
    delay = follow_up(done, baseline)
    done.wait()
    background = time.perf_counter() - t0
    if errors:
        raise RuntimeError(errors[0])
    return {
        "stall": stall,
        "stop": t1 - t0,
        "delay": delay,
        "background": background,
        "bytes": written[0].stat().st_size,
    }


def run_one(variant: str, iters: int, out_dir: Path, level9: bool, device: str) -> dict[str, float]:
    torch.set_num_threads(1)
    workload(100, device)  # warm up kineto and the allocator (and CUDA)
    if variant == "profd":
        return run_profd(iters, out_dir, device)
    return run_torch_json(iters, out_dir, level9, device)


def measure(variant: str, iters: int, level9: bool, device: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--one", variant, "--iters", str(iters), "--dir", tmp]
        cmd += ["--device", device]
        if level9:
            cmd.append("--level9")
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])


def run_rounds(iters: int, rounds: int, device: str) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            runs[variant].append(measure(variant, iters, level9=(r == 0), device=device))
            print(f"round {r + 1}/{rounds} {variant}: " + json.dumps(runs[variant][-1]))
    return runs


def med(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def span(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def report(runs: dict[str, list[dict[str, float]]], iters: int, device: str) -> None:
    t, p = runs["torch_json"], runs["profd"]
    stall_r = [a["stall"] / b["stall"] for a, b in zip(p, t, strict=True)]
    busy_r = [
        (a["stall"] + a["delay"]) / (b["stall"] + b["delay"]) for a, b in zip(p, t, strict=True)
    ]
    size_r = [a["bytes"] / b["gz6_bytes"] for a, b in zip(p, t, strict=True)]
    stall_ratio, busy_ratio = statistics.median(stall_r), statistics.median(busy_r)
    size_ratio = statistics.median(size_r)
    gz9 = next(r["gz9_bytes"] for r in t if "gz9_bytes" in r)
    print(
        f"window: {med(t, 'json_bytes') / 1e6:.0f} MB of JSON ({iters} iterations); "
        f"{len(t)} interleaved rounds, a fresh process per run; median (min-max)"
    )
    for name, rows in (("torch_json", t), ("profd", p)):
        for key in ("stall", "stop", "delay", "background"):
            values = [r[key] for r in rows]
            print(f"{name:>10} {key:>10}: {statistics.median(values):7.3f} s  ({span(values)})")
    print(f"stall ratio profd/torch: {stall_ratio:.2f} ({span(stall_r)}; target <= 0.3x)")
    print(f"stall + delay ratio (CPU-bound loop): {busy_ratio:.2f} ({span(busy_r)})")
    print(f"profd file / gzip-6 of torch's JSON: {size_ratio:.3f}x (target <= 1.15x)")
    print(f"profd file / torch's own .json.gz (level 9): {med(p, 'bytes') / gz9:.3f}x")
    load = os.getloadavg()
    print("load average (1/5/15 min) at the end: " + "/".join(f"{x:.2f}" for x in load))
    print(
        f"RESULT device={device} mb={med(t, 'json_bytes') / 1e6:.0f} "
        f"stall_ratio={stall_ratio:.3f} size_ratio={size_ratio:.3f} "
        f"busy_ratio={busy_ratio:.3f} stall_s={med(p, 'stall'):.3f} "
        f"torch_json_s={med(t, 'stall'):.3f} load={load[0]:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=40_000, help="add+mul pairs (≈ 2.6 KB/pair)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--one", choices=VARIANTS)
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--level9", action="store_true")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cuda: the ops run on the GPU and the window records CUDA activity too",
    )  # fmt: skip
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.iters, args.dir, args.level9, args.device)))
        return
    report(run_rounds(args.iters, args.rounds, args.device), args.iters, args.device)


if __name__ == "__main__":
    main()
