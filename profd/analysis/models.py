"""The session summary as data: frozen pydantic models, returned as-is by the HTTP API.

Times are milliseconds. ``*_ms`` positions (``start_ms``, ``end_ms``) are relative to
:attr:`SessionSummary.t0_epoch_us`, the earliest event of the trace set, on the wall clock
the traces share; durations are plain milliseconds.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "AlignedFile",
    "FileInfo",
    "GpuBreakdown",
    "GpuStageBreakdown",
    "GpuTime",
    "IdleGap",
    "LateCause",
    "MiniBatchTime",
    "OpStat",
    "ProcessingStats",
    "SessionSummary",
    "SkipKind",
    "SkippedFile",
    "StageOps",
    "StageStat",
    "StageTime",
    "StepTime",
    "Straggler",
    "StragglerRule",
    "TrackInfo",
]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StragglerRule(_Frozen):
    """When a rank counts as late: its stage ends after the median end of its peers by more
    than ``max(k * MAD * 1.4826, abs_floor_ms, rel_floor * median stage wall time)``."""

    k: float = Field(3.0, gt=0, description="Multiple of the peers' robust spread (scaled MAD).")
    abs_floor_ms: float = Field(
        5.0, ge=0, description="Never call a rank late by less than this many milliseconds."
    )
    rel_floor: float = Field(
        0.05,
        ge=0,
        description="Never call a rank late by less than this fraction of the "
        "median wall time of the stage.",
    )


class TrackInfo(_Frozen):
    """One timeline: a (role, rank), a rollout replica / global rank, or an unknown file."""

    track: str = Field(description="Label, e.g. 'actor_rollout_ref rank 0 (tp0-dp1) @node'.")
    key: str = Field(
        description="Stable identity: 'rank:<role>:<rank>', 'rollout:<n>:<g>' or 'file:<name>'."
    )
    kind: str = Field(description="'rank', 'rollout' or 'file'.")
    role: str | None = Field(description="Role (from the trace's profd metadata or file name).")
    rank: int | None = Field(description="Rank, or the global rank of a rollout replica.")
    world_size: int | None = Field(description="World size of the role, when known.")
    topology: dict[str, int] = Field(description="Parallel coordinates, e.g. {'tp': 0, 'dp': 1}.")
    hostname: str | None = Field(description="Host that recorded the trace.")
    node_id: str | None = Field(description="Ray node id that recorded the trace.")
    replica: int | None = Field(description="Rollout replica index (rollout tracks only).")
    from_metadata: bool = Field(
        description="Identity read from profd metadata inside the trace (else from the file name)."
    )
    files: int = Field(description="Trace files on this track.")


class FileInfo(_Frozen):
    """One trace file that was read."""

    name: str = Field(description="File name inside the session directory.")
    track: str = Field(description="Track label the file belongs to.")
    file_bytes: int = Field(description="Size on disk.")
    json_bytes: int = Field(description="Size of its JSON once decompressed.")
    events: int = Field(description="Complete ('X') events read.")
    parse: str = Field(description="'fast' (Kineto layout scan) or 'generic' (full JSON parse).")
    seconds: float = Field(description="Time spent reading it (in its worker).")
    partial_steps: list[int] = Field(
        default_factory=list,
        description="Steps this file holds only in part (its window began or ended inside "
        "them: a cancel, a cut, a timed window; or it is one of a discrete stage's schedule "
        "windows, a few mini-batches), left out of step and stage times.",
    )


class SkipKind(StrEnum):
    """Why a file is not in the summary: it could not be read, or it is on another clock."""

    UNREADABLE = "unreadable"
    CLOCK = "clock"


class SkippedFile(_Frozen):
    """A file of the directory that could not be summarised, and why."""

    name: str = Field(description="File name.")
    reason: str = Field(description="Why it was skipped.")
    kind: SkipKind = Field(
        SkipKind.UNREADABLE,
        description="'unreadable', or 'clock': kept off the shared timeline by its clock.",
    )


class AlignedFile(_Frozen):
    """A file without a wall clock of its own, placed on the session's clock by metadata."""

    name: str = Field(description="File name.")
    offset_ms: float = Field(description="Wall-clock time its ts 0 was placed at, ms after t0.")
    uncertainty_ms: float = Field(description="How far off the placement can be (either way).")
    source: str = Field(description="The metadata used, e.g. 'profd window start (replica 0)'.")


