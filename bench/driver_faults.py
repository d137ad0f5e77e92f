"""What a single-controller driver pays per step for ``profd.controller().step(n)`` while the
coordinator is healthy, slow, killed, or Ray's GCS is gone.

Each scenario runs in its own process against its own ``ray start`` head on 127.0.0.1 (a dead
GCS takes its driver with it) and its own real coordinator actor:

* ``healthy`` — the coordinator answers (no session: one small RPC per step);
* ``slow`` — a coordinator whose every call is delayed (``--delay-s``, default 3 s: longer than
  the driver's step budget), from the start;
* ``dead`` — 20 healthy steps, then the coordinator is killed for good (``ray.kill``);
* ``gcs_down`` — 20 healthy steps, then the head's ``gcs_server`` process is killed.

Then ``--steps`` (200) steps, each run twice in a row with the same small body: once inside
``ctl.step(n)`` and once inside an empty ``nullcontext()`` (the reference, interleaved step by
step). A step's added time is the difference; the figure per scenario is its mean over the
steps, in microseconds. ``worst_step_ms`` is the largest added time of any step *after* the step
that first saw the failure, over the three faulty scenarios (target: under 100 ms). The step
that sees the failure first waits at most the step budget (1.25 s by default) when the
coordinator is slow; a dead coordinator fails at once. A GCS that is gone is noticed by the
controller's watcher (a TCP probe every 0.1 s), so the steps between the kill and the next
probe still pay an ordinary announcement each. Target: ``dead_us`` and ``gcs_down_us`` at most
1000 on average over the 200 steps.

    python bench/driver_faults.py [--steps 200] [--delay-s 3]

Last line: ``RESULT healthy_us=... slow_us=... dead_us=... gcs_down_us=... worst_step_ms=...
first_failure_ms=... load=...``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCENARIOS = ("healthy", "slow", "dead", "gcs_down")
WARMUP_STEPS = 20


def _body() -> None:
    """A tiny, fixed step body (the same in both variants)."""
    total = 0
    for i in range(2000):
        total += i * i


def _slow_coordinator(delay_s: float) -> type:
    import asyncio

    from profd.actors.coordinator import ProfileCoordinator

    class SlowCoordinator(ProfileCoordinator):
        """The real coordinator, every driver-facing call delayed (an overloaded actor)."""

        async def controller_step(self, *args: Any) -> Any:
            await asyncio.sleep(delay_s)
            return await super().controller_step(*args)

        async def ping(self) -> str:
            await asyncio.sleep(delay_s)
            return await super().ping()

    return SlowCoordinator


def _start_coordinator(scenario: str, delay_s: float, tmp: Path) -> Any:
    import ray

    from profd.actors import get_or_create_coordinator
    from profd.core.constants import COORDINATOR_NAME, NAMESPACE
    from profd.core.settings import CoordinatorSettings

    settings = CoordinatorSettings(save_root=str(tmp / "traces"), base_dir=str(tmp))
    if scenario != "slow":
        return get_or_create_coordinator(settings, detached=False)[0]
    cls = _slow_coordinator(delay_s)
    handle = (
        ray.remote(cls)
        .options(name=COORDINATOR_NAME, namespace=NAMESPACE, num_cpus=0, max_concurrency=1000)
        .remote(settings.model_dump())
    )
    ray.get(handle.pid.remote())  # constructed (pid is not delayed)
    return handle


def _kill_gcs(temp_dir: str) -> int:
    from profd.cli.ray_cluster import _pids_mentioning

    pids = [p for p in _pids_mentioning(temp_dir) if b"gcs_server" in _cmdline(p)]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return len(pids)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _measure(ctl: Any, first: int, steps: int) -> tuple[list[float], int | None]:
    """Added seconds per step (``ctl.step(n)`` minus ``nullcontext()``, interleaved), and the
    index of the step during which the controller's circuit first opened."""
    added: list[float] = []
    trip = None
    for n in range(first, first + steps):
        opened = len(ctl.history)
        t0 = time.perf_counter()
        with ctl.step(n):
            _body()
        t1 = time.perf_counter()
        with contextlib.nullcontext():
            _body()
        t2 = time.perf_counter()
        added.append((t1 - t0) - (t2 - t1))
        if trip is None and len(ctl.history) > opened:
            trip = len(added) - 1
    return added, trip


