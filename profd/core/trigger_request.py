"""A trigger: a condition on live step or stage times (or a CUDA out-of-memory error), and the
session to start when it holds (``POST /api/v1/triggers``, ``profd watch``,
``profd up --trigger FILE``; DESIGN.md "Triggers").

Kinds: ``step_time`` / ``stage_time`` (a rank's duration against its role's rolling median),
``straggler`` (a rank's stage ends late against the same step's stage on its peers, by the
summary's straggler rule) and ``oom`` (an out-of-memory error left a mark). A field a kind
does not use is refused (422 naming it) unless it holds its default (a listed trigger shows
every field, and may be posted back as it is).

Pure models (no Ray). The session template is an ordinary session request without its window
and targets: profd chooses those when the trigger fires (the next ``next_steps`` steps of the
offending rank and one healthy peer of its role). It is validated here, in full, by building
the request it would become, so a trigger never fires into a 422.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from profd.core.request import MAX_WINDOW_STEPS, SessionRequest, field_errors

__all__ = [
    "EVALUATED_KINDS",
    "TriggerCondition",
    "TriggerKind",
    "TriggerRequest",
]

#: Durations an agent keeps per mark at the coordinator (profd.actors.mark_stats.WINDOW).
MAX_BASELINE_STEPS = 256
#: Keys of a session request the trigger decides itself.
_CHOSEN_AT_FIRING = ("steps", "next_steps", "duration_s", "roles", "wait_for_agents", "job_id")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TriggerKind(StrEnum):
    STEP_TIME = "step_time"  # a rank's step takes factor x its role's rolling median
    STAGE_TIME = "stage_time"  # the same for one stage
    STRAGGLER = "straggler"  # a rank's stage ends late against its peers' in the same step
    OOM = "oom"  # a CUDA out-of-memory error left a worker's mark


#: Kinds this profd evaluates (every kind of the grammar).
EVALUATED_KINDS = frozenset(TriggerKind)

#: The fields each kind uses besides ``kind`` and ``role`` (any other one set is a 422).
_USES: dict[TriggerKind, frozenset[str]] = {
    TriggerKind.STEP_TIME: frozenset({"factor", "baseline_steps", "min_ms", "for_steps"}),
    TriggerKind.STAGE_TIME: frozenset({"stage", "factor", "baseline_steps", "min_ms", "for_steps"}),
    TriggerKind.STRAGGLER: frozenset({"stage", "min_ms", "for_steps"}),
    TriggerKind.OOM: frozenset(),
}


def _a(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


class TriggerCondition(_Frozen):
    """When a trigger holds: one rank's newest duration against its role's rolling median
    (step_time, stage_time), one rank's stage ending late against its peers' in the same
    step (straggler), or an out-of-memory error in one rank (oom)."""

    kind: TriggerKind = Field(description="step_time, stage_time, straggler or oom.")
    role: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$",
        description="Role whose ranks are watched (a role name, as agents attach with).",
    )
    stage: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="Stage label (stage_time and straggler, required there).",
    )
    factor: float = Field(
        2.0,
        gt=1.0,
        le=1000.0,
        allow_inf_nan=False,
        description="Holds when a duration exceeds factor x the role's rolling median.",
    )
    baseline_steps: StrictInt = Field(
        20,
        ge=3,
        le=MAX_BASELINE_STEPS,
        description="Newest durations of each rank of the role pooled for the median; the "
        "trigger is armed once the role has this many.",
    )
    min_ms: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="Never holds for a duration (straggler: a lateness) below this.",
    )
    for_steps: StrictInt = Field(
        1,
        ge=1,
        le=16,
        description="Holds when the rank's newest this-many durations all break the rule (2 "
        "or more: a single stall, a GC pause or a checkpoint, starts nothing); straggler: "
        "its stage ended late in this many consecutive steps.",
    )

    @model_validator(mode="after")
    def _kind_rules(self) -> TriggerCondition:
        if self.kind not in EVALUATED_KINDS:
            kinds = ", ".join(sorted(k.value for k in EVALUATED_KINDS))
            raise ValueError(f"kind: {self.kind.value!r} is not evaluated yet (use {kinds})")
        needs_stage = self.kind in (TriggerKind.STAGE_TIME, TriggerKind.STRAGGLER)
        if needs_stage and self.stage is None:
            raise ValueError(f"stage: required for a {self.kind.value} trigger")
        uses = _USES[self.kind]
        for name in sorted(self.model_fields_set - uses - {"kind", "role"}):
            if getattr(self, name) == type(self).model_fields[name].default:
                continue  # the default, as a listed trigger shows it: posting it back is fine
            users = sorted(k.value for k, f in _USES.items() if name in f)
            raise ValueError(
                f"{name}: not used by {_a(self.kind.value)} trigger (only {', '.join(users)})"
            )
        return self

    @property
    def mark(self) -> str | None:
        """The mark watched: a stage label, or None for the step."""
        return self.stage


class TriggerRequest(_Frozen):
    """``POST /api/v1/triggers``: a condition and the session it starts."""

    name: str = Field(min_length=1, max_length=128, description="Name shown with its firings.")
    when: TriggerCondition = Field(description="The condition.")
    session: dict[str, Any] = Field(
        default_factory=dict,
        validate_default=True,
        description="A session request without window or roles (tool, tool options, "
        "save_path, ...) plus `next_steps` (default 2): what is profiled when it fires.",
    )
    cooldown_s: float = Field(
        300.0, ge=0, le=86_400 * 7, allow_inf_nan=False, description="Quiet time after a firing."
    )
    max_per_hour: StrictInt = Field(4, ge=1, le=60, description="Firings in any 60 minutes.")
    max_disk_mb: float = Field(
        1024.0,
        gt=0,
        allow_inf_nan=False,
        description="Disk budget: no firing once its sessions' traces hold this much.",
    )

    @field_validator("name")
    @classmethod
    def _printable(cls, v: str) -> str:
        if not v.isprintable():
            raise ValueError("must be printable (no control characters)")
        return v

    @field_validator("session")
    @classmethod
    def _template(cls, v: dict[str, Any]) -> dict[str, Any]:
        chosen = [k for k in _CHOSEN_AT_FIRING if k in v and k != "next_steps"]
        if chosen:
            raise ValueError(f"{chosen[0]}: chosen when the trigger fires; leave it out")
        n = v.get("next_steps", 2)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= MAX_WINDOW_STEPS:
            raise ValueError(f"next_steps: an int in 1..{MAX_WINDOW_STEPS}, got {n!r}")
        try:
            _build({**v, "next_steps": n}, "role", (0,))
        except ValidationError as exc:
            err = field_errors(exc)[0]
            raise ValueError(f"{err.field}: {err.message}") from None
        return {**v, "next_steps": n}

    def session_for(self, ranks: tuple[int, ...], job_id: str | None = None) -> SessionRequest:
        """The session a firing on ``ranks`` of the watched role (in Ray job ``job_id``, the
        offending rank's) starts."""
        return _build(self.session, self.when.role, ranks, job_id)


def _build(
    template: dict[str, Any], role: str, ranks: tuple[int, ...], job_id: str | None = None
) -> SessionRequest:
    body = {**template, "roles": {role: {"ranks": list(ranks)}}}
    if job_id is not None:
        body["job_id"] = job_id
    return SessionRequest.model_validate(body)
