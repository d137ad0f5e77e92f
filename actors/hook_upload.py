"""The work done after a session's traces are written: finish hooks and uploads.

Plain functions with no Ray import. The coordinator runs them on the node that holds the
files (a Ray task pinned to that node), never on a training thread, so a slow upload or a
hanging hook cannot stall training (reference §13 items 2–4).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["HookResult", "UploadResult", "hook_env", "run_hook", "upload_file"]

OUTPUT_TAIL_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class HookResult:
    exit_code: int | None
    output: str
    duration_s: float
    timed_out: bool = False
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.error

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def hook_env(
    *,
    session_id: str,
    save_dir: str,
    tool: str,
    role: str,
    rank: int,
    pid: int,
    node: str,
    traces: list[str],
) -> dict[str, str]:
    """``PROFD_*`` variables, plus verl's ``VERL_PROFILE_*`` names for existing scripts."""
    env = {
        "PROFD_SESSION_ID": session_id,
        "PROFD_SAVE_PATH": save_dir,
        "PROFD_TOOL": tool,
        "PROFD_ROLE": role,
        "PROFD_RANK": str(rank),
        "PROFD_PID": str(pid),
        "PROFD_NODE": node,
        "PROFD_TRACES": "\n".join(traces),
        "VERL_PROFILE_SAVE_PATH": save_dir,
        "VERL_PROFILE_TOOL": tool,
        "VERL_PROFILE_RANK": str(rank),
        "VERL_PROFILE_PID": str(pid),
        "VERL_PROFILE_ROLE": role,
    }
    if tool == "nsys":
        env["VERL_PROFILE_RAY_NSIGHT_DIR"] = "/tmp/ray/session_latest/logs/nsight"
    return env


def run_hook(cmd: str, env: Mapping[str, str], cwd: str | None, timeout_s: float) -> HookResult:
    """``/bin/sh -c cmd`` with a timeout; the whole process group is killed on timeout."""
    started = time.monotonic()
    workdir = cwd if cwd and Path(cwd).is_dir() else None
    try:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", cmd],
            cwd=workdir,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as exc:
        return HookResult(None, "", time.monotonic() - started, error=f"failed to launch: {exc}")
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
    text = (out or b"")[-OUTPUT_TAIL_BYTES:].decode(errors="replace")
    return HookResult(proc.returncode, text, round(time.monotonic() - started, 3), timed_out)


@dataclass(frozen=True, slots=True)
class UploadResult:
    dest: str
    bytes: int
    ok: bool
    error: str = ""
    skipped: bool = False  # already there with the right size (an earlier attempt)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def upload_file(path: str, uri: str, session_id: str, expected_bytes: int) -> UploadResult:
    """Copy one trace to ``<uri>/<session_id>/<file name>`` with fsspec, then check its size.

    A destination that already has the file with the expected size is not copied again, so a
    retry after a coordinator restart never makes a second copy.
    """
    import fsspec

    name = Path(path).name
    dest = f"{uri.rstrip('/')}/{session_id}/{name}"
    try:
        fs, root = fsspec.core.url_to_fs(dest)
        if fs.exists(root) and fs.size(root) == expected_bytes:
            return UploadResult(dest, expected_bytes, True, skipped=True)
        fs.makedirs(root.rsplit("/", 1)[0], exist_ok=True)
        partial = root + ".profd-partial"
        fs.put_file(path, partial)
        fs.mv(partial, root)
        size = int(fs.size(root))
    except Exception as exc:
        return UploadResult(dest, 0, False, f"{type(exc).__name__}: {exc}")
    if size != expected_bytes:
        return UploadResult(dest, size, False, f"size mismatch: {size} != {expected_bytes} bytes")
    return UploadResult(dest, size, True)
