"""Profiling backends behind one interface, chosen by a validated :class:`ToolKind`."""

from __future__ import annotations

import sys
from typing import Any

from profd.backends.base import (
    NULL_RANGE,
    Backend,
    Collection,
    CollectionSpec,
    NoopBackend,
    PendingOutput,
    WrittenFile,
)
from profd.core.request import ToolKind

__all__ = [
    "NULL_RANGE",
    "Backend",
    "Collection",
    "CollectionSpec",
    "NoopBackend",
    "PendingOutput",
    "WrittenFile",
    "backend_class",
    "capabilities",
    "end_orphaned_windows",
    "make_backend",
    "orphaned_here",
]


_CLASSES = {
    ToolKind.TORCH: ("profd.backends.torch_backend", "TorchBackend"),
    ToolKind.TORCH_MEMORY: ("profd.backends.torch_memory", "TorchMemoryBackend"),
    ToolKind.NSYS: ("profd.backends.nsys", "NsysBackend"),
    ToolKind.NPU: ("profd.backends.npu", "NpuBackend"),
    ToolKind.PY_SPY: ("profd.backends.py_spy", "PySpyBackend"),
}


def backend_class(kind: ToolKind | str) -> type[Backend] | None:
    """The class implementing ``kind`` (imported on first use); ``None`` when profd has no
    implementation of it."""
    import importlib

    entry = _CLASSES.get(ToolKind(kind))  # ToolKind() raises ValueError naming a bad value
    if entry is None:
        return None
    return getattr(importlib.import_module(entry[0]), entry[1])


def make_backend(kind: ToolKind | str, options: dict[str, Any]) -> Backend:
    cls = backend_class(kind)
    if cls is None:
        raise ValueError(f"tool {ToolKind(kind).value!r} is not implemented in this profd build")
    return cls(options)  # type: ignore[call-arg]


def capabilities() -> dict[str, str | None]:
    """For every tool: ``None`` when it can run in this process, else the reason it cannot."""
    out: dict[str, str | None] = {}
    for kind in ToolKind:
        cls = backend_class(kind)
        if cls is None:
            out[kind.value] = "not implemented in this profd build"
            continue
        try:
            out[kind.value] = cls.unavailable_reason()
        except Exception as exc:  # a probe must never break attach
            out[kind.value] = f"probe failed: {exc}"
    return out


def end_orphaned_windows() -> int:
    """Stop the windows a backend could not stop where their end came (off the thread that
    started them) that this thread may stop now; how many. Only torch's are bound to a
    thread; nothing is imported for this (no window of it, none to stop)."""
    end = _torch_threads("end_orphaned_windows")
    return end() if end is not None else 0


def orphaned_here() -> bool:
    """Whether this thread has a window refused off it (stopped at its next mark)."""
    here = _torch_threads("orphaned_here")
    return bool(here is not None and here())


def _torch_threads(name: str) -> Any:
    """A function of :mod:`profd.backends.torch_threads` if a torch window was ever made here
    (else ``None``: nothing to look at, and nothing imported for it)."""
    return getattr(sys.modules.get("profd.backends.torch_threads"), name, None)
