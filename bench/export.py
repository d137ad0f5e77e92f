"""Training-thread stall when a ~100 MB torch.profiler window ends: profd vs torch's export.

The same CPU workload is recorded three times (same op count), and the time the training
thread is blocked from the end of the window until it may continue is measured:

* ``torch_gz``   – ``prof.stop()`` then torch's own ``export_chrome_trace("x.json.gz")``;
* ``torch_json`` – ``prof.stop()`` then ``export_chrome_trace("x.json")`` (plain JSON);
* ``profd``      – profd's torch collection: ``close()`` (stops the profiler and writes plain
  JSON, since Kineto's export must not overlap the next window's start) and hand-off; gzip,
  the device-event check and publishing run on profd's exporter thread (timed separately).

Targets: profd stall ≤ 1.2x the plain-JSON stall; profd's file ≤ 1.15x torch's .json.gz.

    python bench/export.py [--iters 40000]

Last line: ``RESULT stall_s=... torch_gz_s=... torch_json_s=... ratio_vs_json=... size_ratio=...``
"""

from __future__ import annotations

import argparse
import json
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


def workload(iters: int) -> None:
    x = torch.ones(4)
    for _ in range(iters):
        x = x.add(1).mul(1)


def torch_stall(iters: int, path: Path) -> float:
    prof = profile(activities=[ProfilerActivity.CPU])
    prof.start()
    workload(iters)
    t0 = time.perf_counter()
    prof.stop()
    prof.export_chrome_trace(str(path))
    return time.perf_counter() - t0


def profd_stall(iters: int, out_dir: Path) -> tuple[float, float, Path]:
    done = threading.Event()
    written: list[Path] = []

    def on_done(job, files, error) -> None:
        if error:
            raise RuntimeError(error)
        written.extend(f.path for f in files)
        done.set()

    exporter = Exporter(on_done)
    spec = CollectionSpec(out_dir, "actor_train_step1_rank0_pid1_20260101000000000", {})
    coll = TorchBackend({"contents": ["cpu"]}).open(spec)
    workload(iters)
    t0 = time.perf_counter()
    outputs = coll.close()
    for out in outputs:
        exporter.submit(ExportJob("bench", (1,), "train", "torch", out))
    stall = time.perf_counter() - t0
    done.wait()
    background = time.perf_counter() - t0
    return stall, background, written[0]


def run_one(variant: str, iters: int, out_dir: Path) -> dict[str, float]:
    """One measurement; run in a fresh process so earlier windows' memory cannot slow it."""
    torch.set_num_threads(1)
    workload(100)  # warm up kineto and the allocator
    if variant == "profd":
        stall, background, path = profd_stall(iters, out_dir)
        return {"stall": stall, "background": background, "bytes": path.stat().st_size}
    path = out_dir / ("t.json.gz" if variant == "torch_gz" else "t.json")
    stall = torch_stall(iters, path)
    return {"stall": stall, "background": 0.0, "bytes": path.stat().st_size}


def measure(variant: str, iters: int, repeats: int) -> dict[str, float]:
    runs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, __file__, "--one", variant, "--iters", str(iters), "--dir", tmp]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=40_000, help="add+mul pairs (≈ 2.6 KB/pair)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", choices=["torch_gz", "torch_json", "profd"])
    parser.add_argument("--dir", type=Path)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.iters, args.dir)))
        return
    json_r = measure("torch_json", args.iters, args.repeats)
    gz_r = measure("torch_gz", args.iters, args.repeats)
    ours = measure("profd", args.iters, args.repeats)
    ratio = ours["stall"] / json_r["stall"]
    size_ratio = ours["bytes"] / gz_r["bytes"]
    print(
        f"window: {json_r['bytes'] / 1e6:.0f} MB of JSON ({args.iters} iterations), "
        f"median of {args.repeats} fresh processes each"
    )
    print(f"torch .json.gz stall   : {gz_r['stall']:7.2f} s")
    print(f"torch .json stall      : {json_r['stall']:7.2f} s")
    print(
        f"profd stall            : {ours['stall']:7.2f} s  "
        f"({ratio:.2f}x plain JSON; target <= 1.2x)"
    )
    print(f"profd background write : {ours['background']:7.2f} s  (off the training thread)")
    print(f"profd file / torch gz  : {size_ratio:7.2f}x  (target <= 1.15x)")
    print(
        f"RESULT stall_s={ours['stall']:.3f} torch_gz_s={gz_r['stall']:.3f} "
        f"torch_json_s={json_r['stall']:.3f} ratio_vs_json={ratio:.3f} size_ratio={size_ratio:.3f}"
    )


if __name__ == "__main__":
    main()
