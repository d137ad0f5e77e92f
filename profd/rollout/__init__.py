"""Rollout profiling: drive vLLM / SGLang replicas' own profilers, by global GPU rank.

* :mod:`~profd.rollout.replicas` — global GPU ranks → replicas, what is ignored and why;
* :mod:`~profd.rollout.engine_args` — contents and token window → vLLM launch settings and
  SGLang ``/start_profile`` bodies, with warnings for what an engine cannot honour;
* :mod:`~profd.rollout.engines` — HTTP (vLLM, SGLang) and in-process engine adapters;
* :mod:`~profd.rollout.relocate` — waiting for complete files, naming and moving them;
* :mod:`~profd.rollout.rollout_agent` — one agent per replica: start / finish a window;
* :mod:`~profd.rollout.windows` — what an agent registers and what a window reports.

No Ray or torch import anywhere in this package.
"""

from profd.rollout.engine_args import (
    EngineProfileOptions,
    SglangStart,
    TokenWindow,
    VllmLaunchSettings,
    parse_vllm_version,
    sglang_start_request,
    vllm_launch_settings,
    vllm_window_warnings,
)
from profd.rollout.engines import (
    EngineError,
    EngineErrorKind,
    EngineKind,
    EngineTimeouts,
    EngineWindow,
    InProcessEngine,
    ProfilingEngine,
    SglangHttpEngine,
    VllmHttpEngine,
)
from profd.rollout.relocate import (
    FlushWait,
    IncompleteFile,
    LocalRank,
    RelocatedFile,
    RelocationResult,
    WaitResult,
    collect_engine_files,
    read_local_rank,
    relocate_files,
    rollout_trace_name,
    wait_for_files,
)
from profd.rollout.replicas import (
    ROLLOUT_ROLE,
    ReplicaMap,
    ReplicaParallelism,
    ReplicaSelection,
    select_replicas,
)
from profd.rollout.rollout_agent import RolloutAgent, engine_trace_dir
from profd.rollout.windows import RolloutAgentInfo, WindowMode, WindowOutcome, WindowStart

__all__ = [
    "ROLLOUT_ROLE",
    "EngineError",
    "EngineErrorKind",
    "EngineKind",
    "EngineProfileOptions",
    "EngineTimeouts",
    "EngineWindow",
    "FlushWait",
    "InProcessEngine",
    "IncompleteFile",
    "LocalRank",
    "ProfilingEngine",
    "RelocatedFile",
    "RelocationResult",
    "ReplicaMap",
    "ReplicaParallelism",
    "ReplicaSelection",
    "RolloutAgent",
    "RolloutAgentInfo",
    "SglangHttpEngine",
    "SglangStart",
    "TokenWindow",
    "VllmHttpEngine",
    "VllmLaunchSettings",
    "WaitResult",
    "WindowMode",
    "WindowOutcome",
    "WindowStart",
    "collect_engine_files",
    "engine_trace_dir",
    "parse_vllm_version",
    "read_local_rank",
    "relocate_files",
    "rollout_trace_name",
    "select_replicas",
    "sglang_start_request",
    "vllm_launch_settings",
    "vllm_window_warnings",
    "wait_for_files",
]
