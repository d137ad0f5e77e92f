"""Profiling configuration: the global block, the per-role block and per-tool options.

The layout mirrors verl's two levels (reference §2): a global block (tool, steps, save path,
finish hook) and one block per role (enable, ranks, discrete, ``tool_config.<tool>``). Every
model is frozen, rejects unknown keys, and validates when it is built; errors name the dotted
field (``roles.actor.tool_config.torch.contents.0``) and the rule.

Where profd deliberately differs from verl (each is a fix or a safer default):

* integers are strict: ``True`` is not accepted as a rank or a schedule value;
* an unknown ``tool`` is an error, never a silent no-op backend (reference §13 item 10);
* a role listed in a session request is enabled unless it says ``enable: false`` (a request
  exists to profile something); verl's launch-time YAML keeps verl's default ``False``;
* ``steps`` must not be empty, and is normalised to a sorted tuple without duplicates;
* every float (durations, timeouts) must be a finite number: NaN and infinity are refused;
* ``save_path`` must fit the OS path limits with room for what profd appends below it
  (:data:`MAX_SAVE_PATH_BYTES`, :data:`NAME_MAX`), and no text field that reaches the OS
  (``save_path``, ``finish_hook_cmd``, ``upload_uri``) may hold a NUL character.

No Ray or torch import here: this module is safe to import anywhere.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = [
    "FieldError",
    "GlobalProfilerConfig",
    "NpuToolConfig",
    "NsysToolConfig",
    "PySpyToolConfig",
    "RoleProfilerConfig",
    "SessionRequest",
    "ToolConfigs",
    "ToolKind",
    "TorchMemoryToolConfig",
    "TorchScheduleConfig",
    "TorchToolConfig",
    "field_errors",
]


class ToolKind(StrEnum):
    """The profiling backends profd knows. Anything else is rejected at validation time."""

    TORCH = "torch"
    TORCH_MEMORY = "torch_memory"
    NSYS = "nsys"
    NPU = "npu"
    PY_SPY = "py_spy"


#: A session profiles at most this many steps (a window, not a run's whole length).
MAX_WINDOW_STEPS = 10_000
#: Every integer a request carries fits a JSON number any reader keeps exactly (JavaScript,
#: SQLite, orjson): larger values are refused at validation, not at persistence.
MAX_INT = 2**53 - 1
#: Linux limits (``limits.h``): a whole path, and one path component, in bytes (UTF-8).
PATH_MAX = 4096
NAME_MAX = 255
#: Bytes of ``PATH_MAX`` kept for what profd appends below a save_path:
#: ``/<session id>/`` (20 characters today), an optional sub-directory (e.g.
#: ``rollout-engine-replica<N>/``) and a trace file name (~200 characters), plus the NUL.
SAVE_PATH_RESERVED_BYTES = 512
MAX_SAVE_PATH_BYTES = PATH_MAX - SAVE_PATH_RESERVED_BYTES
NonNegInt = Annotated[StrictInt, Field(ge=0, le=MAX_INT)]
PosInt = Annotated[StrictInt, Field(gt=0, le=MAX_INT)]
RoleName = Annotated[str, StringConstraints(pattern=r"^(\*|[A-Za-z0-9][A-Za-z0-9_.\-]{0,63})$")]
TorchContent = Literal["cuda", "cpu", "memory", "shapes", "stack"]
NpuContent = Literal["npu", "cpu", "memory", "shapes", "module", "stack"]
NpuLevel = Literal["level_none", "level0", "level1", "level2"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _check_token_window(start: int | None, end: int | None) -> None:
    if start is not None and end is not None and end <= start:
        raise ValueError(
            f"profile_token_end: must be > profile_token_start, got start={start}, end={end}"
        )


def _no_nul(value: str) -> None:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")


class TorchScheduleConfig(_Frozen):
    """torch.profiler schedule; its unit is one *update mini-batch* (reference §5.4)."""

    skip_first: NonNegInt = Field(0, description="Mini-batches skipped before the first cycle.")
    wait: NonNegInt = Field(0, description="Idle mini-batches at the start of each cycle.")
    warmup: NonNegInt = Field(0, description="Warm-up mini-batches (traced, not saved).")
    active: NonNegInt = Field(0, description="Recorded mini-batches per cycle; 0 = no schedule.")
    repeat: NonNegInt = Field(
        0, description="Cycles to record; 0 = unlimited (discrete), forced to 1 in continuous mode."
    )

    @property
    def enabled(self) -> bool:
        return self.active > 0


class TorchToolConfig(_Frozen):
    """Options of the ``torch`` tool (reference §2.3.1)."""

    contents: tuple[TorchContent, ...] = Field(
        (),
        description="Subset of cuda, cpu, memory, shapes, stack. CPU is always on; CUDA is on "
        "when the list is empty or names cuda.",
    )
    schedule: TorchScheduleConfig | None = Field(
        None, description="Mini-batch schedule for update stages; absent = record whole windows."
    )
    profile_token_start: NonNegInt | None = Field(
        None, description="Rollout engines only: first response token of the window."
    )
    profile_token_end: NonNegInt | None = Field(
        None, description="Rollout engines only: end of the token window (exclusive)."
    )

    @model_validator(mode="after")
    def _token_window(self) -> TorchToolConfig:
        _check_token_window(self.profile_token_start, self.profile_token_end)
        return self

    @property
    def with_cuda(self) -> bool:
        return not self.contents or "cuda" in self.contents

    @property
    def record_shapes(self) -> bool:
        return "shapes" in self.contents

    @property
    def profile_memory(self) -> bool:
        return "memory" in self.contents

    @property
    def with_stack(self) -> bool:
        return "stack" in self.contents


class TorchMemoryToolConfig(_Frozen):
    """Options of the ``torch_memory`` tool (CUDA allocator history, reference §2.3.3)."""

    trace_alloc_max_entries: PosInt = Field(100_000, description="Allocator events kept.")
    stack_depth: PosInt = Field(
        32,
        description="Accepted for verl compatibility; no effect (torch >= 2.1 records full "
        "stacks and has no depth setting).",
    )


class NsysToolConfig(_Frozen):
    """Options of the ``nsys`` tool; workers must run under profd's Nsight launcher."""

    trace: str = Field("cuda,nvtx,cublas,ucx", description="nsys --trace value (at launch).")
    extra_args: tuple[str, ...] = Field((), description="Extra nsys arguments (at launch).")
    flush_timeout_s: float = Field(
        600.0,
        gt=0,
        le=86_400,
        allow_inf_nan=False,
        description="How long to wait for nsys to finish a report.",
    )
    settle_s: float = Field(
        2.0,
        gt=0,
        le=3_600,
        allow_inf_nan=False,
        description="A report is complete once unchanged this long.",
    )