class StageTime(_Frozen):
    """Wall time of one stage in one step on one track (from the stage's ranges)."""

    step: int | None = Field(description="Step (None when the trace does not say).")
    stage: str = Field(description="Stage label.")
    track: str = Field(description="Track label.")
    role: str | None = Field(description="Role of the track.")
    rank: int | None = Field(description="Rank of the track.")
    start_ms: float = Field(description="First start of the stage in this step.")
    end_ms: float = Field(description="Last end of the stage in this step.")
    wall_ms: float = Field(description="Summed duration of its ranges (one per call).")
    calls: int = Field(description="How many times the stage ran in this step.")


class StepTime(_Frozen):
    """One profiled step on one track: how much of it the stages covered."""

    step: int = Field(description="Step.")
    track: str = Field(description="Track label.")
    start_ms: float = Field(description="Start of the step range.")
    wall_ms: float = Field(description="Duration of the step range.")
    stages_ms: float = Field(description="Time inside stages (union of stage ranges).")
    idle_ms: float = Field(description="Time of the step outside every stage.")


class StageStat(_Frozen):
    """One (role, step, stage) across its ranks."""

    step: int | None = Field(description="Step.")
    stage: str = Field(description="Stage label.")
    role: str | None = Field(description="Role the ranks belong to.")
    ranks: int = Field(description="Tracks that ran it.")
    wall_min_ms: float = Field(description="Shortest wall time over the ranks.")
    wall_median_ms: float = Field(description="Median wall time over the ranks.")
    wall_max_ms: float = Field(description="Longest wall time over the ranks.")
    end_spread_ms: float = Field(description="Last end minus first end over the ranks.")
    slowest: str = Field(description="Track that ended last.")


class MiniBatchTime(_Frozen):
    """One mini-batch range (``mini_batch<i>``) inside a stage."""

    step: int | None = Field(description="Step.")
    stage: str | None = Field(description="Stage it ran in.")
    track: str = Field(description="Track label.")
    index: int = Field(description="Mini-batch index i.")
    start_ms: float = Field(description="Start.")
    wall_ms: float = Field(description="Duration.")
    micro_batches: int = Field(description="micro_batch<j> ranges inside it.")


class IdleGap(_Frozen):
    """Time on a track between two stages of a step (or the step's edges) with no stage."""

    step: int | None = Field(description="Step.")
    track: str = Field(description="Track label.")
    after: str = Field(description="Stage before the gap, or '(step start)'.")
    before: str = Field(description="Stage after the gap, or '(step end)'.")
    start_ms: float = Field(description="Start of the gap.")
    gap_ms: float = Field(description="Length of the gap.")


class OpStat(_Frozen):
    """One operator inside a stage, over all ranks and steps."""

    name: str = Field(description="Operator or kernel name.")
    category: str = Field(description="Trace category: cpu_op, cuda_runtime, kernel, ...")
    calls: int = Field(description="Number of calls.")
    self_ms: float = Field(description="Self time: duration minus the events nested inside it.")
    total_ms: float = Field(description="Total (inclusive) time.")
    share: float = Field(description="Fraction of the stage's self time on this device.")


class StageOps(_Frozen):
    """Top operators of one stage on one device side, by self time."""

    stage: str | None = Field(description="Stage label (None: outside every stage).")
    device: str = Field(description="'cpu' (host events) or 'gpu' (device events).")
    self_ms: float = Field(description="Self time of every operator of this stage and device.")
    ops: list[OpStat] = Field(description="The top operators, largest self time first.")


class GpuTime(_Frozen):
    """Device time of a set of device events (kernels, memcpys, memsets), as HTA's temporal
    breakdown and communication-computation overlap define it (docs/gpu-breakdown.md).
    idle + compute + non-compute = window."""

    kernels: int = Field(description="Device events counted (kernel, gpu_memcpy, gpu_memset).")
    window_ms: float = Field(
        description="First start to last end of those events, per file, summed over files "
        "(per stage: its busy time plus the idle time while the host was in the stage)."
    )
    idle_ms: float = Field(description="Time of the window with no device event running.")
    compute_ms: float = Field(description="Time some computation kernel runs (union).")
    non_compute_ms: float = Field(
        description="Time only communication or memory events run: no computation overlaps."
    )
    communication_ms: float = Field(description="Time some communication kernel runs (union).")
    memory_ms: float = Field(description="Time some memcpy / memset runs (union).")
    comm_comp_overlap_pct: float | None = Field(
        description="Share of the communication time during which computation also runs, in "
        "percent; None without communication."
    )


class GpuStageBreakdown(GpuTime):
    """Device time of one RL stage on one track: the events launched in the stage, and the
    idle time while the host was in it."""

    stage: str | None = Field(description="Stage label (None: outside every stage).")


class GpuBreakdown(GpuTime):
    """Device time of one track (its files' device events inside their profiled steps)."""

    track: str = Field(description="Track label.")
    stages: list[GpuStageBreakdown] = Field(description="The same figures per stage.")


