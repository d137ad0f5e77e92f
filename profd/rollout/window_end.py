"""A rollout window's end: stop the engine, wait for its files, relocate and judge them.

Split from :mod:`profd.rollout.rollout_agent` (which opens windows and calls this when one
ends). Nothing here raises on an engine failure: each becomes the outcome's reason or a
warning. No Ray import.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from profd.core.clock_hints import record_window_files
from profd.core.states import PartState
from profd.rollout.engine_args import VLLM_START_BODY_SINCE, parse_vllm_version
from profd.rollout.engines import EngineError, EngineErrorKind
from profd.rollout.relocate import (
    DirWatcher,
    FlushWait,
    IncompleteFile,
    RelocatedFile,
    collect_engine_files,
    is_chrome_trace,
    is_side_file,
)
from profd.rollout.windows import WindowMode, WindowOutcome

if TYPE_CHECKING:
    from profd.rollout.rollout_agent import RolloutAgent

__all__ = [
    "OpenWindow",
    "StoppedWindow",
    "collect_stopped_window",
    "stop_open_window",
    "window_outcome",
]

log = logging.getLogger(__name__)


@dataclass
class OpenWindow:
    """A window open on a replica, from its start to the end of its finish."""

    session_id: str
    session_dir: Path
    window_dir: Path
    baseline: dict[str, tuple[int, int]]
    keep: frozenset[int] | None
    mode: WindowMode
    relocate: bool
    started_at: float
    #: The job's steps the window records (when its caller says; noted beside the files).
    steps: tuple[int, ...] = ()
    warnings: list[str] = field(default_factory=list)
    start_error: str | None = None
    #: The start timed out: the engine may have started anyway.
    start_uncertain: bool = False
    #: Wall clock just before and just after the engine's start call (for relative traces).
    start_call: tuple[float, float] | None = None
    finishing: bool = False


@dataclass
class StoppedWindow:
    """A window whose engine was stopped; its files are yet to be collected
    (:func:`collect_stopped_window`), possibly while the replica's next window records."""

    window: OpenWindow
    problems: list[str]
    warnings: list[str]
    policy: FlushWait
    stopped: bool
    #: Which files are the window's: watched from the stop on, frozen when the engine's
    #: next window starts (None: nothing to watch, the engine never started).
    watcher: DirWatcher | None = None
    #: Set once its files were collected (``outcome``); ``taken``: a collection began.
    collected: threading.Event = field(default_factory=threading.Event)
    outcome: WindowOutcome | None = None
    taken: bool = False


def stop_open_window(
    agent: RolloutAgent, w: OpenWindow, on_stopped: Callable[[], None] | None = None
) -> StoppedWindow | WindowOutcome:
    """Stop the engine's profiler; the outcome at once when the window never started.
    ``on_stopped``: called once the engine's profiler is stopped (or its stop failed),
    before the wait for files: a driver waiting on the stop goes on then, not seconds later
    when the files have settled."""
    problems: list[str] = []
    warnings = list(w.warnings)
    if w.start_error:
        if w.start_uncertain:
            warnings.append(_stop_quietly(agent))
        _told(on_stopped)
        return window_outcome(agent, w.session_id, w.mode, [w.start_error], warnings, w.started_at)
    policy = agent.flush
    stopped = False
    try:
        warnings.extend(agent.engine.stop())
        stopped = True
    except EngineError as exc:
        problems.append(f"stop failed: {exc.reason}")
        if exc.kind is EngineErrorKind.UNREACHABLE:
            # The engine is gone: take what is on disk without waiting for more.
            policy = policy.model_copy(update={"first_file_timeout_s": policy.settle_s})
    except Exception as exc:
        log.exception("replica %d: engine stop raised", agent.replica_index)
        problems.append(f"stop failed: {type(exc).__name__}: {exc}")
    watcher = DirWatcher(w.window_dir, w.baseline, policy.check_gzip)
    watcher.scan(time.monotonic())  # the window's files so far (the next start freezes it)
    _told(on_stopped)
    return StoppedWindow(w, problems, warnings, policy, stopped, watcher)


def collect_stopped_window(agent: RolloutAgent, s: StoppedWindow) -> WindowOutcome:
    """Wait for the stopped window's files, relocate them and judge the window."""
    w, problems, warnings = s.window, list(s.problems), list(s.warnings)
    waited, reloc = collect_engine_files(
        w.window_dir,
        w.baseline,
        watcher=s.watcher,
        replica=agent.replica_index,
        parallelism=agent.parallelism,
        session_dir=w.session_dir,
        keep_global_ranks=w.keep,
        policy=s.policy,
        expected=_expected_files(agent),
        move=w.relocate,
    )
    warnings.extend(reloc.warnings)
    warnings.extend(_record_start(agent, w, reloc.files))
    unfinished = [i for i in reloc.incomplete if not is_side_file(Path(i.path).name)]
    if not reloc.files and not unfinished:
        frozen = s.watcher is not None and s.watcher.frozen
        problems.append(_no_files_reason(agent, w, s.policy, s.stopped, frozen))
    if unfinished:
        problems.append(
            f"{len(unfinished)} file(s) still being written after {waited.waited_s:g}s; "
            f"left in {w.window_dir}"
        )
    warnings.extend(
        f"side file {Path(i.path).name} was still being written; left in {w.window_dir}"
        for i in reloc.incomplete
        if i not in unfinished
    )
    warnings.extend(
        f"side file {name} was written again by the engine's next window before it "
        f"settled: left to that window, in {w.window_dir}"
        for name in (s.watcher.given_up if s.watcher is not None else ())
    )
    problems.extend(_missing_ranks(agent, w, reloc.files, warnings))
    return window_outcome(
        agent,
        w.session_id,
        w.mode,
        problems,
        warnings,
        w.started_at,
        reloc.moved,
        reloc.kept_in_subdir,
        tuple(unfinished),
        reloc.side_files,
    )


