"""The ``torch`` backend: torch.profiler (Kineto) windows, exported off the training thread.

Reference §5 semantics: CPU activity is always on (stage ranges need it); CUDA is added when
``contents`` is empty or names ``cuda`` *and* CUDA exists in this process; ``shapes`` /
``memory`` / ``stack`` map to ``record_shapes`` / ``profile_memory`` / ``with_stack``. No
``ProfilerStep#`` rows are emitted. Metadata (``distributedInfo`` and profd's keys) is added
while the profiler runs, because torch drops metadata added after ``stop()``.

Export: torch's own ``.json.gz`` export gzips at level 9 on the calling thread (about 9 s per
100 MB here). The training thread here only calls ``stop()``; JSON export and gzip run on the
agent's exporter thread.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from profd.backends.base import (
    Backend,
    Collection,
    CollectionSpec,
    PendingOutput,
    WrittenFile,
)
from profd.config import ToolKind, TorchToolConfig
from profd.files import TRACE_EXT, gzip_file, publish_unique, temp_path

__all__ = ["TorchBackend", "torch_profiler_kwargs"]

log = logging.getLogger(__name__)


def torch_profiler_kwargs(options: TorchToolConfig, cuda_available: bool) -> dict[str, Any]:
    """Map ``contents`` to torch.profiler arguments (the user's list is never modified)."""
    import torch.profiler as tp

    activities = [tp.ProfilerActivity.CPU]
    if options.with_cuda and cuda_available:
        activities.append(tp.ProfilerActivity.CUDA)
    return {
        "activities": activities,
        "record_shapes": options.record_shapes,
        "profile_memory": options.profile_memory,
        "with_stack": options.with_stack,
    }


def _distributed_info_present() -> bool:
    """torch adds ``distributedInfo`` itself when torch.distributed is initialised."""
    try:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()
    except Exception:
        return False


class _TorchOutput(PendingOutput):
    def __init__(self, prof: Any, spec: CollectionSpec, suffix: str = "") -> None:
        self._prof = prof
        self._spec = spec
        self._suffix = suffix

    def write(self) -> list[WrittenFile]:
        spec = self._spec
        spec.save_dir.mkdir(parents=True, exist_ok=True)
        raw = temp_path(spec.save_dir, spec.stem, ".json")
        packed = temp_path(spec.save_dir, spec.stem, TRACE_EXT)
        try:
            self._prof.export_chrome_trace(str(raw))
            gzip_file(raw, packed)
            final = publish_unique(packed, spec.save_dir, spec.stem, self._suffix)
        finally:
            raw.unlink(missing_ok=True)
            packed.unlink(missing_ok=True)
            self._prof = None  # free the events as soon as they are on disk
        suffix = final.name[len(spec.stem) : -len(TRACE_EXT)]
        return [WrittenFile(path=final, bytes=final.stat().st_size, suffix=suffix)]


class _TorchCollection(Collection):
    def __init__(self, prof: Any, spec: CollectionSpec) -> None:
        self._prof = prof
        self._spec = spec
        from torch.profiler import record_function

        self._record_function = record_function

    def annotate(self, label: str) -> AbstractContextManager[Any]:
        return self._record_function(label)

    def close(self) -> PendingOutput:
        self._prof.stop()
        return _TorchOutput(self._prof, self._spec)


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

    def open(self, spec: CollectionSpec) -> Collection:
        import torch
        from torch.profiler import profile

        kwargs = torch_profiler_kwargs(self.options, torch.cuda.is_available())
        prof = profile(**kwargs)
        prof.record_steps = False  # no ProfilerStep#N rows
        prof.start()
        try:
            for key, value in spec.metadata.items():
                if key == "distributedInfo" and _distributed_info_present():
                    continue
                prof.add_metadata_json(key, json.dumps(value))
        except Exception:
            prof.stop()
            raise
        return _TorchCollection(prof, spec)


def read_trace(path: Path) -> dict[str, Any]:
    """Load a ``.json.gz`` / ``.json`` Chrome trace (used by tests and tools)."""
    import gzip

    import orjson

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        return orjson.loads(f.read())
