"""A stopped torch window on its way to disk: Kineto's JSON export, ordered against profiler
starts (:class:`KinetoGate`), then gzip, the device-event scan and publishing
(:class:`TorchOutput`), all off the training thread when the window ended with its
collection."""

from __future__ import annotations

import contextlib
import json
import operator
import re
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from profd.backends.base import CollectionSpec, HeldSteps, PendingOutput, WrittenFile
from profd.core.files import TRACE_EXT, free_name, gzip_file, link_new, temp_path

__all__ = [
    "DEVICE_EVENTS",
    "DEVICE_LAUNCHES",
    "KINETO_GATE",
    "NO_DEVICE_EVENTS",
    "KinetoGate",
    "TorchOutput",
]

#: Kineto categories of events recorded on the device (not launches seen from the CPU).
DEVICE_EVENTS = re.compile(rb'"cat"\s*:\s*"(?:kernel|gpu_memcpy|gpu_memset)"')
#: A CUDA (or HIP: roctracer's calls are ``cuda_runtime`` too) call that puts work on the
#: device (a kernel launch, a copy, a memset), seen from the CPU, in either of Kineto's
#: layouts (cat and name on one line or two).
DEVICE_LAUNCHES = re.compile(
    rb'"cat"\s*:\s*"cuda_(?:runtime|driver)"\s*,\s*"name"\s*:\s*"(?:cu|hip)\w*'
    rb"(?:Launch|Memcpy|Memset)"
)
NO_DEVICE_EVENTS = (
    "asked for CUDA activity and the window launched device work, but the trace holds no "
    "device events (CUPTI taken by another subscriber? check NVTX_INJECTION64_PATH and other "
    "profilers in the process)"
)


class KinetoGate:
    """Orders Kineto's trace exports against profiler starts in this process.

    Kineto's export is not safe while a profiler starts in the same process (adding the new
    window's trace metadata races with the export and corrupts the heap), and torch.profiler
    is process-wide. So profd keeps one rule: **a window's trace is exported off the training
    thread only while no profiler runs here.** A window that ends registers its export
    (:meth:`hold`, on the training thread, inside ``close()``) before anything else can start;
    the next profiler start first waits until no registered export is left
    (:meth:`wait_clear`), at most ``wait_s`` seconds; past that it raises, so that window is
    reported as failed and training goes on, rather than risk the heap.

    The step the start waits for is Kineto's ``export_chrome_trace`` (``_ProfilerResult.save``)
    only: gzip, the device-event scan and publishing run after :meth:`release`.
    """

    def __init__(self, wait_s: float = 60.0) -> None:
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._pending = 0

    @property
    def pending(self) -> int:
        """Exports registered and not finished yet."""
        return self._pending

    def hold(self) -> None:
        with self._cond:
            self._pending += 1

    def release(self) -> None:
        with self._cond:
            self._pending -= 1
            self._cond.notify_all()

    def wait_clear(self) -> float:
        """Wait until no export is registered; return the seconds waited."""
        started = time.perf_counter()
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending == 0, timeout=self.wait_s):
                raise RuntimeError(
                    f"the previous torch window's trace was still being exported after "
                    f"{self.wait_s:g} s; this window is not recorded (Kineto's export must "
                    "not overlap a profiler start)"
                )
        return time.perf_counter() - started


#: The gate of this process (torch.profiler is process-wide, so is its export).
KINETO_GATE = KinetoGate()


