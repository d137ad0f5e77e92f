"""Idle cost of profd's marks, next to an empty ``nullcontext()`` and ``record_function``.

With no window armed, ``step`` / ``stage`` / ``mini_batch`` must cost about as much as an empty
context manager (target: the slowest mark ≤ 2.5x ``nullcontext``). Each variant runs the same
loop of N ``with`` blocks; the best of R repeats is reported per mark, in nanoseconds.

    python bench/marks.py [--n 1000000] [--repeats 7]

Last line: ``RESULT mark_ns=... nullcontext_ns=... record_function_ns=... ratio=...``.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable

from torch.profiler import record_function

from profd.agent import ProfilerAgent


def best_ns(fn: Callable[[int], None], n: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(n)
        best = min(best, (time.perf_counter() - t0) / n * 1e9)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    # An agent that is attached but idle: no coordinator, no plan.
    agent = ProfilerAgent("actor", 0, 8, find_link=lambda: None)

    def empty_loop(n: int) -> None:
        for _ in range(n):
            pass

    def nullctx(n: int) -> None:
        for _ in range(n):
            with contextlib.nullcontext():
                pass

    def rf(n: int) -> None:
        for _ in range(n):
            with record_function("stage"):
                pass

    def step(n: int) -> None:
        for i in range(n):
            with agent.step(i):
                pass

    def stage(n: int) -> None:
        for _ in range(n):
            with agent.stage("compute_log_prob"):
                pass

    def mini_batch(n: int) -> None:
        for i in range(n):
            with agent.mini_batch(i):
                pass

    def micro_batch(n: int) -> None:
        for i in range(n):
            with agent.micro_batch(i):
                pass

    loop = best_ns(empty_loop, args.n, args.repeats)
    rows = {}
    for name, fn in [
        ("nullcontext", nullctx),
        ("record_function", rf),
        ("step", step),
        ("stage", stage),
        ("mini_batch", mini_batch),
        ("micro_batch", micro_batch),
    ]:
        rf_n = args.n // 10 if name == "record_function" else args.n
        rows[name] = best_ns(fn, rf_n, args.repeats) - loop
    for name, ns in rows.items():
        print(f"{name:>16}: {ns:8.1f} ns per mark")
    marks = {k: rows[k] for k in ("step", "stage", "mini_batch", "micro_batch")}
    worst = max(marks, key=marks.get)
    ratio = marks[worst] / rows["nullcontext"]
    print(f"slowest idle mark: {worst} ({ratio:.2f}x nullcontext; target <= 2.5x)")
    print(
        f"RESULT mark_ns={marks[worst]:.1f} nullcontext_ns={rows['nullcontext']:.1f} "
        f"record_function_ns={rows['record_function']:.1f} ratio={ratio:.2f}"
    )


if __name__ == "__main__":
    main()
