"""Record a real GPU trace set for ``bench/analysis.py --reuse DIR``, on a CUDA machine.

    python bench/real_gpu_set.py OUT [--ranks 4] [--iters 1500] [--device cuda]

Each rank is its own process (torch.profiler is one per process), one after the other: a
profd agent on an in-process coordinator, a training step in three stages (a
``generate_sequences``-like loop of small forward passes, a ``compute_log_prob`` one, and
``update_actor``: forward, backward and an optimizer step per mini-batch, on two CUDA
streams), step 1 recorded by a real profd session with its default contents. The trace each
rank wrote is copied into ``OUT`` (``.json.gz``, profd's name). ``--iters`` sets the launches
per stage, hence the size (about 7 MB of JSON a rank per 1,000 on torch 2.11). The
synthetic sets of ``gpu_trace_set.py`` have figures known by construction; these have real
kernels, real launch gaps and Kineto's real text, which is what ``--reuse`` compares the
two tools on. ``--device cpu`` makes a CPU-only set (a dry run of the script).

Last line: ``RESULT ranks=... files=... bytes_gz=... bytes_json=... seconds=...``.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def _step_loop(agent: Any, iters: int, device: str) -> Callable[[int], None]:
    """One training step in three stages, as a function of its step number."""
    import torch

    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    side = torch.cuda.Stream() if device == "cuda" else None

    def step(s: int) -> None:
        x = torch.randn(64, 256, device=device)
        with agent.step(s):
            with agent.stage("generate_sequences"), torch.no_grad():
                for _ in range(iters):
                    x = model(x).tanh()
            with agent.stage("compute_log_prob"), torch.no_grad():
                if side is not None:
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(iters // 2):
                            model(x).log_softmax(-1)
                for _ in range(iters // 2):
                    model(x).log_softmax(-1)
            with agent.stage("update_actor", update_loop=True):
                for i in range(max(1, iters // 20)):
                    with agent.mini_batch(i):
                        model(x).square().mean().backward()
                        opt.step()
                        opt.zero_grad()
            if device == "cuda":
                torch.cuda.synchronize()

    return step


def record_rank(out: Path, rank: int, world: int, iters: int, device: str) -> Path:
    """Run the step loop as rank ``rank`` and record step 1; the trace's path in ``out``."""

    from profd.actors.coordinator import ProfileCoordinator
    from profd.agent import ProfilerAgent
    from profd.core.settings import CoordinatorSettings
    from profd.testing.coordinator import InProcessCoordinator

    base = Path(tempfile.mkdtemp(prefix="profd-real-gpu-"))
    settings = CoordinatorSettings(
        save_root=str(base / "profile"), base_dir=str(base), poll_timeout_s=1.0
    )
    owner = InProcessCoordinator(ProfileCoordinator(settings))
    agent = ProfilerAgent("actor", rank, world, find_link=owner.link).start()
    _wait(lambda: agent.connected, 30, "the agent to register")
    step = _step_loop(agent, iters, device)
    step(0)
    request = {"steps": [1], "roles": {"actor": {"ranks": [rank]}}}
    view = owner.call("create_session", request)
    _wait(lambda: any(w.session_id == view.session_id for w in agent.plan.windows), 30, "plan")
    for s in (1, 2):
        step(s)
    _wait(lambda: owner.call("get_session", view.session_id).state.is_terminal, 300, "session")
    view = owner.call("get_session", view.session_id)
    agent.close()
    owner.close()
    if view.state.value != "done" or len(view.traces) != 1:
        raise SystemExit(f"rank {rank}: session {view.state.value}: {view.reason}")
    (trace,) = view.traces
    target = out / Path(trace.path).name
    shutil.copy(trace.path, target)
    shutil.rmtree(base, ignore_errors=True)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--iters", type=int, default=1500)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # one rank's process
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.rank is not None:
        print(record_rank(args.out, args.rank, args.ranks, args.iters, args.device))
        return
    started = time.perf_counter()
    for rank in range(args.ranks):
        cmd = [sys.executable, __file__, str(args.out), "--rank", str(rank)]
        cmd += ["--ranks", str(args.ranks), "--iters", str(args.iters), "--device", args.device]
        subprocess.run(cmd, check=True)
    files = sorted(args.out.glob("*.json.gz"))
    raw = sum(len(gzip.decompress(f.read_bytes())) for f in files)
    print(
        f"RESULT ranks={args.ranks} files={len(files)} "
        f"bytes_gz={sum(f.stat().st_size for f in files)} bytes_json={raw} "
        f"seconds={time.perf_counter() - started:.1f}"
    )


if __name__ == "__main__":
    main()