class NpuToolConfig(_Frozen):
    """Options of the ``npu`` tool (torch_npu profiler, reference §2.3.5)."""

    contents: tuple[NpuContent, ...] = Field(
        (), description="Subset of npu, cpu, memory, shapes, module, stack."
    )
    level: NpuLevel = Field("level0", description="torch_npu profiler level.")
    analysis: StrictBool = Field(False, description="Run torch_npu's offline analysis.")
    profile_token_start: NonNegInt | None = Field(
        None, description="Rollout engines only: first response token of the window."
    )
    profile_token_end: NonNegInt | None = Field(
        None, description="Rollout engines only: end of the token window (exclusive)."
    )

    @model_validator(mode="after")
    def _token_window(self) -> NpuToolConfig:
        _check_token_window(self.profile_token_start, self.profile_token_end)
        return self


class PySpyToolConfig(_Frozen):
    """Options of the ``py_spy`` tool (sampling the worker process, speedscope output)."""

    rate_hz: Annotated[StrictInt, Field(ge=1, le=1000)] = Field(100, description="Samples/s.")
    native: StrictBool = Field(False, description="Include native (C/C++) frames.")
    gil_only: StrictBool = Field(False, description="Only sample threads holding the GIL.")
    idle: StrictBool = Field(False, description="Include idle threads.")


class ToolConfigs(_Frozen):
    """Per-tool options of one role; only the session's tool is used, all are validated."""

    torch: TorchToolConfig = Field(TorchToolConfig(), description="Options of the torch tool.")
    torch_memory: TorchMemoryToolConfig = Field(
        TorchMemoryToolConfig(), description="Options of the torch_memory tool."
    )
    nsys: NsysToolConfig = Field(NsysToolConfig(), description="Options of the nsys tool.")
    npu: NpuToolConfig = Field(NpuToolConfig(), description="Options of the npu tool.")
    py_spy: PySpyToolConfig = Field(PySpyToolConfig(), description="Options of the py_spy tool.")

    def for_tool(self, tool: ToolKind) -> BaseModel:
        return getattr(self, ToolKind(tool).value)


