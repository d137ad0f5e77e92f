"""Why a trigger fired (pure logic, no Ray): the offending rank, what it measured, the
baseline it was held to, and its Ray job; kept in a session's origin as a plain dict."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from profd.core.trigger_request import TriggerKind

__all__ = ["Evidence", "evidence_from"]


@dataclass(frozen=True, slots=True)
class Evidence:
    """Why a trigger fired: the rank, what it measured, and the baseline it was held to.

    ``straggler``: ``observed_s`` is the lateness (``late_s``: its stage's end minus the
    peers' median end, ``peer_median_end_s``) and ``baseline_s`` the rule's bar
    (``threshold_s``) in ``step``; ``baseline_samples`` the peers compared. ``oom``: the
    ``error``, the ``stage`` it left (``mark`` "step" when a step mark) and the
    ``snapshot_path``; no measure (``observed_s`` and ``baseline_s`` 0)."""

    role: str
    rank: int
    agent_id: str
    mark: str  # "step" or the stage label
    observed_s: float
    baseline_s: float
    factor: float | None
    baseline_samples: int
    step: int | None = None  # the rank's step as the coordinator knew it then (straggler: judged)
    kind: str = TriggerKind.STEP_TIME.value
    #: the healthy peer to profile beside it, when the condition chose one (straggler)
    peer_rank: int | None = None
    # straggler
    late_s: float | None = None
    threshold_s: float | None = None
    end_s: float | None = None  # its stage's end, coordinator wall clock
    peer_median_end_s: float | None = None
    cause: str | None = None  # late start / long duration / both (as the summary says)
    # oom
    error: str | None = None
    snapshot_path: str | None = None
    #: the Ray job of the rank (its peers and its session are that job's)
    job_id: str | None = None

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "role": self.role, "rank": self.rank, "agent_id": self.agent_id, "mark": self.mark,
            "observed_s": round(self.observed_s, 6), "baseline_s": round(self.baseline_s, 6),
            "factor": self.factor, "baseline_samples": self.baseline_samples, "step": self.step,
            "kind": self.kind,
        }  # fmt: skip
        if self.job_id is not None:
            out["job_id"] = self.job_id
        if self.kind == TriggerKind.STRAGGLER:
            out.update(
                peer_rank=self.peer_rank, late_s=_r(self.late_s), threshold_s=_r(self.threshold_s),
                end_s=_r(self.end_s), peer_median_end_s=_r(self.peer_median_end_s),
                cause=self.cause,
            )  # fmt: skip
        elif self.kind == TriggerKind.OOM:
            out.update(error=self.error, snapshot_path=self.snapshot_path)
        return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


_EVIDENCE_FIELDS = frozenset(f.name for f in fields(Evidence))


def evidence_from(d: dict[str, Any]) -> Evidence:
    """An :class:`Evidence` from its ``as_dict`` (a restored session's origin); what this
    version does not know is left out, what is missing is zero."""
    known = {k: v for k, v in d.items() if k in _EVIDENCE_FIELDS}
    base: dict[str, Any] = dict(
        role="", rank=-1, agent_id="", mark="step", observed_s=0.0, baseline_s=0.0,
        factor=None, baseline_samples=0,
    )  # fmt: skip
    return Evidence(**{**base, **known})
