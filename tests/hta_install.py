"""Installing HTA (HolisticTraceAnalysis 0.5.0) for the tests and ``bench/analysis.py`` that
compare profd with it: never a dependency of profd, and installed without its declared
dependencies (``../shared/reference/environment.md``, "HTA with current pandas").

:func:`hta_site` pip-installs ``HolisticTraceAnalysis==0.5.0`` and the modules it needs to
import (``plotly narwhals psutil pydot pyparsing``: environment.md names the first three;
plotly's current release adds narwhals, pydot needs pyparsing) with ``--no-deps --target`` into
``<engine cache>/hta-site`` on first use, and returns that directory. A process that puts it on
``PYTHONPATH`` and runs this venv's python gets HTA on top of the dev venv's pandas and numpy.
The same file lock, failure type and ready marker as the engine venvs (``engine_install``):
``EngineInstallError.unavailable`` means the registry could not be reached (skip, not fail).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from engine_install import EngineInstallError, _file_lock, _run, engine_cache_dir

__all__ = ["HTA_VERSION", "EngineInstallError", "hta_env", "hta_site", "run_hta"]

HTA_VERSION = "0.5.0"
_PACKAGES = (
    f"HolisticTraceAnalysis=={HTA_VERSION}",
    "plotly",
    "narwhals",
    "psutil",
    "pydot",
    "pyparsing",
)
_READY = ".profd-hta-ready.json"


def hta_site(*, timeout_s: float = 600.0) -> Path:
    """The directory holding HTA and its import-time modules (installed when missing)."""
    site = engine_cache_dir() / "hta-site"
    marker = site / _READY
    if marker.exists():
        return site
    with _file_lock(site.parent / "hta-site.lock", timeout_s):
        if marker.exists():
            return site
        t0 = time.monotonic()
        shutil.rmtree(site, ignore_errors=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        env.setdefault("PIP_NO_INPUT", "1")
        _run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile",
             "--target", str(site), *_PACKAGES],
            "pip install HTA",
            timeout_s,
            env,
        )  # fmt: skip
        check = {**env, "PYTHONPATH": str(site)}
        _run([sys.executable, "-c", "import hta.trace_analysis"], "HTA import check", 300, check)
        took = round(time.monotonic() - t0, 1)
        marker.write_text(json.dumps({"version": HTA_VERSION, "install_s": took}))
        return site


def hta_env() -> dict[str, str]:
    """This process's environment with HTA importable (for a subprocess of ``sys.executable``)."""
    site = str(hta_site())
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": site + (os.pathsep + path if path else "")}


_HTA_CODE = r"""
import json, logging, sys
from hta.trace_analysis import TraceAnalysis
logging.disable(logging.CRITICAL)
a = TraceAnalysis(trace_dir=sys.argv[1], include_last_profiler_step=True)
types, kernels = a.get_gpu_kernel_breakdown(visualize=False, include_memory_kernels=True)
out = {
    "ranks": a.t.get_ranks(),
    "iterations": {r: [int(i) for i in a.t.get_iterations(r)] for r in a.t.get_ranks()},
    "temporal": a.get_temporal_breakdown(visualize=False).to_dict(orient="records"),
    "overlap": a.get_comm_comp_overlap(visualize=False).to_dict(orient="records"),
    "kernel_types": types.to_dict(orient="records"),
    "kernels": kernels.to_dict(orient="records"),
}
print("PROFD-HTA " + json.dumps(out, default=float))
"""


def run_hta(trace_dir: str | Path, **env: str) -> dict[str, Any]:
    """What HTA makes of a folder (``profd export --hta``'s output): its ranks, iterations,
    temporal breakdown, communication-computation overlap and kernel breakdown, from one
    subprocess (HTA is never imported into the test process), with ``env`` added to its
    environment (HTA's options). Raises :class:`EngineInstallError` where HTA cannot be
    installed."""
    done = subprocess.run(
        [sys.executable, "-c", _HTA_CODE, str(trace_dir)],
        env=hta_env() | env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    line = next((x for x in done.stdout.splitlines() if x.startswith("PROFD-HTA ")), None)
    assert done.returncode == 0 and line, done.stderr[-4000:]
    return json.loads(line.removeprefix("PROFD-HTA "))
