"""The ``torch`` backend: torch.profiler (Kineto) windows, exported off the training thread.

Reference §5 semantics: CPU activity is always on (stage ranges need it); CUDA is added when
``contents`` is empty or names ``cuda`` *and* CUDA exists in this process; ``shapes`` /
``memory`` / ``stack`` map to ``record_shapes`` / ``profile_memory`` / ``with_stack``. No
``ProfilerStep#`` rows are emitted. Metadata (``distributedInfo`` and profd's keys) is added
while the profiler runs, because torch drops metadata added after ``stop()``.

Export: torch's own ``.json.gz`` export gzips at level 9 on the calling thread (about 9 s per
100 MB here). When a window ends profd only stops the profiler on the training thread; Kineto's
JSON export, gzip at level 6 and publishing run on the agent's exporter thread. Kineto's export
must not overlap the next profiler start in the process (see ``torch_output.KinetoGate``),
so that start waits for it. Windows a schedule saves while the collection stays open (the profiler
restarts inside the same ``step()``) are still exported on the training thread.

Two limits, measured (``bench/export.py``): ``_disable_profiler`` inside ``stop()`` turns the
recorded events into Kineto's trace and costs more than the JSON export itself; it must run on
the thread that started the profiler (with ``profile_all_threads`` another thread may call it,
but it holds the GIL throughout, so the training thread waits as long). ``trace_only``
(where torch has it; not with ``with_stack``) skips building Python-side events nobody here
reads and shortens it by about a quarter. And Kineto's export holds the GIL: a CPU-bound
loop waits for it anyway, a loop blocked on its device (GIL released) does not.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import warnings
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from profd.backends.base import (
    Backend,
    Collection,
    CollectionSpec,
    PendingOutput,
)
from profd.backends.torch_output import KINETO_GATE, TorchOutput
from profd.backends.torch_threads import (
    ORPHANS,
    OneProfilerPerProcess,
    end_orphaned_windows,
    orphaned_here,
)
from profd.core.request import ToolKind, TorchToolConfig
from profd.core.schedule import window_suffix

__all__ = [
    "TorchBackend",
    "end_orphaned_windows",
    "orphaned_here",
    "torch_profiler_kwargs",
]

log = logging.getLogger(__name__)


_warm_started = threading.Event()


def warm_up_profiler() -> None:
    """Import on a daemon thread, once per process, what the first ``torch.profiler`` start
    imports: ``prepare_trace`` asks ``hasattr(torch, "_inductor")``, which imports inductor
    and dynamo, 1.2-2 s that blocked the training thread at its first window. Called when a
    torch window is planned (steps ahead, as a rule); the imports then share the GIL with
    training (its longest wait measured here: 72 ms) and that start takes milliseconds. A
    window that starts before the imports finish waits for them, as it did before."""
    import sys

    if _warm_started.is_set():
        return
    _warm_started.set()
    if "torch._dynamo" in sys.modules or "torch._inductor" in sys.modules:
        # Imported (nothing to do), or being imported by the job itself (torch.compile):
        # a second thread importing those packages, which import each other, could meet
        # it in CPython's import locks, and its import fail in the user's thread.
        return

    def run() -> None:
        try:
            import torch._inductor.config  # noqa: F401  (what prepare_trace would import)
        except Exception as exc:  # never-break-training boundary: the start imports it anyway
            log.debug("profd: warming the profiler up failed: %r", exc)

    try:
        threading.Thread(target=run, name="profd-profiler-warm-up", daemon=True).start()
    except RuntimeError as exc:  # no thread to be had: the window's start imports them
        log.debug("profd: no thread to warm the profiler up: %r", exc)


def torch_profiler_kwargs(options: TorchToolConfig, cuda_available: bool) -> dict[str, Any]:
    """Map ``contents`` to torch.profiler arguments (the user's list is never modified)."""
    import torch.profiler as tp

    activities = [tp.ProfilerActivity.CPU]
    if options.with_cuda and cuda_available:
        activities.append(tp.ProfilerActivity.CUDA)
    kwargs: dict[str, Any] = {
        "activities": activities,
        "record_shapes": options.record_shapes,
        "profile_memory": options.profile_memory,
        "with_stack": options.with_stack,
    }
    if not options.with_stack:  # torch turns trace_only off (with a warning) under with_stack
        config = _trace_only_config()
        if config is not None:
            kwargs["experimental_config"] = config
    return kwargs


def _trace_only_config() -> Any:
    """``_ExperimentalConfig(trace_only=True)`` where this torch has it, else ``None``.

    The exported trace is the same (checked event by event); only the Python-side events
    (``prof.events()``, ``key_averages()``), which profd never reads, are not built."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(trace_only=True)
    except (ImportError, TypeError):  # an older torch without it
        return None


def _distributed_info_present() -> bool:
    """torch adds ``distributedInfo`` itself when torch.distributed is initialised."""
    try:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()
    except (ImportError, RuntimeError):  # a torch built without distributed support
        return False


NO_CUDA_HERE = "contents asked for cuda but this worker has no CUDA device: recorded CPU only"


def _quiet(fn: Any, **kwargs: Any) -> Any:
    """Call a torch.profiler constructor without its schedule warnings ("won't be using
    warmup", "clears events at the end of each cycle"): profd exports every window on its
    own and a schedule without warmup is the user's explicit choice."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(warmup|clears events).*")
        return fn(**kwargs)


class _TorchCollection(Collection):
    """A torch.profiler run; with a schedule it may save several windows while open."""

    def __init__(
        self, spec: CollectionSpec, kwargs: dict[str, Any], notes: tuple[str, ...] = ()
    ) -> None:
        self._notes = notes  # warnings every window of this collection carries
        end_orphaned_windows()  # this thread's own first: its start would be refused
        OneProfilerPerProcess.acquire(spec.stem)
        try:
            self.export_wait_s = KINETO_GATE.wait_clear()
            self._setup(spec, kwargs)
        except BaseException:
            OneProfilerPerProcess.release()
            raise

    def _setup(self, spec: CollectionSpec, kwargs: dict[str, Any]) -> None:
        import torch.profiler as tp

        self._spec = spec
        self._closed = False
        self._closing = False  # inside close(): the last window's export is deferred
        #: torch keeps a window's events with the thread that started it; only it can stop it.
        self._opener = threading.current_thread()
        self._discard = False  # stopped off its thread: what stop() hands over is empty
        self._orphaned = False  # refused off its live thread: stopped later (Orphans)
        self._record_function = tp.record_function
        self._ready: list[TorchOutput] = []
        self._saves = 0
        self._last_saved_step: int | None = None
        sched = spec.schedule
        if sched is not None:
            kwargs["schedule"] = _quiet(
                tp.schedule,
                wait=sched["wait"],
                warmup=sched["warmup"],
                active=sched["active"],
                repeat=sched["repeat"],
                skip_first=sched["skip_first"],
            )
        self._expect_device = tp.ProfilerActivity.CUDA in kwargs["activities"]
        self._prof = _quiet(tp.profile, on_trace_ready=self._on_trace_ready, **kwargs)
        self._prof.record_steps = False  # no ProfilerStep#N rows
        for key, value in spec.metadata.items():
            if key == "distributedInfo" and _distributed_info_present():
                continue
            # preset: torch adds it to every window it starts, not only the first
            self._prof.preset_metadata_json(key, json.dumps(value))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*(warmup|clears events).*")
            self._prof.start()

    def _on_trace_ready(self, prof: Any) -> None:
        """Runs inside torch's step()/stop(): only capture the window; export comes later."""
        if self._discard:
            return
        step_num = int(prof.step_num)
        suffix = window_suffix(
            step_num,
            self._last_saved_step,
            self._saves,
            self._spec.schedule,
            self._spec.name_mini_batches,
        )
        self._ready.append(
            TorchOutput(
                prof.profiler,
                self._spec,
                suffix,
                self._expect_device,
                self._notes,
                deferred=self._closing,
            )
        )
        self._saves += 1
        self._last_saved_step = step_num

    def annotate(self, label: str) -> AbstractContextManager[Any]:
        return self._record_function(label)

    def step(self) -> None:
        self._check_thread()  # a schedule's step() stops and restarts the profiler
        self._prof.step()

    def take_ready(self) -> list[PendingOutput]:
        ready, self._ready = self._ready, []
        return ready

    def close(self) -> list[PendingOutput]:
        # Stopping twice crashes Kineto: a second close (after a fault) only drains.
        if self._closed:  # (an orphan's saved windows are its stop's to discard)
            return [] if self._orphaned else self.take_ready()
        self._closed = True
        self._closing = True
        # torch saves a window cut short in RECORD on stop() (the partial-window flush).
        error = self._off_thread()
        if error is None:
            try:
                self._prof.stop()
            finally:
                OneProfilerPerProcess.release()
            return self.take_ready()
        if self._opener.is_alive():  # its thread stops it later (its stop here crashes)
            self._orphaned = True
            OneProfilerPerProcess.orphaned(self._opener.name)
            ORPHANS.add(self)
        else:
            self.stop_discarding()
        raise error

    @property
    def opener(self) -> threading.Thread:
        return self._opener

    def stop_discarding(self) -> None:
        """Stop a window refused off its thread, discarding what it recorded; frees the
        process's profiler slot. On its own thread that is a plain stop. After that thread
        ended, its state died with it: ``stop()`` finds no session and its result is empty
        (never exported: that crashed), but it ends Kineto's process-wide trace, whose
        leftover crashed the process at exit."""
        self._discard = True
        try:
            with contextlib.suppress(Exception):
                self._prof.stop()
        finally:
            OneProfilerPerProcess.release()
            ready, self._ready = self._ready, []
            for output in ready:  # windows a schedule saved before: never published
                with contextlib.suppress(OSError):
                    output.discard()

    def _check_thread(self) -> None:
        if (error := self._off_thread()) is not None:
            raise error

    def _off_thread(self) -> RuntimeError | None:
        """Why the profiler cannot be stopped here: off the thread that started it. torch's
        profiler state is that thread's: elsewhere ``stop()`` finds no session and returns
        an empty result whose export crashes the process (measured: a segmentation fault in
        ``export_chrome_trace``, when a job's training thread ended with a window open and
        the agent was closed from the main thread)."""
        opener, here = self._opener, threading.current_thread()
        if here is opener:
            return None
        if not opener.is_alive():
            return RuntimeError(
                f"the thread that started this torch window ({opener.name}) ended before the "
                "window did: torch.profiler keeps a window's events with that thread and only "
                "it can stop the window, so this trace is lost (end the step, or close the "
                "agent, on the training thread before it exits)"
            )
        return RuntimeError(
            f"this torch window was started on thread {opener.name} and is being ended on "
            f"{here.name}: torch.profiler can be stopped only on the thread that started it, "
            "so this trace is lost (mark steps and close the agent on one thread)"
        )


class TorchBackend(Backend):
    kind = ToolKind.TORCH

    def __init__(self, options: Mapping[str, Any] | TorchToolConfig | None = None) -> None:
        if isinstance(options, TorchToolConfig):
            self.options = options
        else:
            self.options = TorchToolConfig.model_validate(dict(options or {}))

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            import torch.profiler  # noqa: F401
        except Exception as exc:  # pragma: no cover - torch is a dependency
            return f"torch.profiler cannot be imported: {exc}"
        return None

    @property
    def schedule(self) -> dict[str, int] | None:
        sched = self.options.schedule
        return sched.model_dump() if sched is not None else None

    def open(self, spec: CollectionSpec) -> Collection:
        import torch

        cuda = torch.cuda.is_available()
        kwargs = torch_profiler_kwargs(self.options, cuda)
        notes = (NO_CUDA_HERE,) if "cuda" in self.options.contents and not cuda else ()
        return _TorchCollection(spec, kwargs, notes)


def read_trace(path: Path) -> dict[str, Any]:
    """Load a ``.json.gz`` / ``.json`` Chrome trace (used by tests and tools)."""
    import gzip

    import orjson

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        return orjson.loads(f.read())