class RoleProfilerConfig(_Frozen):
    """Which ranks of one role to profile, and how (reference §2.2)."""

    enable: StrictBool = Field(True, description="Profile this role at all.")
    all_ranks: StrictBool = Field(False, description="Profile every rank of the role.")
    ranks: tuple[NonNegInt, ...] = Field(
        (), description="Ranks to profile; empty (and not all_ranks) means rank 0."
    )
    discrete: StrictBool = Field(
        False, description="One trace per stage (true) or one per step / step group (false)."
    )
    topology: dict[Annotated[str, StringConstraints(pattern=r"^[a-z]{1,16}$")], NonNegInt] = Field(
        default_factory=dict,
        description='Only agents whose parallel coordinates match, e.g. {"tp": 0}. Without '
        "ranks / all_ranks, every matching agent is profiled.",
    )
    tool_config: ToolConfigs = Field(ToolConfigs(), description="Options per tool.")


class GlobalProfilerConfig(_Frozen):
    """The global block: tool, steps and where results go (reference §2.1)."""

    tool: ToolKind = Field(ToolKind.TORCH, description="Profiling backend.")
    steps: tuple[NonNegInt, ...] | None = Field(
        None, description="Steps to profile (sorted and de-duplicated)."
    )
    profile_continuous_steps: StrictBool = Field(
        False, description="Consecutive profiled steps share one trace named by the first step."
    )
    save_path: str | None = Field(
        None,
        description="Save root; relative paths resolve against the coordinator's base dir. "
        f"At most {MAX_SAVE_PATH_BYTES} bytes in UTF-8 (PATH_MAX {PATH_MAX} less "
        f"{SAVE_PATH_RESERVED_BYTES} kept for the <session id>/ directory and the file names "
        f"profd writes below it), each '/'-separated component at most {NAME_MAX} bytes "
        "(NAME_MAX), no NUL character.",
    )
    relocate_results: StrictBool = Field(
        False,
        description="Accepted for verl configs; profd always moves engine and nsys outputs "
        "into the session directory (a session's files live in one place, and only files "
        "there are indexed and served).",
    )
    finish_hook_cmd: str | None = Field(
        None, description="Shell command run once after the session's last profiled step."
    )
    finish_hook_all_ranks: StrictBool = Field(False, description="Run the hook on every rank.")
    finish_hook_ranks: tuple[NonNegInt, ...] = Field((), description="Ranks that run the hook.")
    finish_hook_timeout_s: float = Field(
        300.0,
        gt=0,
        le=86_400,
        allow_inf_nan=False,
        description="The hook is killed after this long.",
    )
    upload_uri: str | None = Field(
        None,
        description="Copy every trace once to <upload_uri>/<session>/ (any fsspec URL, e.g. "
        "file:///mnt/traces or s3://bucket/prefix).",
    )

    @field_validator("steps")
    @classmethod
    def _normalise_steps(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is None:
            return None
        if not v:
            raise ValueError("must list at least one step")
        steps = tuple(sorted(set(v)))
        if len(steps) > MAX_WINDOW_STEPS:
            raise ValueError(f"at most {MAX_WINDOW_STEPS} steps in one session, got {len(steps)}")
        return steps

    @field_validator("save_path")
    @classmethod
    def _fits_the_os(cls, v: str | None) -> str | None:
        if v is None:
            return None
        _no_nul(v)
        try:
            encoded = v.encode("utf-8", "surrogateescape")  # as os.fsencode does on Linux
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode text (no lone surrogates)") from None
        if len(encoded) > MAX_SAVE_PATH_BYTES:
            raise ValueError(
                f"must be at most {MAX_SAVE_PATH_BYTES} bytes in UTF-8 (PATH_MAX {PATH_MAX} less "
                f"{SAVE_PATH_RESERVED_BYTES} kept for the session directory and file names profd "
                f"adds), got {len(encoded)}"
            )
        longest = max(encoded.split(b"/"), key=len)
        if len(longest) > NAME_MAX:
            shown = longest[:24].decode("utf-8", "replace")
            raise ValueError(
                f"each path component must be at most {NAME_MAX} bytes (NAME_MAX), got "
                f"{len(longest)} bytes in {shown!r}..."
            )
        return v

    @field_validator("upload_uri")
    @classmethod
    def _known_protocol(cls, v: str | None) -> str | None:
        if v is None:
            return None
        if not v.strip():
            raise ValueError("must be a non-empty URL or null")
        _no_nul(v)
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode text (no lone surrogates)") from None
        import fsspec

        protocol = v.split("://", 1)[0] if "://" in v else "file"
        try:
            fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as exc:
            raise ValueError(f"unsupported protocol {protocol!r}: {exc}") from None
        return v

    @field_validator("finish_hook_cmd")
    @classmethod
    def _hook_not_blank(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must be a non-empty command or null")
        if v is not None:
            _no_nul(v)
        return v


class SessionRequest(GlobalProfilerConfig):
    """A profiling session: the global block, a window, and the role blocks.

    Exactly one window kind: ``steps`` (explicit) or ``next_steps`` (the next N steps every
    target can still reach). ``roles`` maps a role name to its block; the key ``"*"`` applies
    to every registered role not named explicitly; no roles at all means every registered role
    with the default block (rank 0).
    """

    next_steps: Annotated[StrictInt, Field(gt=0, le=MAX_WINDOW_STEPS)] | None = Field(
        None, description="Profile the next N steps that every target can still reach."
    )
    duration_s: float | None = Field(
        None,
        gt=0,
        le=86_400,
        allow_inf_nan=False,
        description="Profile for this many seconds, for targets without steps (rollout servers, "
        "inference, a stalled loop). py_spy / nsys / torch_memory start at once on any thread; "
        "torch starts at the agent's next mark.",
    )
    roles: dict[RoleName, RoleProfilerConfig] = Field(
        default_factory=dict, description="Role name (or '*') to its profiling block."
    )
    wait_for_agents: StrictBool = Field(
        False,
        description="Launch-time sessions: also target matching agents that register later, "
        "until the window begins (needs explicit steps).",
    )
    job_id: (
        Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[0-9A-Za-z_.:-]+$")] | None
    ) = Field(
        None,
        description="Only agents of this Ray job (its id as GET /api/v1/agents and `profd "
        "status` show it; 'none': agents outside Ray). Needed when a requested role has "
        "agents in several jobs of the cluster; a launch-time session names its own job.",
    )

    @model_validator(mode="after")
    def _one_window(self) -> SessionRequest:
        kinds = ("steps", "next_steps", "duration_s")
        given = [name for name in kinds if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "steps: give exactly one of `steps`, `next_steps` or `duration_s`"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if self.wait_for_agents and self.steps is None:
            raise ValueError("wait_for_agents: needs explicit `steps` (no agent to align with)")
        return self


class FieldError(BaseModel):
    """One validation failure, located by a dotted field path."""

    model_config = ConfigDict(frozen=True)

    field: str = Field(description="Dotted path of the offending field ('' for the whole body).")
    message: str = Field(description="What rule was broken.")
    type: str = Field("value_error", description="Machine-readable error type.")


_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.]*): (.*)$", re.S)
_SKIP_LOC = {"body", "query", "path"}


def _dotted(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and p in _SKIP_LOC)]
    # pydantic marks dict-key errors with a trailing "[key]" element.
    return ".".join(p for p in parts if p != "[key]")


