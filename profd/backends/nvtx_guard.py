"""Keep CUPTI free for torch.profiler (reference §10).

CUPTI takes one subscriber per process. An image-level ``NVTX_INJECTION64_PATH`` that points
at a CUPTI-based library grabs it, and Kineto then records CPU operators only. profd points
the variable at an unloadable path in workers — at ``attach`` for a running job, or through
:func:`runtime_env` at launch — unless the worker runs under profd's Nsight launcher (nsys
needs its injection; so does a worker whose variable already names Nsight Systems' own
injection library, e.g. under Ray's ``nsight`` runtime_env) or the operator opts out with
``PROFD_KEEP_NVTX_INJECTION=1`` (verl's ``VERL_KEEP_NVTX_INJECTION=1`` is honoured too).

NVTX loads its injection library at the first NVTX call; when that already happened before
``attach``, changing the variable cannot help, and the warning says to relaunch with
:func:`runtime_env`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

__all__ = ["DISABLED_PATH", "NVTX_VAR", "OPT_OUT_VARS", "apply_guard", "runtime_env"]

log = logging.getLogger(__name__)

NVTX_VAR = "NVTX_INJECTION64_PATH"
#: Non-empty and unloadable, so hooks that only fill an *unset* variable cannot undo it.
DISABLED_PATH = "/nonexistent/profd-disabled-nvtx-injection.so"
OPT_OUT_VARS = ("PROFD_KEEP_NVTX_INJECTION", "VERL_KEEP_NVTX_INJECTION")


def _opted_out(env: Mapping[str, str]) -> bool:
    return any(env.get(v) == "1" for v in OPT_OUT_VARS)


def _is_nsys_injection(library: str) -> bool:
    """Nsight Systems injects ``libToolsInjection64.so`` from its install directory."""
    return "ToolsInjection" in Path(library).name or "nsight-systems" in library.lower()


def _already_loaded(library: str, maps: Path = Path("/proc/self/maps")) -> bool:
    try:
        return library in maps.read_text()
    except OSError:
        return False


def apply_guard(
    env: MutableMapping[str, str] | None = None, *, under_nsys: bool = False
) -> str | None:
    """Point ``NVTX_INJECTION64_PATH`` at :data:`DISABLED_PATH`; return what was done, or
    ``None`` when nothing changed."""
    env = os.environ if env is None else env
    if under_nsys or _opted_out(env):
        return None
    previous = env.get(NVTX_VAR)
    if previous == DISABLED_PATH:
        return None
    if previous and _is_nsys_injection(previous):
        # A worker launched under Nsight (Ray's `nsight` runtime_env, a user's own nsys):
        # its NVTX ranges are what the user asked for.
        log.info("profd: keeping %s=%s (Nsight Systems injection)", NVTX_VAR, previous)
        return None
    env[NVTX_VAR] = DISABLED_PATH
    if previous:
        late = _already_loaded(previous)
        msg = (
            f"profd: {NVTX_VAR} was {previous!r}; set it to {DISABLED_PATH!r} so torch.profiler "
            f"keeps CUPTI (set PROFD_KEEP_NVTX_INJECTION=1 to keep the inherited value)"
        )
        if late:
            msg += (
                "; the library is already loaded in this process, so this takes effect only "
                "for workers launched with runtime_env=profd.backends.nvtx_guard.runtime_env()"
            )
        log.warning(msg)
        return msg
    log.info("profd: %s set to %s (it was unset)", NVTX_VAR, DISABLED_PATH)
    return f"{NVTX_VAR} set to {DISABLED_PATH} (was unset)"


def runtime_env(base: Mapping[str, Any] | None = None, tool: str = "torch") -> dict[str, Any]:
    """A Ray ``runtime_env`` with the guard for the torch tool (like verl's launch-time env)."""
    out = dict(base or {})
    if tool != "torch" or _opted_out(os.environ):
        return out
    env_vars = dict(out.get("env_vars") or {})
    env_vars[NVTX_VAR] = DISABLED_PATH
    out["env_vars"] = env_vars
    return out
