"""The real vLLM server dies (SIGKILL of its whole process group) while profd's window on it
is open. Runs last of the engine suite (conftest's collection hook orders the tests using
``vllm_server_to_kill`` last): it kills the suite's one server.

What the engine leaves (tests/fixtures/vllm/FACTS.md (f)): with no export running, nothing at
all — the profile lived in the worker's memory; killed during an export, a truncated gzip
under the final name.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from profd.rollout.relocate import gzip_complete, is_trace_file

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

PROMPT = [1, 5, 7, 9]
FAILURE = re.compile(r"stop failed|unreachable|no trace file", re.IGNORECASE)


def test_engine_killed_mid_window_ends_the_part_partial_without_blocking_the_job(
    engine_job, vllm_server_to_kill
) -> None:
    job = engine_job
    srv = vllm_server_to_kill
    view = job.create({"steps": job.ahead(), "roles": {"rollout": {"ranks": [0]}}})
    (window,) = view.steps
    while job.step_no + 1 < window:
        job.step()

    killed_at: list[float] = []

    def generate_then_die() -> None:
        # engine iterations inside the open window, then the engine is gone
        usage = job.generate(PROMPT, 8)()
        assert usage["completion_tokens"] == 8
        assert srv.alive()
        srv.kill()
        assert not srv.alive()
        killed_at.append(time.monotonic())

    assert job.step(generate_then_die) == window
    _, _, _, exit_s = job.steps[-1]
    # The driver's step exit waits for the replica to stop its engine; a dead engine costs
    # at most the agent's own limits (connect + stop, then the first-file wait), never the
    # controller's rollout timeout.
    budget = job.timeouts.connect_s + job.timeouts.stop_s + job.flush.first_file_timeout_s
    assert exit_s < budget + 5, f"step exit took {exit_s:.1f}s (limits: {budget:g}s)"

    view = job.run_to_end(view, lambda n: None, timeout_s=60)
    assert view.state.value in ("partial", "failed"), (view.state.value, view.reason)
    (part,) = [t for t in view.targets if t.role == "rollout"]
    assert part.state.value in ("partial", "failed", "missed"), part
    assert window in part.missed_steps and window not in part.recorded_steps, part
    assert FAILURE.search(part.reason) or FAILURE.search(view.reason), (part.reason, view.reason)
    assert time.monotonic() - killed_at[0] < 60  # the session ended well within a minute

    # Nothing half-written is indexed: no trace for the session, every known trace complete.
    assert view.traces == [] and part.traces == []
    assert job.call("list_traces", view.session_id) == []
    for t in job.call("list_traces"):
        assert gzip_complete(t.path), f"indexed trace {t.path} is not a finished gzip"
    session_files = [p for p in Path(view.save_dir).rglob("*") if is_trace_file(p.name)]
    assert not session_files, session_files

    # The job goes on: the replica's agent is still there and steps cost nothing.
    import ray

    assert ray.get(job.replica.connected.remote(), timeout=30)
    job.step()
    assert job.steps[-1][3] < 2.0