def field_errors(exc: ValidationError | list[dict[str, Any]], root: str = "") -> list[FieldError]:
    """Turn a pydantic error (or FastAPI's error list) into dotted-field errors.

    Validators in this module start their message with ``"<field>: "`` when the rule spans
    several fields, so the error is still located at a field rather than the whole model.
    """
    raw = exc.errors() if isinstance(exc, ValidationError) else exc
    out: list[FieldError] = []
    for err in raw:
        loc = tuple(err.get("loc", ()))
        msg = str(err.get("msg", "invalid"))
        if err.get("type") == "json_invalid" and loc[-1:] and isinstance(loc[-1], int):
            # FastAPI puts the character offset where a field would be: ("body", 17)
            loc, msg = loc[:-1], f"{msg} at character {loc[-1]}"
        path = _dotted(loc)
        msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if err.get("type") == "tuple_type":  # a tuple inside: a JSON (or YAML) list outside
            msg = msg.replace("a valid tuple", "a list")
        m = _FIELD_PREFIX.match(msg)
        if m:
            path = f"{path}.{m.group(1)}" if path else m.group(1)
            msg = m.group(2)
        elif not path and (err.get("type") == "json_invalid" or loc[:1] == ("body",)):
            path = "body"  # the whole body: not JSON, or JSON of the wrong shape (``[1, 2]``)
        if root:
            path = f"{root}.{path}" if path else root
        out.append(FieldError(field=path, message=msg, type=str(err.get("type", "value_error"))))
    return out
