"""Shared set-up for the rollout agent tests: a fake engine plus the agent driving it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from profd.rollout import (
    EngineProfileOptions,
    EngineTimeouts,
    FlushWait,
    RolloutAgent,
    SglangHttpEngine,
    VllmHttpEngine,
    engine_trace_dir,
    vllm_launch_settings,
)
from profd.testing.fake_engines import FakeSglangServer, FakeVllmServer

FAST = FlushWait(
    settle_s=0.15, poll_s=0.03, timeout_s=5, first_file_timeout_s=0.6, peer_grace_s=0.5
)
QUICK = EngineTimeouts(connect_s=1.0, start_s=5.0, stop_s=5.0)


def vllm_pair(
    tmp_path: Path,
    replica: int = 0,
    tp: int = 2,
    dp: int = 1,
    pp: int = 1,
    *,
    version: str | None = "0.32.0",
    launch_opts: EngineProfileOptions | None = None,
    frontend_trace: bool = False,
    timeouts: EngineTimeouts = QUICK,
    flush: FlushWait = FAST,
    **fake_kw: Any,
) -> tuple[FakeVllmServer, RolloutAgent]:
    """A vLLM fake launched with profd's launch settings, and the agent for it (the fake is
    not started yet)."""
    trace_dir = engine_trace_dir(tmp_path / "root", replica)
    launch = vllm_launch_settings(
        launch_opts or EngineProfileOptions(),
        str(trace_dir),
        version,
        frontend_trace=frontend_trace,
    )
    fake = FakeVllmServer.from_launch(launch, tp, dp, pp, **fake_kw)
    engine = VllmHttpEngine(fake.url, timeouts)
    agent = RolloutAgent(replica, (tp, dp, pp), engine, vllm_launch=launch, flush=flush)
    return fake, agent


def sglang_pair(
    tmp_path: Path,
    replica: int = 0,
    tp: int = 2,
    dp: int = 1,
    pp: int = 1,
    *,
    timeouts: EngineTimeouts = QUICK,
    flush: FlushWait = FAST,
    server_env: dict[str, str] | None = None,
    **fake_kw: Any,
) -> tuple[FakeSglangServer, RolloutAgent]:
    fake = FakeSglangServer(tp, dp, pp, default_output_dir=tmp_path / "sglang-default", **fake_kw)
    engine = SglangHttpEngine(fake.url, timeouts, server_env=server_env)
    agent = RolloutAgent(replica, (tp, dp, pp), engine, flush=flush)
    return fake, agent


def names(directory: Path) -> list[str]:
    """The visible files (profd's hidden window record is not a trace)."""
    if not directory.exists():
        return []
    return sorted(p.name for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
