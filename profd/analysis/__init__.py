"""Look at a session: merge every rank's trace into one timeline, summarise the step.

* :func:`summarize_dir` — per step x stage x rank wall time, mini-batches, idle gaps, top
  operators by self time, stragglers → :class:`SessionSummary` (pydantic; the HTTP API
  returns it as-is); :func:`write_html` renders it as a self-contained report.
* :func:`merge_dir` — one Chrome / Perfetto trace with a labelled track per (role, rank) and
  per rollout replica, with filters and a size budget → :class:`MergeReport`.

Importing this package is cheap: the modules load on first use, and none imports Ray
(the Ray path imports it inside the call).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "MergeReport",
    "SessionSummary",
    "StragglerRule",
    "merge_dir",
    "merge_files",
    "render_html",
    "summarize_dir",
    "summarize_files",
    "write_html",
]

if TYPE_CHECKING:
    from profd.analysis.merge import MergeReport, merge_dir, merge_files
    from profd.analysis.models import SessionSummary, StragglerRule
    from profd.analysis.report import render_html, write_html
    from profd.analysis.summary import summarize_dir, summarize_files

_HOME = {
    "MergeReport": "merge",
    "merge_dir": "merge",
    "merge_files": "merge",
    "SessionSummary": "models",
    "StragglerRule": "models",
    "render_html": "report",
    "write_html": "report",
    "summarize_dir": "summary",
    "summarize_files": "summary",
}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'profd.analysis' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"profd.analysis.{module}"), name)