class LateCause(StrEnum):
    """Why a straggler's stage ended late: it started late (an earlier stage ran late, its own
    duration is normal), it ran longer than its peers, or both."""

    LATE_START = "late start"
    LONG_DURATION = "long duration"
    BOTH = "late start and long duration"

    @property
    def long(self) -> bool:
        """It ran longer than its peers (the stage itself is slow, not only shifted)."""
        return self is not LateCause.LATE_START


class Straggler(_Frozen):
    """A rank whose stage ended late against its peers, and why.

    The ``start_*`` / ``extra_wall_ms`` / ``cause`` fields default to None only so that a
    summary saved by an older profd (``summarize --json``) still loads."""

    step: int | None = Field(description="Step.")
    stage: str = Field(description="Stage label.")
    role: str | None = Field(description="Role.")
    rank: int | None = Field(description="The late rank.")
    track: str = Field(description="Its track label.")
    end_ms: float = Field(description="When its stage ended.")
    peer_median_end_ms: float = Field(description="Median end of the other ranks.")
    late_ms: float = Field(description="How late: end minus the peers' median end.")
    threshold_ms: float = Field(description="Lateness above which a rank is a straggler here.")
    wall_ms: float = Field(description="Its wall time in the stage.")
    peer_median_wall_ms: float = Field(description="Median wall time of the other ranks.")
    start_ms: float | None = Field(None, description="When its stage started.")
    peer_median_start_ms: float | None = Field(
        None, description="Median start of the stage on the other ranks."
    )
    start_late_ms: float | None = Field(
        None, description="Start minus the peers' median start (negative: it started early)."
    )
    extra_wall_ms: float | None = Field(
        None, description="Wall time minus the peers' median wall time (how much longer it ran)."
    )
    cause: LateCause | None = Field(
        None,
        description="'late start' (started late, normal duration: an earlier stage ran late), "
        "'long duration' (ran longer than its peers) or 'late start and long duration'; "
        "None in summaries from before this field.",
    )


class ProcessingStats(_Frozen):
    """How the summary was computed."""

    files: int = Field(description="Files read.")
    json_bytes: int = Field(description="Decompressed JSON bytes read.")
    wall_s: float = Field(description="Wall time of the whole summary.")
    mode: str = Field(description="'serial', 'processes' or 'ray'.")
    workers: int = Field(description="Worker processes (or nodes) used.")
    start_method: str | None = Field(description="multiprocessing start method of the workers.")
    worker_memory_mb: float | None = Field(
        description="Sum over workers of their peak memory "
        "growth (an upper bound on what they used at once); None when not measured."
    )


class SessionSummary(_Frozen):
    """Per step x stage x rank wall time, mini-batches, idle gaps, top operators and
    stragglers of one session's traces."""

    source: str = Field(description="Directory (or description) the traces came from.")
    session_ids: list[str] = Field(description="profd session ids found in the traces.")
    t0_epoch_us: float | None = Field(
        description="Earliest event, µs since the epoch; every start_ms / end_ms is relative to it."
    )
    span_ms: float = Field(description="From the earliest event to the latest event end.")
    steps: list[int] = Field(description="Profiled steps found.")
    stages: list[str] = Field(description="Stage labels found, in order of first appearance.")
    tracks: list[TrackInfo] = Field(description="Timelines, in display order.")
    files: list[FileInfo] = Field(description="Files read.")
    skipped: list[SkippedFile] = Field(description="Files that could not be read, with reasons.")
    aligned: list[AlignedFile] = Field(
        default_factory=list,
        description="Files on a clock of their own, placed on the session's clock by metadata.",
    )
    stage_times: list[StageTime] = Field(description="Per step x stage x track wall time.")
    step_times: list[StepTime] = Field(description="Per step x track: stage time and idle time.")
    stage_stats: list[StageStat] = Field(description="Per role x step x stage, across ranks.")
    mini_batches: list[MiniBatchTime] = Field(description="Mini-batch ranges.")
    idle_gaps: list[IdleGap] = Field(description="Gaps between stages inside each step.")
    top_ops: list[StageOps] = Field(description="Top operators by self time per stage.")
    gpu: list[GpuBreakdown] = Field(
        default_factory=list,
        description="Device time per track that has device events: idle, compute, non-compute, "
        "communication, memory, overlap, per stage (empty for CPU-only traces).",
    )
    stragglers: list[Straggler] = Field(description="Late ranks, latest first.")
    straggler_rule: StragglerRule = Field(description="The rule used to call a rank late.")
    processing: ProcessingStats = Field(description="How the summary was computed.")
