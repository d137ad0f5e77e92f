"""The rollout agent: one per inference replica; profiles it through the engine's own profiler.

It knows its replica (index, ``tp × dp × pp`` layout, global GPU ranks), drives the engine
through an adapter (:mod:`profd.rollout.engines`) and brings the engine's files into the
session directory (:mod:`profd.rollout.relocate`; a window's end is
:mod:`profd.rollout.window_end`). The training side decides when a window ends, so a window is
two calls:

* :meth:`RolloutAgent.start_window` — start the engine's profiler for a session;
* :meth:`RolloutAgent.finish_window` — stop it, wait for complete files, relocate them and
  return a :class:`WindowOutcome` (``done``, or ``partial`` with the reason).

:meth:`RolloutAgent.run_window` does both around a ``duration_s`` for rollout-only sessions.
Engines are profiled in discrete and continuous modes alike (verl silently skips them unless
discrete, reference §13 item 8). One window at a time: a replica is never profiled by two
sessions at once.

Nothing here raises on an engine failure: an endpoint that is down, a refused start, a stop
that hangs or a stop that leaves no files all become the outcome's reason. The calls block
(HTTP, file waits of up to :attr:`FlushWait.timeout_s`); a caller on an event loop runs them
in a thread. No Ray import.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from profd.core.request import ToolKind
from profd.rollout.engine_args import (
    EngineProfileOptions,
    VllmLaunchSettings,
    parse_vllm_version,
    vllm_launch_settings,
    vllm_window_warnings,
)
from profd.rollout.engines import EngineError, EngineErrorKind, EngineWindow, ProfilingEngine
from profd.rollout.relocate import (
    FlushWait,
    replica_subdir_name,
    snapshot_stats,
)
from profd.rollout.replicas import ReplicaParallelism
from profd.rollout.window_end import (
    OpenWindow,
    StoppedWindow,
    collect_stopped_window,
    stop_open_window,
    window_outcome,
)
from profd.rollout.windows import RolloutAgentInfo, WindowMode, WindowOutcome, WindowStart

__all__ = [
    "RolloutAgent",
    "RolloutAgentInfo",
    "WindowMode",
    "WindowOutcome",
    "WindowStart",
    "engine_trace_dir",
]  # the records live in profd.rollout.windows; re-exported for convenience

log = logging.getLogger(__name__)

_ENGINE_TOOLS = (ToolKind.TORCH.value, ToolKind.NPU.value)


def _mode(mode: WindowMode | str) -> WindowMode:
    try:
        return WindowMode(mode)
    except ValueError:
        raise ValueError(f"mode: must be continuous or discrete, got {mode!r}") from None


def engine_trace_dir(save_root: str | Path, replica: int) -> Path:
    """Where a vLLM replica launched by profd writes (fixed for the server's lifetime); files
    are moved out of it into each session's directory."""
    return Path(save_root) / f"rollout-engine-replica{replica}"


class RolloutAgent:
    """Profiles one rollout replica through its engine. Thread-safe; blocking calls."""

    def __init__(
        self,
        replica_index: int,
        parallelism: ReplicaParallelism | tuple[int, int, int] | dict,
        engine: ProfilingEngine,
        engine_kind: str | None = None,
        endpoint: str | None = None,
        trace_dir: str | Path | None = None,
        *,
        vllm_launch: VllmLaunchSettings | None = None,
        flush: FlushWait | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if (
            isinstance(replica_index, bool)
            or not isinstance(replica_index, int)
            or replica_index < 0
        ):
            raise ValueError(f"replica_index: must be an int >= 0, got {replica_index!r}")
        self.replica_index = replica_index
        self.parallelism = ReplicaParallelism.of(parallelism)
        self.engine = engine
        self.engine_kind = str(engine_kind or engine.kind)
        self.endpoint = endpoint or engine.endpoint
        if trace_dir is None and vllm_launch is not None:
            trace_dir = vllm_launch.trace_dir
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self.vllm_launch = vllm_launch
        self._tell_engine_launch_version(vllm_launch)
        self.flush = flush or FlushWait()
        self.clock = clock  # the wall clock of window times (tests give their own)
        self._lock = threading.Lock()
        self._window: OpenWindow | None = None
        #: Windows stopped whose files are not collected yet (see :meth:`_after_earlier`).
        self._pending: list[StoppedWindow] = []
        self.windows_finished = 0

    # -- identity --------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.parallelism.world_size

    @property
    def global_ranks(self) -> range:
        w = self.world_size
        return range(self.replica_index * w, (self.replica_index + 1) * w)

    def describe(self) -> RolloutAgentInfo:
        caps: dict[str, str | None] = {
            t.value: None
            if t.value in _ENGINE_TOOLS
            else "rollout engines profile with their own torch profiler (torch or npu)"
            for t in ToolKind
        }
        r = self.global_ranks
        return RolloutAgentInfo(
            replica_index=self.replica_index,
            world_size=self.world_size,
            parallelism=self.parallelism.model_dump(),
            global_ranks=(r.start, r.stop),
            engine_kind=self.engine_kind,
            engine_flavor=self.engine.flavor,
            endpoint=self.endpoint,
            trace_dir=str(self.trace_dir) if self.trace_dir else None,
            capabilities=caps,
        )

    def launch_settings(
        self,
        options: EngineProfileOptions,
        vllm_version: str | None,
        *,
        frontend_trace: bool = False,
    ) -> VllmLaunchSettings:
        """vLLM launch settings for this replica (its engine reads them only at launch); they
        are remembered, so later sessions are told what the replica cannot change."""
        if self.engine.flavor != "vllm":
            raise ValueError(
                f"engine: launch settings are for vLLM replicas, not {self.engine.flavor}"
            )
        if self.trace_dir is None:
            raise ValueError("trace_dir: a vLLM replica needs a fixed trace directory")
        settings = vllm_launch_settings(
            options, str(self.trace_dir), vllm_version, frontend_trace=frontend_trace
        )
        self.vllm_launch = settings
        self._tell_engine_launch_version(settings)
        return settings

    def _tell_engine_launch_version(self, launch: VllmLaunchSettings | None) -> None:
        """A vLLM adapter falls back to the launch's version when /version is unreadable."""
        if launch is not None and launch.version and hasattr(self.engine, "launch_version"):
            self.engine.launch_version = parse_vllm_version(launch.version)

    def _after_earlier(self, earlier: list[StoppedWindow]) -> None:
        """Before a window starts in the directory of windows still being collected: which
        files are whose. An engine whose stop returns once its files are written (vLLM)
        wrote the earlier windows' files already (``stop_writes_files``): they are fixed
        now (their watchers take no file that appears from here on, the new window's, such
        as a token window's written before its stop), and the new window starts at once.
        Otherwise (SGLang's stop may answer before its files exist; a stop that failed),
        the new window starts once the earlier ones' files are in: collected here, or
        waited for when another thread collects them."""
        writes_at_stop = getattr(self.engine, "stop_writes_files", False)
        for p in earlier:
            if p.watcher is not None and p.stopped and writes_at_stop:
                p.watcher.freeze(time.monotonic())
            else:  # here, unless another thread collects it (it ends: its flush timeout)
                self.collect(p)

    @property
    def busy_with(self) -> str | None:
        """The session whose window is open on this replica, if any."""
        w = self._window
        return w.session_id if w is not None else None

    # -- windows ---------------------------------------------------------------------------
    def start_window(
        self,
        session_id: str,
        session_dir: str | Path,
        options: EngineProfileOptions,
        keep_global_ranks: Iterable[int] | None = None,
        mode: WindowMode | str = WindowMode.CONTINUOUS,
        *,
        relocate: bool = True,
        steps: Iterable[int] = (),
    ) -> WindowStart:
        """Start the engine's profiler for ``session_id``. Never raises on engine failure:
        a failed start is reported here and again by :meth:`finish_window`. ``steps``: the
        job's steps the window is for (noted beside its files, for the analysis)."""
        with self._lock:
            if self._window is not None:
                reason = (
                    f"replica {self.replica_index} is already profiling session "
                    f"{self._window.session_id}; one window at a time"
                )
                return WindowStart(session_id, self.replica_index, False, reason)
            window = self._open(
                session_id, Path(session_dir), options, keep_global_ranks, _mode(mode), relocate
            )
            window.steps = tuple(int(n) for n in steps)
            self._window = window
            earlier = [p for p in self._pending if p.window.window_dir == window.window_dir]
        if earlier:
            self._after_earlier(earlier)
            window.baseline = snapshot_stats(window.window_dir)  # (they are settled, or fixed)
        if window.start_error is None:
            try:
                engine_window = EngineWindow(str(window.window_dir), options)
                version = getattr(self.engine, "server_version", None)
                if version is not None:
                    version()  # read first, so the clock bracket holds the start call alone
                before = self.clock()
                window.warnings.extend(self.engine.start(engine_window))
                if options.window.start is None:
                    # recording begins with the call; with a delay (vLLM iterations, SGLang
                    # start_step) it begins later, at a moment profd does not see
                    window.start_call = (before, self.clock())
            except EngineError as exc:
                window.start_error = f"start failed: {exc.reason}"
                window.start_uncertain = exc.kind is EngineErrorKind.TIMEOUT
            except Exception as exc:  # an adapter bug must not reach the caller either
                log.exception("replica %d: engine start raised", self.replica_index)
                window.start_error = f"start failed: {type(exc).__name__}: {exc}"
        if window.start_error:
            log.warning(
                "replica %d, session %s: %s", self.replica_index, session_id, window.start_error
            )
        return WindowStart(
            session_id,
            self.replica_index,
            window.start_error is None,
            window.start_error or "",
            str(window.window_dir),
            tuple(window.warnings),
        )

    def _open(
        self,
        session_id: str,
        session_dir: Path,
        options: EngineProfileOptions,
        keep: Iterable[int] | None,
        mode: WindowMode,
        relocate: bool,
    ) -> OpenWindow:
        warnings: list[str] = []
        error = None
        if self.engine.output_dir_per_window:
            window_dir = session_dir / replica_subdir_name(self.replica_index)
        elif self.trace_dir is not None:
            window_dir = self.trace_dir
            if self.vllm_launch is not None:
                warnings.extend(vllm_window_warnings(self.vllm_launch, options))
        else:
            window_dir = session_dir / replica_subdir_name(self.replica_index)
            error = (
                "start failed: the engine writes where it was launched to write, and this "
                "agent was not told where (trace_dir)"
            )
        try:
            window_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            error = error or f"start failed: cannot create {window_dir}: {exc}"
        return OpenWindow(
            session_id=session_id,
            session_dir=session_dir,
            window_dir=window_dir,
            # Files already there belong to earlier windows (or flushed after their wait).
            baseline=snapshot_stats(window_dir),
            keep=None if keep is None else frozenset(int(g) for g in keep),
            mode=mode,
            relocate=relocate,
            started_at=self.clock(),
            warnings=warnings,
            start_error=error,
        )

    def finish_window(
        self, session_id: str, on_stopped: Callable[[], None] | None = None
    ) -> WindowOutcome:
        """Stop the engine's profiler, wait for its files, relocate them. Never raises.
        ``on_stopped``: called once the engine is stopped, before the wait for its files."""
        stopped = self.stop_window(session_id, on_stopped)
        return stopped if isinstance(stopped, WindowOutcome) else self.collect(stopped)

    def stop_window(
        self, session_id: str, on_stopped: Callable[[], None] | None = None
    ) -> StoppedWindow | WindowOutcome:
        """Stop the engine's profiler: the replica can start its next window at once, while
        :meth:`collect` (on any thread) waits for this one's files. The outcome at once when
        there is nothing to collect (no such window, a start that failed). Never raises."""
        with self._lock:
            window = self._window
            if window is None or window.session_id != session_id or window.finishing:
                why = (
                    f"the window of session {session_id} is already being finished"
                    if window is not None and window.session_id == session_id
                    else f"no window of session {session_id} is open on this replica"
                )
                return self._outcome(session_id, WindowMode.CONTINUOUS, [why], [], None)
            window.finishing = True
        try:
            stopped = stop_open_window(self, window, on_stopped)
        except Exception as exc:
            stopped = self._failed(window, exc)
        with self._lock:
            self._window = None
            if isinstance(stopped, WindowOutcome):
                self.windows_finished += 1
            else:
                self._pending.append(stopped)
        return stopped

    def collect(self, stopped: StoppedWindow) -> WindowOutcome:
        """Wait for a stopped window's files, relocate them and judge the window (on any
        thread; the replica's next window may record meanwhile); once per window (a second
        call waits for the first and answers the same). Never raises."""
        with self._lock:
            taken, stopped.taken = stopped.taken, True
        if taken:
            stopped.collected.wait()
            assert stopped.outcome is not None  # (set before collected)
            return stopped.outcome
        try:
            outcome = collect_stopped_window(self, stopped)
        except Exception as exc:
            outcome = self._failed(stopped.window, exc)
        with self._lock:
            self.windows_finished += 1
            if stopped in self._pending:
                self._pending.remove(stopped)
        stopped.outcome = outcome
        stopped.collected.set()
        return outcome

    def _failed(self, window: OpenWindow, exc: Exception) -> WindowOutcome:
        log.exception(
            "replica %d: finishing session %s failed", self.replica_index, window.session_id
        )
        return self._outcome(
            window.session_id,
            window.mode,
            [f"internal error: {type(exc).__name__}: {exc}"],
            window.warnings,
            window.started_at,
        )

    def run_window(
        self,
        session_id: str,
        session_dir: str | Path,
        options: EngineProfileOptions,
        duration_s: float,
        keep_global_ranks: Iterable[int] | None = None,
        mode: WindowMode | str = WindowMode.CONTINUOUS,
        *,
        cancel: threading.Event | None = None,
    ) -> WindowOutcome:
        """A ``duration_s`` window (rollout-only sessions); ``cancel`` ends it early."""
        if duration_s <= 0:
            raise ValueError(f"duration_s: must be > 0, got {duration_s}")
        started = self.start_window(session_id, session_dir, options, keep_global_ranks, mode)
        if started.ok:
            (cancel or threading.Event()).wait(duration_s)
        return self.finish_window(session_id)

    # -- internals -------------------------------------------------------------------------
    def _outcome(
        self,
        session_id: str,
        mode: WindowMode,
        problems: list[str],
        warnings: list[str],
        started_at: float | None,
    ) -> WindowOutcome:
        return window_outcome(self, session_id, mode, problems, warnings, started_at)
