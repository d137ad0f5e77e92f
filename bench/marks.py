"""Cost of profd's marks while nothing records, next to an empty ``nullcontext()``.

Variants, each a loop of N ``with`` blocks:

* ``nullcontext``: ``with contextlib.nullcontext():`` (the reference);
* ``step`` / ``stage`` / ``mini_batch`` / ``micro_batch``: an idle agent (no plan), as
  attached by default: step and stage marks record their durations (live step times, one
  clock read per mark boundary into a ring);
* ``untimed_step`` / ``untimed_stage``: the same marks of an agent made with
  ``mark_times=False`` (what recording the durations costs is the difference);
* ``armed_step``: ``step`` on an agent whose plan holds a torch window for a much later step,
  so every step mark checks whether that step has come;
* ``watched_step`` / ``watched_stage``: the marks of an agent whose role a straggler
  trigger watches (its plan's ``spans``: marks also keep when they ended, and the step mark
  its number);
* ``record_function``: torch's own range with no profiler running (N/10 marks).

The variants run interleaved: every round runs each variant once for N marks (a few ms), in
an order that rotates from round to round, so a change of machine load hits all of them
alike. Time is this thread's CPU time (``time.thread_time_ns``), so the time other processes
hold the core is not counted. Per round the cost of a mark is its loop time minus an empty
loop's (same round), in ns; ratios are taken within a round and their median over the rounds
is reported, with the spread of the per-round values. Targets: the slowest idle mark ≤ 1.2x
``nullcontext`` (``ratio``, durations recorded: the default), the armed step mark ≤ 2x
(``armed_ratio``). ``untimed_ratio`` is the slowest untimed mark's, ``watched_ratio`` the
slowest watched mark's (no target: it is paid only while a straggler trigger watches), and
``timing_ns`` the median per-round cost of recording durations in the slowest of step and
stage.

    python bench/marks.py [--n 20000] [--rounds 200]

Last line: ``RESULT ratio=... armed_ratio=... untimed_ratio=... watched_ratio=...
timing_ns=... mark_ns=... armed_ns=... nullcontext_ns=... record_function_ns=... load=...``
(``load``: the 1-minute load average at the end).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from torch.profiler import record_function

from profd.agent import ProfilerAgent
from profd.core.protocol import AgentPlan, WindowPlan

log = logging.getLogger("bench.marks")

IDLE_MARKS = ("step", "stage", "mini_batch", "micro_batch")
UNTIMED_MARKS = ("untimed_step", "untimed_stage")
WATCHED_MARKS = ("watched_step", "watched_stage")
#: The armed agent's window: the last step a session may name, far beyond this bench's.
LATER_STEP = 2**53 - 1


def idle_agent(mark_times: bool = True) -> ProfilerAgent:
    """Attached but idle: no coordinator, no plan."""
    return ProfilerAgent("actor", 0, 8, find_link=lambda: None, mark_times=mark_times)


def armed_agent(save_dir: str) -> ProfilerAgent:
    """An agent holding a torch window for :data:`LATER_STEP`, installed as the poller would
    install it; the first mark adopts it."""
    agent = ProfilerAgent("actor", 0, 8, find_link=lambda: None)
    window = WindowPlan(
        session_id="bench",
        tool="torch",
        steps=(LATER_STEP,),
        groups=((LATER_STEP,),),
        discrete=False,
        tool_config={},
        save_dir=save_dir,
        role_block="actor",
    )
    agent._install_plan(AgentPlan(version=1, windows=(window,)))
    with agent.step(0):
        pass
    if not agent._recorder.has_windows or agent._recorder.wake_at != LATER_STEP:
        raise RuntimeError("the armed agent did not adopt its window")
    return agent


def loops(
    idle: ProfilerAgent, armed: ProfilerAgent, untimed: ProfilerAgent, watched: ProfilerAgent
) -> dict[str, Callable[[int], None]]:
    def empty(n: int) -> None:
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
            with idle.step(i):
                pass

    def stage(n: int) -> None:
        for _ in range(n):
            with idle.stage("compute_log_prob"):
                pass

    def mini_batch(n: int) -> None:
        for i in range(n):
            with idle.mini_batch(i):
                pass

    def micro_batch(n: int) -> None:
        for i in range(n):
            with idle.micro_batch(i):
                pass

    def armed_step(n: int) -> None:
        for i in range(1, n + 1):
            with armed.step(i):
                pass

    def untimed_step(n: int) -> None:
        for i in range(n):
            with untimed.step(i):
                pass

    def untimed_stage(n: int) -> None:
        for _ in range(n):
            with untimed.stage("compute_log_prob"):
                pass

    def watched_step(n: int) -> None:
        for i in range(n):
            with watched.step(i):
                pass

    def watched_stage(n: int) -> None:
        for _ in range(n):
            with watched.stage("compute_log_prob"):
                pass

    return {
        "empty": empty,
        "nullcontext": nullctx,
        "step": step,
        "stage": stage,
        "mini_batch": mini_batch,
        "micro_batch": micro_batch,
        "armed_step": armed_step,
        "untimed_step": untimed_step,
        "untimed_stage": untimed_stage,
        "watched_step": watched_step,
        "watched_stage": watched_stage,
        "record_function": rf,
    }


def run_rounds(fns: dict[str, Callable[[int], None]], n: int, rounds: int) -> dict[str, list]:
    """ns per mark of every variant in every round (the empty loop's time taken off)."""
    names = list(fns)
    out: dict[str, list[float]] = {name: [] for name in names if name != "empty"}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        raw = {}
        for name in order:
            count = n // 10 if name == "record_function" else n
            t0 = time.thread_time_ns()
            fns[name](count)
            raw[name] = (time.thread_time_ns() - t0) / count
        for name in out:
            out[name].append(raw[name] - raw["empty"])
    return out


def spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4)
    return f"IQR {q[0]:7.1f}-{q[2]:7.1f}  min-max {min(values):7.1f}-{max(values):7.1f}"


