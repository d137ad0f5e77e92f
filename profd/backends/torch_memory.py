"""The ``torch_memory`` backend: CUDA allocator history and snapshots (reference §5.5).

A window turns allocator-history recording on (``trace_alloc_max_entries`` entries) and takes
one snapshot when it closes — one per profiled step, since profd never groups this tool's
steps. While a window is open an out-of-memory observer dumps a snapshot too, named
``<stem>_oom<N>.pickle``, so the allocation that failed is on disk even if the job dies.

Unlike verl, nothing is switched on when a process merely *could* use the tool (reference
§13 item 7): history recording starts with a window and stops with it.

torch ≥ 2.1 records full stacks and has no stack-depth knob; ``stack_depth`` is accepted for
verl config compatibility and has no effect.

The CUDA calls go through :class:`CudaMemoryApi` so tests can drive the backend on machines
without a GPU; on such machines the tool is refused with the reason, never faked.
"""

from __future__ import annotations

import logging
import pickle
import threading
from collections.abc import Mapping
from typing import Any

from profd.backends.base import (
    Backend,
    Collection,
    CollectionSpec,
    HeldSteps,
    PendingOutput,
    WrittenFile,
)
from profd.core.files import publish_unique, temp_path
from profd.core.request import ToolKind, TorchMemoryToolConfig

__all__ = ["CudaMemoryApi", "TorchMemoryBackend"]

log = logging.getLogger(__name__)

SNAPSHOT_EXT = ".pickle"


class CudaMemoryApi:
    """The few torch.cuda calls the backend needs (replaced in tests)."""

    def is_available(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def start_history(self, max_entries: int) -> None:
        import torch

        torch.cuda.memory._record_memory_history(max_entries=max_entries)

    def stop_history(self) -> None:
        import torch

        torch.cuda.memory._record_memory_history(enabled=None)

    def snapshot(self) -> Any:
        import torch

        return torch.cuda.memory._snapshot()

    def attach_oom_observer(self, callback: Any) -> bool:
        import torch

        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is None:
            return False
        attach(callback)
        return True


class _OomHook:
    """torch has no way to detach an OOM observer: attach once per process, route to the
    collection that is open at the time."""

    lock = threading.Lock()
    attached = False
    current: _MemoryCollection | None = None

    @classmethod
    def install(cls, api: CudaMemoryApi) -> None:
        with cls.lock:
            if not cls.attached:
                cls.attached = api.attach_oom_observer(cls._on_oom)

    @classmethod
    def _on_oom(cls, *args: Any) -> None:
        target = cls.current
        if target is not None:
            target.dump_oom()


class _SnapshotOutput(PendingOutput):
    def __init__(self, snapshot: Any, spec: CollectionSpec, suffix: str = "") -> None:
        self._snapshot = snapshot
        self._spec = spec
        self._suffix = suffix

    def write(self, held: HeldSteps | None = None) -> list[WrittenFile]:
        spec = self._spec
        spec.save_dir.mkdir(parents=True, exist_ok=True)
        tmp = temp_path(spec.save_dir, spec.stem, SNAPSHOT_EXT)
        try:
            with open(tmp, "wb") as f:
                pickle.dump(self._snapshot, f)
            final = publish_unique(tmp, spec.save_dir, spec.stem, self._suffix, SNAPSHOT_EXT)
        finally:
            tmp.unlink(missing_ok=True)
            self._snapshot = None
        return [WrittenFile(final, final.stat().st_size, self._suffix)]


class _MemoryCollection(Collection):
    def __init__(self, api: CudaMemoryApi, spec: CollectionSpec, options: TorchMemoryToolConfig):
        self._api = api
        self._spec = spec
        self._ready: list[PendingOutput] = []
        self._ooms = 0
        api.start_history(options.trace_alloc_max_entries)
        _OomHook.install(api)
        _OomHook.current = self

    def dump_oom(self) -> None:
        """On the allocating thread, at OOM: written at once, the process may not survive."""
        try:
            self._ooms += 1
            out = _SnapshotOutput(self._api.snapshot(), self._spec, f"_oom{self._ooms}")
            out.write()
        except Exception:
            log.exception("profd: writing the out-of-memory snapshot failed")

    def take_ready(self) -> list[PendingOutput]:
        ready, self._ready = self._ready, []
        return ready

    def close(self) -> list[PendingOutput]:
        if _OomHook.current is self:
            _OomHook.current = None
        try:
            snapshot = self._api.snapshot()
        finally:
            self._api.stop_history()
        return [_SnapshotOutput(snapshot, self._spec)]


class TorchMemoryBackend(Backend):
    kind = ToolKind.TORCH_MEMORY
    thread_free = True
    api: CudaMemoryApi = CudaMemoryApi()

    def __init__(self, options: Mapping[str, Any] | TorchMemoryToolConfig | None = None) -> None:
        if isinstance(options, TorchMemoryToolConfig):
            self.options = options
        else:
            self.options = TorchMemoryToolConfig.model_validate(dict(options or {}))

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            ok = cls.api.is_available()
        except Exception as exc:
            return f"torch.cuda cannot be queried: {exc}"
        return None if ok else "CUDA is not available in this process"

    def open(self, spec: CollectionSpec) -> Collection:
        return _MemoryCollection(self.api, spec, self.options)