class TorchOutput(PendingOutput):
    """One saved window: Kineto's JSON, then gzip and publishing, all in :meth:`write`.

    ``deferred`` (the window ended with the collection): the trace stays in Kineto's memory
    until :meth:`write` exports it on the exporter thread, under :data:`KINETO_GATE`.
    Otherwise (a window a schedule saved while the profiler restarts in the same ``step()``)
    the plain JSON is written at once, on the training thread, as before the gate existed.
    """

    def __init__(
        self,
        window: Any,
        spec: CollectionSpec,
        suffix: str,
        expect_device: bool,
        notes: tuple[str, ...] = (),
        deferred: bool = False,
    ) -> None:
        self._spec = spec
        self._suffix = suffix
        self._expect_device = expect_device
        self._notes = notes
        self._error: Exception | None = None
        self._raw = temp_path(spec.save_dir, spec.stem, ".json")
        self._window: Any = None
        self._unhold: Any = None
        if deferred:
            KINETO_GATE.hold()
            self._window = window
            # an output dropped unwritten must not keep every later window from starting
            self._unhold = weakref.finalize(self, KINETO_GATE.release)
        else:
            try:
                self._export(window)
            except Exception as exc:  # reported by write(), on the exporter thread
                self._error = exc

    def _export(self, window: Any) -> None:
        try:
            self._spec.save_dir.mkdir(parents=True, exist_ok=True)
            window.export_chrome_trace(str(self._raw))
        except BaseException:
            with contextlib.suppress(OSError):
                self._raw.unlink(missing_ok=True)
            raise

    def discard(self) -> None:
        """Never written: its temporary file goes, and the gate lets the next start in."""
        self._window = None
        if self._unhold is not None:
            self._unhold()
            self._unhold = None
        self._raw.unlink(missing_ok=True)

    def write(self, held: HeldSteps | None = None) -> list[WrittenFile]:
        if self._unhold is not None:
            window, self._window = self._window, None
            try:
                self._export(window)
            finally:
                del window  # free the events as soon as they are on disk
                self._unhold()  # runs release() once
                self._unhold = None
        if self._error is not None:
            raise self._error
        return self._pack(_header_steps(self._spec.metadata, held))

    def _pack(self, rewrite: list[tuple[bytes, bytes]]) -> list[WrittenFile]:
        """gzip and publish; the trace's ``traceName`` (Kineto wrote the temporary file's
        name) becomes the published name, so a second writer of the name means packing again.
        ``rewrite``: more ``(old, new)`` swaps on the way (the header's steps)."""
        spec = self._spec
        packed = temp_path(spec.save_dir, spec.stem, TRACE_EXT)
        index = 0
        try:
            while True:
                final, index = free_name(spec.save_dir, spec.stem, self._suffix, TRACE_EXT, index)
                found = gzip_file(
                    self._raw,
                    packed,
                    find=(DEVICE_EVENTS, DEVICE_LAUNCHES) if self._expect_device else (),
                    replace=[(_trace_name(self._raw), _trace_name(final)), *rewrite],
                )
                if link_new(packed, final):
                    break
                index += 1
        finally:
            self._raw.unlink(missing_ok=True)
            packed.unlink(missing_ok=True)
        suffix = final.name[len(spec.stem) : -len(TRACE_EXT)]
        warnings = self._notes
        # launches without device events: CUPTI recorded nothing. A window that launched
        # nothing (a CPU-only role on a GPU machine) has none to record.
        has_device, launched = found or (False, False)
        if launched and not has_device:
            warnings = (*warnings, NO_DEVICE_EVENTS)
        return [WrittenFile(final, final.stat().st_size, suffix, warnings)]


def _header_steps(metadata: Mapping[str, Any], held: HeldSteps | None) -> list:
    """The swap that adds what the window holds of the loop's steps (known only once it
    ended) to the ``profd`` header, which Kineto wrote verbatim as preset at the start. A
    step that is not an integer (the loop's own numbering) leaves the header as it was."""
    own = metadata.get("profd")
    if held is None or not isinstance(own, dict):
        return []
    try:  # numpy's integers too: json writes only Python's
        new = {**own, "steps": [operator.index(s) for s in held.whole]}
        if held.began_in is not None:
            new["began_in_step"] = operator.index(held.began_in)
    except TypeError:
        return []
    key = b'"profd": '
    return [(key + json.dumps(own).encode(), key + json.dumps(new).encode())]


def _trace_name(path: Path) -> bytes:
    """Kineto's ``"traceName": "<path>"`` entry for a file at ``path``."""
    return b'"traceName": ' + json.dumps(str(path)).encode()
