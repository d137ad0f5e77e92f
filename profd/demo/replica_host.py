"""A rollout replica as a rollout server process runs it: a fake engine server (vLLM or SGLang
HTTP endpoints) and profd's rollout agent for it, in one process — meant to be a Ray actor
(``ray.remote(FakeReplicaHost)``), as verl runs each rollout server in its own actor."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

__all__ = ["FakeReplicaHost"]


class FakeReplicaHost:
    def __init__(
        self,
        engine: Literal["vllm", "sglang"],
        replica: int,
        tp: int,
        replicas: int,
        root: str,
        *,
        colocated: bool = False,
        quick: bool = True,
    ) -> None:
        from profd.rollout import (
            EngineProfileOptions,
            RolloutAgent,
            SglangHttpEngine,
            VllmHttpEngine,
            engine_trace_dir,
            vllm_launch_settings,
        )
        from profd.rollout.engine_args import VLLM_VERIFIED
        from profd.rollout.engines import EngineTimeouts
        from profd.rollout.relocate import FlushWait
        from profd.rollout.service import RolloutService
        from profd.testing.fake_engines import FakeSglangServer, FakeVllmServer

        # quick: a test's engines answer in milliseconds; give up on them in seconds
        timeouts = EngineTimeouts(connect_s=1.0, start_s=5.0, stop_s=5.0) if quick else None
        flush = FlushWait(settle_s=0.15, poll_s=0.03, timeout_s=5) if quick else None
        fake: Any
        if engine == "vllm":
            trace_dir = engine_trace_dir(root, replica)
            launch = vllm_launch_settings(EngineProfileOptions(), str(trace_dir), VLLM_VERIFIED)
            fake = FakeVllmServer.from_launch(launch, tp=tp)
            adapter: Any = VllmHttpEngine(fake.url, timeouts)
            agent = RolloutAgent(replica, (tp, 1, 1), adapter, vllm_launch=launch, flush=flush)
        else:
            fake = FakeSglangServer(tp, default_output_dir=Path(root) / f"sglang-{replica}")
            adapter = SglangHttpEngine(fake.url, timeouts)
            agent = RolloutAgent(replica, (tp, 1, 1), adapter, flush=flush)
        self.fake = fake.__enter__()
        self.service = RolloutService(agent, replicas=replicas, colocated=colocated).start()

    def connected(self) -> bool:
        return self.service.connected

    def advance(self, n: int) -> int:
        """Generation: ``n`` engine iterations; returns the engine's iteration count."""
        self.fake.advance(n)
        return self.fake.forward_ct

    def engine_calls(self, path: str) -> int:
        """How many times the engine's ``path`` (e.g. ``/stop_profile``) was called."""
        return sum(1 for _, p, _ in self.fake.requests if p == path)

    def kill_engine(self) -> None:
        """The engine's endpoint goes away (the replica's agent stays)."""
        self.fake.kill()

    def close(self) -> None:
        self.service.close(timeout=30)
        self.fake.__exit__(None, None, None)