def _told(on_stopped: Callable[[], None] | None) -> None:
    if on_stopped is None:
        return
    try:
        on_stopped()
    except Exception:  # whoever waits is told by the caller instead; the files still matter
        log.exception("telling that the engine stopped failed")


def _record_start(agent: RolloutAgent, w: OpenWindow, files: Sequence[RelocatedFile]) -> list[str]:
    """Note beside the files when their recording started, so a trace without a wall
    clock of its own can still be placed on the session's timeline."""
    if w.start_call is None or not files:
        return []
    by_dir: dict[Path, list[str]] = {}
    for f in files:
        by_dir.setdefault(Path(f.path).parent, []).append(Path(f.path).name)
    source = f"start of replica {agent.replica_index}'s profiling window"
    try:
        for directory, names in by_dir.items():
            record_window_files(directory, names, *w.start_call, source, w.steps)
    except (OSError, ValueError) as exc:
        log.warning("replica %d: cannot record the window start: %s", agent.replica_index, exc)
        return [f"the window's start time was not recorded beside the traces: {exc}"]
    return []


def _stop_quietly(agent: RolloutAgent) -> str:
    """Stop an engine whose start timed out, so it does not record until the next
    session; its files, if any, stay in the engine's directory."""
    try:
        agent.engine.stop()
    except Exception as exc:
        return f"stop after the timed-out start also failed: {exc}"
    return "sent a stop after the timed-out start, in case the engine started anyway"


def _expected_files(agent: RolloutAgent) -> int:
    extra = 1 if agent.vllm_launch is not None and agent.vllm_launch.frontend_trace else 0
    return agent.world_size + extra


def _no_files_reason(
    agent: RolloutAgent, w: OpenWindow, policy: FlushWait, stopped: bool, frozen: bool = False
) -> str:
    if not stopped:  # the stop's own failure says why; what is on disk was looked at
        return f"no trace file in {w.window_dir}"
    reason = (
        f"no trace file in {w.window_dir} when its stop returned (the engine's next window "
        "has started: what appears now is that window's)"
        if frozen
        else f"no trace file appeared in {w.window_dir} within "
        f"{policy.first_file_timeout_s:g}s after stop"
    )
    if agent.engine.flavor == "vllm":
        reason += (
            " (vLLM writes nothing when the window ended before delay_iterations engine "
            "iterations ran"
        )
        if not _vllm_writes_every_window(agent):
            reason += (
                ", and before 0.32 is known to write nothing after a repeated start/stop "
                "in one server process"
            )
        reason += ")"
    return reason


def _vllm_writes_every_window(agent: RolloutAgent) -> bool:
    """vLLM 0.32 (verified) writes files on every window of one server process."""
    version = getattr(agent.engine, "server_version", lambda: None)()
    if version is None and agent.vllm_launch is not None and agent.vllm_launch.version:
        version = parse_vllm_version(agent.vllm_launch.version)
    return version is not None and version >= VLLM_START_BODY_SINCE


def _missing_ranks(
    agent: RolloutAgent, w: OpenWindow, files: Sequence[RelocatedFile], warnings: list[str]
) -> list[str]:
    """Requested global ranks of this replica that no file was identified for."""
    if w.keep is None or not files:
        return []  # without files the reason already says so
    # a rank is found by its timeline; a memory snapshot alone does not count
    found = {f.global_rank for f in files if is_chrome_trace(Path(f.path).name)}
    missing = [g for g in sorted(w.keep) if g in agent.global_ranks and g not in found]
    if not missing:
        return []
    if None in found:
        warnings.append(
            f"global rank(s) {missing} cannot be told apart in the engine's file names; "
            f"replica {agent.replica_index}'s files are named by replica only"
        )
        return []
    return [f"no trace for requested global rank(s) {missing}"]


def window_outcome(
    agent: RolloutAgent,
    session_id: str,
    mode: WindowMode,
    problems: list[str],
    warnings: list[str],
    started_at: float | None,
    traces: tuple[RelocatedFile, ...] = (),
    kept: tuple[RelocatedFile, ...] = (),
    incomplete: tuple[IncompleteFile, ...] = (),
    side_files: tuple[str, ...] = (),
) -> WindowOutcome:
    reason = "; ".join(dict.fromkeys(problems))
    return WindowOutcome(
        session_id=session_id,
        replica_index=agent.replica_index,
        state=PartState.PARTIAL if problems else PartState.DONE,
        reason=f"replica {agent.replica_index}: {reason}" if reason else "",
        mode=mode,
        traces=traces,
        kept_in_subdir=kept,
        incomplete=incomplete,
        side_files=side_files,
        warnings=tuple(dict.fromkeys(warnings)),
        started_at=started_at,
        finished_at=agent.clock(),
    )