def run_scenario(scenario: str, steps: int, delay_s: float, tmp: Path) -> dict[str, Any]:
    from profd.cli.ray_cluster import start_local_ray
    from profd.core.ray_env import apply_loopback_env, connect_ray

    apply_loopback_env()
    address, temp_dir = start_local_ray(num_cpus=1)
    connect_ray(address)
    import ray

    from profd.driver.controller import Controller, Link

    coord = _start_coordinator(scenario, delay_s, tmp)
    ctl = Controller()
    if scenario in ("dead", "gcs_down"):
        _measure(ctl, 1, WARMUP_STEPS)
        assert ctl.link is Link.CLOSED, ctl.history
        if scenario == "dead":
            ray.kill(coord, no_restart=True)
            from profd.core.ray_env import find_coordinator

            deadline = time.monotonic() + 30
            while find_coordinator() is not None and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            assert _kill_gcs(temp_dir) == 1, "no gcs_server process found"
    added, trip = _measure(ctl, WARMUP_STEPS + 1, steps)
    after = added[trip + 1 :] if trip is not None else added
    out = {
        "scenario": scenario,
        "steps": steps,
        "mean_us": sum(added) / len(added) * 1e6,
        "first_failure_ms": (added[trip] * 1e3) if trip is not None else None,
        "worst_after_ms": max(after) * 1e3 if after else 0.0,
        "link": ctl.link.value,
        "history": [(c.to.value, c.why) for c in ctl.history],
    }
    print(json.dumps(out), flush=True)
    # A driver whose GCS is gone cannot shut Ray down cleanly: leave, then clean up the head.
    from profd.cli.ray_cluster import stop_local_ray

    if scenario != "gcs_down":
        ray.shutdown()
    stop_local_ray(temp_dir)
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--delay-s", type=float, default=3.0)
    parser.add_argument("--scenario", choices=SCENARIOS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scenario:
        import tempfile

        run_scenario(args.scenario, args.steps, args.delay_s, Path(tempfile.mkdtemp()))
        return

    results: dict[str, dict[str, Any]] = {}
    for scenario in SCENARIOS:
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--scenario",
                scenario,
                "--steps",
                str(args.steps),
                "--delay-s",
                str(args.delay_s),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            raise SystemExit(f"{scenario} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        results[scenario] = json.loads(lines[-1])
        r = results[scenario]
        print(
            f"{scenario:9s} added {r['mean_us']:9.1f} us/step  first failure "
            f"{r['first_failure_ms'] or 0:7.1f} ms  worst after {r['worst_after_ms']:6.2f} ms  "
            f"link {r['link']}  {r['history'][:2]}"
        )
    faulty = [results[s] for s in ("slow", "dead", "gcs_down")]
    worst = max(r["worst_after_ms"] for r in faulty)
    first = max((r["first_failure_ms"] or 0) for r in faulty)
    ok = results["dead"]["mean_us"] <= 1000 and results["gcs_down"]["mean_us"] <= 1000
    ok = ok and worst < 100
    verdict = "met" if ok else "MISSED"
    print(f"target (dead/gcs_down <= 1000 us, worst after failure < 100 ms): {verdict}")
    print(
        f"RESULT healthy_us={results['healthy']['mean_us']:.1f} "
        f"slow_us={results['slow']['mean_us']:.1f} dead_us={results['dead']['mean_us']:.1f} "
        f"gcs_down_us={results['gcs_down']['mean_us']:.1f} worst_step_ms={worst:.2f} "
        f"first_failure_ms={first:.1f} load={os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
