"""A data-parallel job that hangs, for ``profd stacks``.

Four Ray actors train one model data-parallel over gloo (CPU): each step loads a batch, then
averages gradients with ``all_reduce``. At ``--stuck-at`` one rank's data loader never returns
(its queue is never filled); the other ranks wait for it inside ``all_reduce``, as a real job
does on a NCCL collective. Nothing fails and no step mark is made any more::

    profd up
    python examples/spmd_hang.py --address auto &
    profd stacks            # rank 2 alone in its loader's wait; 0, 1 and 3 in all_reduce

The driver prints one JSON line per step of the slowest rank and ``{"hung": ...}`` once
nothing moved for ``--hung-after`` seconds; it runs until interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import time
from typing import Any

import profd

HIDDEN = 64


class DataParallelRank:
    """One rank: a small model, a data loader, and gloo's all_reduce for the gradients."""

    def __init__(self, rank: int, world: int, port: int, stuck_rank: int, stuck_at: int) -> None:
        self.rank, self.world, self.port = rank, world, port
        self.stuck = stuck_at if rank == stuck_rank else None
        self.step = -1
        self.agent = profd.attach(role="trainer", rank=rank, world_size=world)
        self._loader: queue.Queue[Any] = queue.Queue()  # a loader thread that never delivers

    def connected(self) -> bool:
        return self.agent.connected

    def current_step(self) -> int:
        return self.step

    def load_batch(self, torch: Any, step: int) -> Any:
        if step == self.stuck:
            return self._loader.get()  # the stuck read: nothing is ever put
        return torch.randn(32, HIDDEN)

    def run(self, steps: int) -> int:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", rank=self.rank, world_size=self.world)
        model = torch.nn.Linear(HIDDEN, HIDDEN)
        for step in range(steps):
            with self.agent.step(step):
                with self.agent.stage("load"):
                    batch = self.load_batch(torch, step)
                with self.agent.stage("update"):
                    model.zero_grad()
                    model(batch).square().mean().backward()
                    for p in model.parameters():
                        dist.all_reduce(p.grad)  # waits for every rank
                        p.grad /= self.world
            self.step = step
        dist.destroy_process_group()
        return steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(args: argparse.Namespace) -> None:
    profd.join_or_start_ray(args.address, num_cpus=4)
    import ray

    port = _free_port()
    remote = ray.remote(DataParallelRank).options(num_cpus=0, max_concurrency=2)
    ranks = [
        remote.remote(r, args.world, port, args.stuck_rank, args.stuck_at)
        for r in range(args.world)
    ]
    ray.get([w.connected.remote() for w in ranks], timeout=120)
    runs = [w.run.remote(args.steps) for w in ranks]
    last, moved, hung = -1, time.monotonic(), False
    while True:
        done, _ = ray.wait(runs, num_returns=len(runs), timeout=0.2)
        if len(done) == len(runs):
            print(json.dumps({"done": ray.get(runs)}), flush=True)
            return
        steps = ray.get([w.current_step.remote() for w in ranks])
        if min(steps) != last:
            last, moved = min(steps), time.monotonic()
            print(json.dumps({"step": last, "steps": steps}), flush=True)
        elif not hung and last >= 0 and time.monotonic() - moved > args.hung_after:
            hung = True
            print(json.dumps({"hung": True, "steps": steps}), flush=True)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default=None, help="Ray address (default: a private Ray)")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--stuck-rank", type=int, default=2)
    p.add_argument("--stuck-at", type=int, default=5, help="the step whose batch never comes")
    p.add_argument("--hung-after", type=float, default=2.0, help="seconds without a step")
    return p.parse_args()


if __name__ == "__main__":
    main(_parse())
