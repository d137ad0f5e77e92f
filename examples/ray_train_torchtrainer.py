"""Ray Train + profd: a ``TorchTrainer`` whose workers attach with their world rank.

Each Ray Train worker calls ``profd.attach(role="trainer", rank=<world rank>, ...)`` and marks
its loop: ``agent.step(n)`` around a training step, ``agent.stage(...)`` around its phases,
``agent.mini_batch(i)`` around each gradient-accumulation mini-batch. The model is wrapped in
DDP by ``ray.train.torch.prepare_model`` (gloo on CPU), so the traces show the all-reduce too.

Run it on a cluster where ``profd up --address auto`` ran on the head::

    python examples/ray_train_torchtrainer.py --address auto --steps 300 --step-seconds 0.5
    # in another shell, while it trains:
    profd profile --role trainer --all-ranks --next-steps 2 --wait

or declare the window when the job starts (no ``profd up`` needed: the job then owns a
coordinator for its lifetime); without ``--address`` the script starts a private Ray on
127.0.0.1 (see :func:`profd.join_or_start_ray`)::

    python examples/ray_train_torchtrainer.py --profile-steps 3,4

Needs ``ray[train]`` (pandas, pyarrow) next to profd. Kineto may print "External init callback
must run in same thread as registerClient" in the workers (ray#47131); the traces are complete.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import profd

ROLE = "trainer"
FEATURES = 32
HIDDEN = 64
BATCH = 32
MINI_BATCHES = 2


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Runs in every Ray Train worker process."""
    import ray.train
    import ray.train.torch
    import torch

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    agent = profd.attach(role=ROLE, rank=rank, world_size=world, topology={"dp": rank})
    deadline = time.monotonic() + config["wait_for_plan_s"]
    while not agent.connected and time.monotonic() < deadline:
        time.sleep(0.05)  # a launch-time window: hold this worker's plan before step 1

    torch.manual_seed(rank)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1)
    )
    model = ray.train.torch.prepare_model(model)  # DDP over gloo: gradients are all-reduced
    optim = torch.optim.SGD(model.parameters(), lr=1e-2)
    loss_fn = torch.nn.MSELoss()

    loss = torch.tensor(0.0)
    for step in range(1, config["steps"] + 1):
        started = time.perf_counter()
        with agent.step(step):
            with agent.stage("load_batch"):
                x = torch.randn(BATCH, FEATURES)
                y = x.sum(dim=1, keepdim=True)
            with agent.stage("forward_backward", update_loop=True):
                optim.zero_grad()
                for i, (xb, yb) in enumerate(
                    zip(x.chunk(MINI_BATCHES), y.chunk(MINI_BATCHES), strict=True)
                ):
                    with agent.mini_batch(i):
                        loss = loss_fn(model(xb), yb) / MINI_BATCHES
                        loss.backward()
            with agent.stage("optimizer_step"):
                optim.step()
            spare = config["step_seconds"] - (time.perf_counter() - started)
            if spare > 0:
                time.sleep(spare)  # stands in for data loading / a larger model
    written = agent.close(timeout=120)  # flush the last window before the worker exits
    ray.train.report({"step": config["steps"], "loss": float(loss), "traces_written": written})


def main(
    steps: int = 6,
    num_workers: int = 2,
    profile_steps: list[int] | None = None,
    step_seconds: float = 0.0,
    address: str | None = None,
    storage_path: str | None = None,
) -> dict[str, Any]:
    """Train with ``num_workers`` CPU workers; return the session and its trace files."""
    profd.join_or_start_ray(address, num_cpus=max(4, num_workers))
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    session_id = None
    if profile_steps:
        # Launch-time window: every trainer rank that attaches joins it (profd's own layout;
        # a verl config works the same way).
        view = profd.start_session({"steps": profile_steps, "roles": {ROLE: {"all_ranks": True}}})
        session_id = view.session_id
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "steps": steps,
            "step_seconds": step_seconds,
            "wait_for_plan_s": 30.0 if profile_steps else 0.0,
        },
        scaling_config=ScalingConfig(
            num_workers=num_workers, use_gpu=False, resources_per_worker={"CPU": 1}
        ),
        run_config=RunConfig(name="profd-ray-train-example", storage_path=storage_path),
    )
    result = trainer.fit()  # raises if a worker failed
    out: dict[str, Any] = {"session_id": session_id, "error": result.error}
    if session_id is not None:
        view = profd.wait_session(session_id)
        out.update(state=view.state.value, traces=[t.path for t in view.traces])
    return out


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--address",
        default=None,
        help="Ray address, e.g. auto (default: $RAY_ADDRESS, else a private Ray on 127.0.0.1)",
    )
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--step-seconds", type=float, default=0.0, help="minimum time per step")
    p.add_argument("--profile-steps", default=None, help="e.g. 3,4: a launch-time session")
    return p.parse_args()


if __name__ == "__main__":
    args = _parse()
    out = main(
        steps=args.steps,
        num_workers=args.num_workers,
        profile_steps=[int(s) for s in args.profile_steps.split(",")]
        if args.profile_steps
        else None,
        step_seconds=args.step_seconds,
        address=args.address,
    )
    print(json.dumps(out, default=str))
