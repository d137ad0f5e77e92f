"""One rank of a small RL-shaped job, recorded by a real profd agent (for the analysis tests).

    python analysis_workload.py OUT_DIR RANK WORLD [--slow RANK:STEP:STAGE:SECONDS] [--rollout]

Every rank runs in its own process (torch.profiler is one per process) with its own
in-process coordinator, profiles steps 1 and 2 (one trace per step) and runs each stage at
the same wall-clock offsets as its peers, so ranks line up. ``--slow`` plants a straggler:
that rank sleeps inside that stage of that step. ``--rollout`` also writes a plain
torch.profiler trace (no profd metadata) under a relocated rollout-engine name and under a
name nothing can parse. Traces end up flat in OUT_DIR, the way a session directory holds
them; ``OUT_DIR/.sync/worker-<rank>.json`` records the clock the rank followed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from profd.actors.coordinator import ProfileCoordinator
from profd.agent import ProfilerAgent
from profd.core.files import gzip_file
from profd.testing.coordinator import InProcessCoordinator

from helpers import coordinator_settings, wait_until

PERIOD = 0.6  # seconds between step starts
# (label, start, end) in seconds after the step starts; the lead-in absorbs profiler start-up.
STAGES = (("generate_sequences", 0.05, 0.11), ("compute_log_prob", 0.13, 0.19))
UPDATE = ("update_actor", 0.21, 0.41)  # two mini-batches of two micro-batches
torch.set_num_threads(1)  # four ranks share two cores: no intra-op thread pools
MODEL = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def until(t: float) -> None:
    delay = t - time.time()
    if delay > 0:
        time.sleep(delay)


def work(backward: bool = False) -> None:
    out = MODEL(torch.randn(8, 16)).sum()
    if backward:
        out.backward()


def run_step(agent: ProfilerAgent, step: int, base: float, slow: float) -> None:
    until(base)
    with agent.step(step):
        for label, start, end in STAGES:
            until(base + start)
            with agent.stage(label), torch.no_grad():
                work()
                until(base + end)
        label, start, _ = UPDATE
        until(base + start)
        with agent.stage(label, update_loop=True):
            for i in range(2):
                with agent.mini_batch(i):
                    for j in range(2):
                        with agent.micro_batch(j):
                            work(backward=True)
                            until(base + start + i * 0.1 + (j + 1) * 0.05)
                    if slow and i == 1:
                        time.sleep(slow)
        until(base + 0.45)


def barrier(sync: Path, rank: int, world: int) -> float:
    """Every rank waits for all; all derive the same start time from the ready files."""
    sync.mkdir(parents=True, exist_ok=True)
    (sync / f"ready-{rank}").write_text(str(os.getpid()))
    files = [sync / f"ready-{r}" for r in range(world)]
    wait_until(lambda: all(f.exists() for f in files), 60, what="all ranks ready")
    return max(f.stat().st_mtime for f in files) + 0.5


def rollout_trace(out: Path, rank: int) -> None:
    from torch.profiler import profile, record_function

    with profile() as prof, record_function("generate"):
        for _ in range(5):
            work()
    raw = out / "engine_dump.json"
    prof.export_chrome_trace(str(raw))
    gzip_file(raw, out / f"rollout-replica0-globalrank{rank}_vm_{os.getpid()}.pt.trace.json.gz")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("rank", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("--slow", default="")
    ap.add_argument("--rollout", action="store_true")
    args = ap.parse_args()
    slow_rank, slow_step, slow_stage, slow_s = args.slow.split(":") if args.slow else ("",) * 4
    scratch = args.out / ".sync" / f"rank{args.rank}"
    owner = InProcessCoordinator(ProfileCoordinator(coordinator_settings(scratch)))
    topo = {"tp": args.rank % 2, "dp": args.rank // 2}
    agent = ProfilerAgent("actor_rollout_ref", args.rank, args.world, topo, find_link=owner.link)
    agent.start()
    wait_until(lambda: agent.connected, 30, what="agent registered")
    run_step(agent, 0, time.time(), 0.0)  # warm-up, not profiled
    with torch.profiler.profile():  # the first profiler start in a process is slow
        work()
    request = {
        "steps": [1, 2],
        "profile_continuous_steps": True,
        "roles": {"actor": {"all_ranks": True}},
    }
    view = owner.call("create_session", request)
    wait_until(lambda: agent.plan.windows, 30, what="plan armed")
    t0 = barrier(args.out / ".sync", args.rank, args.world)
    for step in (1, 2):
        late = slow_rank == str(args.rank) and slow_step == str(step)
        run_step(agent, step, t0 + (step - 1) * PERIOD, float(slow_s) if late else 0.0)
    assert slow_stage in ("", UPDATE[0]), "only update_actor can be slowed"
    agent.close(timeout=60)
    done = wait_until(
        lambda: (v := owner.call("get_session", view.session_id)).state.is_terminal and v, 60
    )
    assert done.state.value == "done", done.reason
    for t in done.traces:
        shutil.move(t.path, args.out / Path(t.path).name)
    if args.rollout:
        rollout_trace(args.out, args.rank)
    meta = {"rank": args.rank, "t0": t0, "period": PERIOD, "pid": os.getpid()}
    (args.out / ".sync" / f"worker-{args.rank}.json").write_text(json.dumps(meta))
    owner.close()


if __name__ == "__main__":
    sys.exit(main())
