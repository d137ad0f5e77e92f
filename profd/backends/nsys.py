"""The ``nsys`` backend: Nsight Systems capture ranges opened and closed by the agent.

Nsight cannot attach to a running process, so workers must be *launched* under nsys — with
Ray's ``runtime_env={"nsight": ...}`` (see :func:`nsys_runtime_env`) or with
:func:`launcher_command` outside Ray — configured to capture on ``cudaProfilerStart/Stop``
with ``capture-range-end=repeat``: any number of windows, none fixed at launch (verl must
declare the count up front). Launched that way, the process sits idle under nsys at near-zero
cost until a window calls ``cudaProfilerStart``.

A window: ``cudaProfilerStart`` → NVTX ranges for stages → ``cudaProfilerStop``. nsys writes
one report per range, asynchronously and sometimes slowly, into its output directory; the
exporter thread waits until the new report of *this* process is complete (size stable),
then moves it into the session directory as ``<stem>.nsys-rep``. Nothing is deleted; a
report that never appears is an error naming where to look.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
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
from profd.core.files import publish_unique
from profd.core.request import NsysToolConfig, ToolKind

__all__ = ["NsysApi", "NsysBackend", "launcher_command", "nsys_runtime_env"]

log = logging.getLogger(__name__)

EXT = ".nsys-rep"
#: Set in a worker launched by :func:`nsys_runtime_env` / :func:`launcher_command`.
MARKER_ENV = "PROFD_NSYS"
#: Where nsys writes reports when launched by :func:`launcher_command`.
REPORT_DIR_ENV = "PROFD_NSYS_REPORT_DIR"
RAY_NSIGHT_DIR = "/tmp/ray/session_latest/logs/nsight"

CAPTURE_OPTIONS = {
    "capture-range": "cudaProfilerApi",
    "capture-range-end": "repeat",
    "cuda-memory-usage": "true",
}


def nsys_runtime_env(
    options: NsysToolConfig | None = None, base: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A Ray ``runtime_env`` that launches workers under nsys, ready for profd windows."""
    options = options or NsysToolConfig()
    env = dict(base or {})
    env["nsight"] = {"t": options.trace, **CAPTURE_OPTIONS}
    env["env_vars"] = {**dict(env.get("env_vars") or {}), MARKER_ENV: "1"}
    return env


def launcher_command(
    argv: Sequence[str], report_dir: Path, options: NsysToolConfig | None = None
) -> tuple[list[str], dict[str, str]]:
    """``nsys profile ... <argv>`` and the environment for a worker started outside Ray."""
    options = options or NsysToolConfig()
    cmd = ["nsys", "profile", f"--trace={options.trace}"]
    cmd += [f"--{k}={v}" for k, v in CAPTURE_OPTIONS.items()]
    cmd += ["--output", str(report_dir / "worker_process_%p"), *options.extra_args, *argv]
    env = {MARKER_ENV: "1", REPORT_DIR_ENV: str(report_dir)}
    return cmd, env


class NsysApi:
    """The process-side calls (replaced in tests, where neither CUDA nor nsys exists)."""

    def launched_under_nsys(self) -> bool:
        return os.environ.get(MARKER_ENV) == "1"

    def cuda_available(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def start(self) -> None:
        import torch

        torch.cuda.profiler.start()

    def stop(self) -> None:
        import torch

        torch.cuda.synchronize()
        torch.cuda.profiler.stop()

    def range(self, label: str) -> AbstractContextManager[Any]:
        import nvtx

        return nvtx.annotate(label)

    def report_dir(self) -> Path:
        return Path(os.environ.get(REPORT_DIR_ENV) or RAY_NSIGHT_DIR)


def _reports(directory: Path, pid: int) -> dict[Path, int]:
    if not directory.is_dir():
        return {}
    return {p: p.stat().st_size for p in directory.glob(f"worker_process_{pid}*{EXT}")}


class _NsysOutput(PendingOutput):
    def __init__(self, api: NsysApi, spec: CollectionSpec, before: set[Path], opts: NsysToolConfig):
        self._api = api
        self._spec = spec
        self._before = before
        self._opts = opts

    def _wait_complete(self, directory: Path) -> list[Path]:
        deadline = time.monotonic() + self._opts.flush_timeout_s
        stable_since: dict[Path, tuple[int, float]] = {}
        while time.monotonic() < deadline:
            now = time.monotonic()
            fresh = {p: s for p, s in _reports(directory, os.getpid()).items()
                     if p not in self._before}  # fmt: skip
            done = []
            for path, size in fresh.items():
                seen = stable_since.get(path)
                if seen is None or seen[0] != size:
                    stable_since[path] = (size, now)
                elif size > 0 and now - seen[1] >= self._opts.settle_s:
                    done.append(path)
            if fresh and len(done) == len(fresh):
                return sorted(done)
            time.sleep(min(0.5, self._opts.settle_s / 4))
        raise TimeoutError(
            f"nsys wrote no complete report for pid {os.getpid()} in {directory} within "
            f"{self._opts.flush_timeout_s:.0f} s (any late report stays there)"
        )

    def write(self, held: HeldSteps | None = None) -> list[WrittenFile]:
        directory = self._api.report_dir()
        out = []
        for report in self._wait_complete(directory):
            self._spec.save_dir.mkdir(parents=True, exist_ok=True)
            final = publish_unique(report, self._spec.save_dir, self._spec.stem, "", EXT)
            out.append(WrittenFile(final, final.stat().st_size))
        return out


class _NsysCollection(Collection):
    def __init__(self, api: NsysApi, spec: CollectionSpec, opts: NsysToolConfig) -> None:
        self._api = api
        self._spec = spec
        self._opts = opts
        self._before = set(_reports(api.report_dir(), os.getpid()))
        api.start()

    def annotate(self, label: str) -> AbstractContextManager[Any]:
        return self._api.range(label)

    def close(self) -> list[PendingOutput]:
        self._api.stop()
        return [_NsysOutput(self._api, self._spec, self._before, self._opts)]


class NsysBackend(Backend):
    kind = ToolKind.NSYS
    thread_free = True
    api: NsysApi = NsysApi()

    def __init__(self, options: Mapping[str, Any] | NsysToolConfig | None = None) -> None:
        if isinstance(options, NsysToolConfig):
            self.options = options
        else:
            self.options = NsysToolConfig.model_validate(dict(options or {}))

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not cls.api.launched_under_nsys():
            return (
                "the worker was not launched under Nsight (start it with "
                "runtime_env=profd.backends.nsys.nsys_runtime_env() or profd's nsys launcher)"
            )
        try:
            if not cls.api.cuda_available():
                return "CUDA is not available in this process"
        except Exception as exc:
            return f"torch.cuda cannot be queried: {exc}"
        return None

    def open(self, spec: CollectionSpec) -> Collection:
        return _NsysCollection(self.api, spec, self.options)
