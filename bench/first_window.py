"""The training thread's first torch window in a fresh process: cold, as torch starts it, and
warmed, as profd's agent does once the window is planned.

``torch.profiler``'s first ``start()`` asks ``hasattr(torch, "_inductor")``, which imports
inductor and dynamo: seconds on the training thread the first time a process profiles. profd
imports them on a thread of its own as soon as a torch window is planned
(:func:`profd.backends.torch_backend.warm_up_profiler`), so the window's start finds them
imported; the imports then share the GIL with the training loop instead of stopping it.

Each round runs both variants, in an order that alternates, each in a fresh Python process
(the imports happen once per process):

* ``cold``: the training thread starts a CPU profiler window (torch's own first start);
* ``warmed``: profd's warm-up runs while the training thread loops on small steps for
  ``--lead-s`` seconds (the window is planned a few steps ahead), recording the longest gap
  between two of its steps; then it starts the same window. ``--loop torch`` (the default):
  each step a 128x128 matmul, tensor work as training is (torch's ops let go of the GIL);
  ``--loop python``: pure Python that never lets go of it, where the imports, which give
  the GIL up at each file they read, wait a switch interval each time to get it back and
  may not be done when the window starts (it then waits for the rest).

Reported: the median over rounds of the window's ``start()`` on the training thread, cold
(``cold_start_ms``, the reference) and warmed (``warm_start_ms``), their ratio
(``start_ratio``), and the median of the warmed variant's longest step gap while the imports
ran (``warm_gap_ms``: what the training thread waited instead).

    python bench/first_window.py [--rounds 7] [--lead-s 3] [--loop torch|python]

Last line: ``RESULT cold_start_ms=... warm_start_ms=... start_ratio=... warm_gap_ms=...
loop=... lead_s=... rounds=... load=...``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import torch
from torch.profiler import ProfilerActivity, profile

variant, lead_s, loop = sys.argv[1], float(sys.argv[2]), sys.argv[3]
a = torch.ones(128, 128)
gap = 0.0
if variant == "warmed":
    from profd.backends.torch_backend import warm_up_profiler

    warm_up_profiler()
    end = last = time.perf_counter()
    end += lead_s
    while (now := time.perf_counter()) < end:
        if loop == "torch":
            (a @ a).sum()  # a small step of tensor work
        else:
            sum(range(200))  # a small step of pure Python
        gap, last = max(gap, now - last), now
window = profile(activities=[ProfilerActivity.CPU])
t0 = time.perf_counter()
window.start()
started = time.perf_counter() - t0
torch.ones(64).sum()
window.stop()
print(json.dumps({"start_s": started, "gap_s": gap}))
"""


def run(variant: str, lead_s: float, loop: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, variant, str(lead_s), loop],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--lead-s", type=float, default=3.0)
    ap.add_argument("--loop", choices=("torch", "python"), default="torch")
    args = ap.parse_args()
    got: dict[str, list[dict[str, float]]] = {"cold": [], "warmed": []}
    for i in range(args.rounds):
        order = ["cold", "warmed"] if i % 2 == 0 else ["warmed", "cold"]
        for variant in order:
            got[variant].append(run(variant, args.lead_s, args.loop))
        c, w = got["cold"][-1], got["warmed"][-1]
        print(
            f"round {i + 1}: cold start {c['start_s'] * 1e3:.0f} ms, warmed start "
            f"{w['start_s'] * 1e3:.1f} ms (longest step gap while warming "
            f"{w['gap_s'] * 1e3:.1f} ms)",
            flush=True,
        )
    cold = statistics.median(r["start_s"] for r in got["cold"]) * 1e3
    warm = statistics.median(r["start_s"] for r in got["warmed"]) * 1e3
    gap = statistics.median(r["gap_s"] for r in got["warmed"]) * 1e3
    print(
        f"RESULT cold_start_ms={cold:.0f} warm_start_ms={warm:.1f} "
        f"start_ratio={warm / cold:.4f} warm_gap_ms={gap:.1f} loop={args.loop} "
        f"lead_s={args.lead_s:g} rounds={args.rounds} "
        f"load={os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