def ratios(rows: dict[str, list[float]], name: str) -> list[float]:
    return [a / b for a, b in zip(rows[name], rows["nullcontext"], strict=True)]


def report(rows: dict[str, list[float]], n: int, rounds: int, load_start: tuple) -> None:
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{rounds} interleaved rounds of {n} marks per variant; ns per mark (median, spread)")
    for name, values in rows.items():
        print(f"{name:>16}: {med[name]:7.1f} ns   {spread(values)}")
    worst = max(IDLE_MARKS, key=med.__getitem__)
    idle_r, armed_r = ratios(rows, worst), ratios(rows, "armed_step")
    ratio, armed_ratio = statistics.median(idle_r), statistics.median(armed_r)
    untimed = max(UNTIMED_MARKS, key=med.__getitem__)
    untimed_ratio = statistics.median(ratios(rows, untimed))
    watched = max(WATCHED_MARKS, key=med.__getitem__)
    watched_ratio = statistics.median(ratios(rows, watched))
    timing_ns = max(
        statistics.median(a - b for a, b in zip(rows[m], rows[f"untimed_{m}"], strict=True))
        for m in ("step", "stage")
    )
    print(
        f"slowest idle mark: {worst}, {ratio:.2f}x nullcontext (per-round ratios "
        f"{min(idle_r):.2f}-{max(idle_r):.2f}; target <= 1.2x)"
    )
    print(
        f"without recording durations (mark_times=False): slowest {untimed}, "
        f"{untimed_ratio:.2f}x nullcontext; recording them costs {timing_ns:.1f} ns per mark"
    )
    print(
        f"watched by a straggler trigger (ends kept): slowest {watched}, "
        f"{watched_ratio:.2f}x nullcontext"
    )
    print(
        f"armed step mark: {armed_ratio:.2f}x nullcontext (per-round ratios "
        f"{min(armed_r):.2f}-{max(armed_r):.2f}; target <= 2x)"
    )
    load_end = os.getloadavg()
    print(
        "load average (1/5/15 min): start "
        + "/".join(f"{x:.2f}" for x in load_start)
        + ", end "
        + "/".join(f"{x:.2f}" for x in load_end)
    )
    print(
        f"RESULT ratio={ratio:.2f} armed_ratio={armed_ratio:.2f} "
        f"untimed_ratio={untimed_ratio:.2f} watched_ratio={watched_ratio:.2f} "
        f"timing_ns={timing_ns:.1f} mark_ns={med[worst]:.1f} "
        f"armed_ns={med['armed_step']:.1f} nullcontext_ns={med['nullcontext']:.1f} "
        f"record_function_ns={med['record_function']:.1f} load={load_end[0]:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000, help="marks per variant per round")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        idle, armed, untimed = idle_agent(), armed_agent(tmp), idle_agent(mark_times=False)
        watched = idle_agent()
        watched._install_plan(AgentPlan(version=1, spans=True))  # a straggler trigger's role
        fns = loops(idle, armed, untimed, watched)
        for fn in fns.values():  # warm up
            fn(1000)
        rows = run_rounds(fns, args.n, args.rounds)
        if list(os.scandir(tmp)):
            raise RuntimeError("the armed agent recorded something: its window came too early")
        times = idle._take_times()
        if times is None or times.step is None or not times.stages:
            raise RuntimeError("the idle agent's marks recorded no durations")
        if type(watched._step_mark).__name__ != "SpanStepMark":
            raise RuntimeError("the watched agent's marks do not keep their ends")
        idle.close(), armed.close(), untimed.close(), watched.close()
    report(rows, args.n, args.rounds, load_start)


if __name__ == "__main__":
    main()
