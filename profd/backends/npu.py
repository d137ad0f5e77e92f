"""The ``npu`` backend: the torch_npu (Ascend) profiler, with mstx ranges for stages.

Mapping of the role's ``tool_config.npu`` (reference §2.3.5, §5.5):

* CPU activity is always on. ``contents`` empty means *everything* (NPU activity, modules,
  stacks, shapes, memory), as it does for the torch tool — the reference's empty default gave
  CPU-only traces (§13 item 6); otherwise each of ``npu`` / ``module`` / ``stack`` /
  ``shapes`` / ``memory`` switches on its own flag;
* ``level`` → ``ProfilerLevel`` (``level_none``, ``level0``..``level2``);
* ``analysis`` → the handler's offline analysis; exports are data-simplified, with mstx
  ranges on and the ``communication`` domain excluded.

Each window writes torch_npu's own output directory under ``<session dir>/<stem>/``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from profd.backends.base import (
    Backend,
    Collection,
    CollectionSpec,
    HeldSteps,
    PendingOutput,
    WrittenFile,
)
from profd.core.request import NpuToolConfig, ToolKind

__all__ = ["NpuBackend", "npu_profiler_kwargs"]

log = logging.getLogger(__name__)

_LEVELS = {"level_none": "Level_none", "level0": "Level0", "level1": "Level1", "level2": "Level2"}


def _module() -> Any:
    return importlib.import_module("torch_npu")


def npu_profiler_kwargs(tnpu: Any, options: NpuToolConfig, out_dir: Path) -> dict[str, Any]:
    """torch_npu.profiler.profile(...) arguments for one window."""
    prof = tnpu.profiler
    want = set(options.contents)
    everything = not want

    def on(name: str) -> bool:
        return everything or name in want

    activities = [prof.ProfilerActivity.CPU]
    if on("npu"):
        activities.append(prof.ProfilerActivity.NPU)
    experimental = prof._ExperimentalConfig(
        profiler_level=getattr(prof.ProfilerLevel, _LEVELS[options.level]),
        export_type=prof.ExportType.Db,
        data_simplification=True,
        msprof_tx=True,
        mstx_domain_exclude=["communication"],
    )
    return {
        "activities": activities,
        "with_stack": on("stack"),
        "record_shapes": on("shapes"),
        "profile_memory": on("memory"),
        "with_modules": on("module"),
        "experimental_config": experimental,
        "on_trace_ready": prof.tensorboard_trace_handler(
            str(out_dir), analyse_flag=options.analysis
        ),
    }


class _MstxRange:
    __slots__ = ("_id", "_label", "_mstx")

    def __init__(self, mstx: Any, label: str) -> None:
        self._mstx = mstx
        self._label = label
        self._id = None

    def __enter__(self) -> None:
        self._id = self._mstx.range_start(self._label)

    def __exit__(self, *exc: Any) -> bool:
        self._mstx.range_end(self._id)
        return False


class _NpuOutput(PendingOutput):
    def __init__(self, out_dir: Path) -> None:
        self._dir = out_dir

    def write(self, held: HeldSteps | None = None) -> list[WrittenFile]:
        # torch_npu's handler already wrote (and analysed) the directory in stop().
        produced = [p for p in self._dir.iterdir()] if self._dir.is_dir() else []
        if not produced:
            raise RuntimeError(f"torch_npu wrote nothing into {self._dir}")
        out = []
        for p in sorted(produced):
            size = (
                sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
                if p.is_dir()
                else (p.stat().st_size)
            )
            out.append(WrittenFile(p, size))
        return out


class _NpuCollection(Collection):
    def __init__(self, tnpu: Any, spec: CollectionSpec, options: NpuToolConfig) -> None:
        self._mstx = tnpu.npu.mstx
        self._out = spec.save_dir / spec.stem
        self._out.mkdir(parents=True, exist_ok=True)
        self._prof = tnpu.profiler.profile(**npu_profiler_kwargs(tnpu, options, self._out))
        self._prof.start()

    def annotate(self, label: str) -> AbstractContextManager[Any]:
        return _MstxRange(self._mstx, label)

    def step(self) -> None:
        self._prof.step()

    def close(self) -> list[PendingOutput]:
        self._prof.stop()
        return [_NpuOutput(self._out)]


class NpuBackend(Backend):
    kind = ToolKind.NPU

    def __init__(self, options: Mapping[str, Any] | NpuToolConfig | None = None) -> None:
        if isinstance(options, NpuToolConfig):
            self.options = options
        else:
            self.options = NpuToolConfig.model_validate(dict(options or {}))

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("torch_npu") is None:
            return "torch_npu is not installed"
        return None

    def open(self, spec: CollectionSpec) -> Collection:
        return _NpuCollection(_module(), spec, self.options)
