"""The ``py_spy`` backend: sample the worker process for the window (speedscope output).

Beyond the reference: for Python-bound stages (agent loops, reward functions, data
preparation) a sampling profile says more than an operator trace. A window starts
``py-spy record`` on this process (non-blocking, so the worker is never paused) and stops it
with SIGINT when the window closes; py-spy then writes the profile, which the exporter thread
waits for and publishes as ``<stem>.speedscope.json`` (open it at https://www.speedscope.app).

py-spy ships with ``ray[default]``; without it, or without permission to trace the process,
the tool is refused for the agent with the reason.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson

from profd.backends.base import (
    Backend,
    Collection,
    CollectionSpec,
    HeldSteps,
    PendingOutput,
    WrittenFile,
)
from profd.core.files import publish_unique, temp_path
from profd.core.request import PySpyToolConfig, ToolKind
from profd.core.stacks import find_py_spy

__all__ = ["PySpyBackend", "find_py_spy", "ptrace_refusal", "py_spy_command", "with_sigint"]

_CAP_SYS_PTRACE = 19


def ptrace_refusal(
    scope_file: Path = Path("/proc/sys/kernel/yama/ptrace_scope"),
    status_file: Path = Path("/proc/self/status"),
    euid: int | None = None,
) -> str | None:
    """Why py-spy (a child of this process) could not attach to it, or ``None``.

    Yama's ``ptrace_scope`` 1 lets a process trace only its descendants (py-spy records its
    parent) and 2 only with CAP_SYS_PTRACE; 3 forbids it. Root or CAP_SYS_PTRACE passes
    1 and 2. No Yama (the file is absent): nothing to refuse.
    """
    try:
        scope = int(scope_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if scope == 0:
        return None
    if scope >= 3:
        return "kernel.yama.ptrace_scope=3 forbids attaching py-spy to any process"
    privileged = (os.geteuid() if euid is None else euid) == 0
    try:
        caps = next(
            int(line.split()[1], 16)
            for line in status_file.read_text().splitlines()
            if line.startswith("CapEff:")
        )
        privileged = privileged or bool(caps >> _CAP_SYS_PTRACE & 1)
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    if privileged:
        return None
    return (
        f"kernel.yama.ptrace_scope={scope}: py-spy cannot attach to this worker (set it to 0, "
        "or give the worker CAP_SYS_PTRACE, e.g. securityContext.capabilities.add: "
        "[SYS_PTRACE] on Kubernetes)"
    )


log = logging.getLogger(__name__)

EXT = ".speedscope.json"
#: How long py-spy may take to write its profile after SIGINT.
WRITE_TIMEOUT_S = 120.0


def py_spy_command(exe: str, pid: int, output: Path, options: PySpyToolConfig) -> list[str]:
    cmd = [
        exe, "record", "--pid", str(pid), "--rate", str(options.rate_hz),
        "--format", "speedscope", "--output", str(output), "--nonblocking",
    ]  # fmt: skip
    if options.native:
        cmd.append("--native")
    if options.gil_only:
        cmd.append("--gil")
    if options.idle:
        cmd.append("--idle")
    return cmd


#: Unblocks SIGINT, then execs the command. A Ray worker runs with SIGINT blocked, a child
#: inherits the blocked mask across exec, and py-spy then never sees the SIGINT that tells
#: it to write its profile (it waited out WRITE_TIMEOUT_S and wrote nothing). Unblocking it
#: here, in the child, never exposes the worker itself to a Ctrl-C (a ``preexec_fn`` would
#: do the same, but is not safe in a process with threads). SIGINT stays *ignored* until
#: py-spy sets its handler: one sent earlier (a very short window) would have killed it
#: before it wrote anything; ignored, it is sent again (:meth:`_PySpyOutput.write`).
_SIGINT_ON = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
    "os.execvp(sys.argv[1], sys.argv[1:])"
)
#: How often the SIGINT is sent again while py-spy has not ended.
RESIGNAL_S = 0.5


def with_sigint(cmd: list[str]) -> list[str]:
    """``cmd`` run so that SIGINT reaches it (once it handles SIGINT) whatever this process
    blocks or ignores."""
    if not sys.executable:  # an embedded interpreter: nothing to run the step with
        return cmd
    return [sys.executable, "-I", "-S", "-c", _SIGINT_ON, *cmd]


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class _PySpyOutput(PendingOutput):
    def __init__(
        self,
        proc: subprocess.Popen,
        tmp: Path,
        spec: CollectionSpec,
        idle: bool = False,
        thread: int | None = None,
    ) -> None:
        self._proc = proc
        self._tmp = tmp
        self._spec = spec
        self._idle = idle
        self._thread = thread

    def write(self, held: HeldSteps | None = None) -> list[WrittenFile]:
        deadline = time.monotonic() + WRITE_TIMEOUT_S
        while True:
            try:
                _, err = self._proc.communicate(timeout=RESIGNAL_S)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    self._proc.kill()
                    self._proc.communicate()
                    self._tmp.unlink(missing_ok=True)
                    raise RuntimeError(
                        f"py-spy did not finish within {WRITE_TIMEOUT_S:.0f} s"
                    ) from None
                # one that came before py-spy's handler was ignored; once it handles them,
                # more are harmless (it is already stopping and writing)
                self._proc.send_signal(signal.SIGINT)
        if not self._tmp.exists() or self._tmp.stat().st_size == 0:
            msg = (err or b"").decode(errors="replace").strip()[-500:]
            raise RuntimeError(f"py-spy wrote no profile (exit {self._proc.returncode}): {msg}")
        sampled = _has_samples(self._tmp, self._thread)
        notes = () if sampled else (NO_SAMPLES_IDLE if self._idle else NO_SAMPLES,)
        final = publish_unique(self._tmp, self._spec.save_dir, self._spec.stem, "", EXT)
        return [WrittenFile(final, final.stat().st_size, warnings=notes)]


#: Said with a profile py-spy wrote without a sample of the thread that opened the window
#: (the training thread): py-spy leaves idle threads out.
NO_SAMPLES = (
    "no samples of the training thread: it was idle (sleeping or waiting) throughout; "
    "roles.<role>.tool_config.py_spy.idle: true samples idle threads too (from the CLI: "
    "--config with `tool: py_spy` and `roles: {'*': {tool_config: {py_spy: {idle: true}}}}`)"
)
NO_SAMPLES_IDLE = "no samples of the training thread: the window was too short for one"


def _has_samples(path: Path, thread: int | None) -> bool:
    """Whether a speedscope file holds a sample of native thread ``thread`` (py-spy names a
    thread's profile ``Thread <id> "<name>"``; an idle thread gets none at all), or of any
    thread when ``thread`` is None or the profiles are not named that way. A file that
    cannot be read is given the benefit of the doubt."""
    try:
        profiles = orjson.loads(path.read_bytes()).get("profiles") or []
        names = [str(p.get("name", "")).split(" ")[:2] for p in profiles]
        if thread is not None and all(n[:1] == ["Thread"] for n in names):
            profiles = [p for p, n in zip(profiles, names, strict=True) if n[1:] == [str(thread)]]
        return any(p.get("samples") or p.get("events") for p in profiles)
    except (OSError, ValueError, AttributeError):
        return True


class _PySpyCollection(Collection):
    def __init__(self, exe: str, spec: CollectionSpec, options: PySpyToolConfig) -> None:
        spec.save_dir.mkdir(parents=True, exist_ok=True)
        self._spec = spec
        self._idle = options.idle
        self._thread = spec.thread_id
        self._tmp = temp_path(spec.save_dir, spec.stem, EXT)
        cmd = py_spy_command(exe, os.getpid(), self._tmp, options)
        self._started = time.monotonic()
        # Started with SIGINT blocked (this thread's mask only, for the moment of the fork):
        # one sent before the child ignores it (a window of a few ms) stays pending, and is
        # then discarded rather than ending the child before py-spy could write.
        with _sigint_blocked():
            self._proc = subprocess.Popen(
                with_sigint(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )  # fmt: skip

    def close(self) -> list[PendingOutput]:
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        return [_PySpyOutput(self._proc, self._tmp, self._spec, self._idle, self._thread)]


class PySpyBackend(Backend):
    kind = ToolKind.PY_SPY
    thread_free = True

    def __init__(self, options: Mapping[str, Any] | PySpyToolConfig | None = None) -> None:
        if isinstance(options, PySpyToolConfig):
            self.options = options
        else:
            self.options = PySpyToolConfig.model_validate(dict(options or {}))

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if find_py_spy() is None:
            return "py-spy is not installed (it comes with ray[default])"
        return ptrace_refusal()

    def open(self, spec: CollectionSpec) -> Collection:
        exe = find_py_spy()
        if exe is None:
            raise RuntimeError("py-spy is not installed")
        return _PySpyCollection(exe, spec, self.options)
