"""What the coordinator reports: response models shared by the HTTP API, the CLI and Python.

Request models live in :mod:`profd.core.request`; these are separate, read-only views.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from profd.core.states import AgentLink, AgentState, HookState, PartState, SessionState, UploadState

__all__ = [
    "AgentView",
    "HookView",
    "IgnoredView",
    "PartView",
    "ProgressView",
    "ReplicaView",
    "SessionView",
    "StackFrameView",
    "StackGroupView",
    "StackMissingView",
    "StackRankView",
    "StacksView",
    "StatusView",
    "TimingView",
    "TraceView",
    "UploadView",
]


class _View(BaseModel):
    model_config = ConfigDict(frozen=True)


class ReplicaView(_View):
    world_size: int = Field(description="GPUs of the replica.")
    global_rank_start: int = Field(description="First global GPU rank it owns.")
    global_rank_stop: int = Field(description="One past the last global GPU rank it owns.")
    colocated: bool = Field(description="It shares its GPUs with training.")
    collect_budget_s: int = Field(description="Seconds it may take to hand in its files.")


class TimingView(_View):
    last_s: float = Field(description="Duration of the last mark received, in seconds.")
    median_s: float = Field(
        description="Rolling median of the last `samples` durations, in seconds."
    )
    samples: int = Field(description="Durations in the rolling window (at most 256).")
    count: int = Field(description="Durations received from this agent since it was first heard.")
    lost: int = Field(
        description="Durations the agent measured but could not send (its ring of 256 per "
        "mark was overwritten first: the coordinator was unreachable, or marks came faster "
        "than the ring holds between two reports)."
    )
    recent_s: list[float] = Field(
        description="The newest durations (at most 16), oldest first, in seconds."
    )


class AgentView(_View):
    agent_id: str = Field(description="Unique id of the agent (one per worker process and role).")
    role: str = Field(description="Role the agent registered with, e.g. actor_rollout_ref.")
    rank: int = Field(description="Rank within the role.")
    world_size: int | None = Field(description="Number of ranks of the role, when known.")
    topology: dict[str, int] = Field(description="Parallel coordinates (tp, pp, dp, cp, ...).")
    hostname: str = Field(description="Host the worker runs on.")
    node_id: str | None = Field(description="Ray node id of the worker.")
    node_ip: str | None = Field(description="Ray node address of the worker.")
    pid: int = Field(description="Worker process id.")
    job_id: str | None = Field(
        None,
        description="The Ray job the worker belongs to (a session's `job_id` picks it when "
        "a role runs in several jobs); null outside Ray.",
    )
    state: AgentState = Field(description="alive, lost (its process is gone or silent) or closed.")
    current_step: int | None = Field(
        description="The job's step on this agent: the last one it marked (SPMD loops), or, "
        "for a worker of a single-controller job, the step its driver announced last."
    )
    step_source: str | None = Field(
        None,
        description="Where current_step comes from: 'agent' (marked by the worker) or "
        "'driver' (announced by profd.controller()); null when no step is known.",
    )
    last_seen_s: float = Field(description="Seconds since the agent was last heard from.")
    capabilities: dict[str, str | None] = Field(
        description="Tool → null when usable on this agent, else the reason it is not."
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="What else the agent said about itself: a rollout replica's engine "
        "(engine_kind, engine_flavor), endpoint and trace_dir.",
    )
    link: AgentLink | None = Field(
        None,
        description="How its plans reach it: 'relay' (its node's relay), 'direct' (its own "
        "long-poll at the coordinator, e.g. while the relay is down) or 'shared' (one poll "
        "for the agents of its process); null before its first poll.",
    )
    replica: ReplicaView | None = Field(
        None, description="A rollout replica's size, global GPU ranks and timing (else null)."
    )
    last_step_s: float | None = Field(
        None,
        description="Duration of the agent's last step mark (`with agent.step(n)`), in "
        "seconds; null until one arrived, and for workers of single-controller jobs (they "
        "mark stages only: their step is the driver's).",
    )
    median_step_s: float | None = Field(
        None, description="Rolling median of its last 256 step durations, in seconds."
    )
    step_time: TimingView | None = Field(
        None, description="Its step durations in full (null when it marks no steps)."
    )
    stage_times: dict[str, TimingView] = Field(
        default_factory=dict,
        description="Stage label → its durations (the label as in traces: with the role "
        "prefix when the process hosts several roles). Live: agents send them about once a "
        "second.",
    )


class IgnoredView(_View):
    role: str = Field(description="Role named in the request.")
    rank: int | None = Field(description="Rank named in the request, when the reason is a rank.")
    reason: str = Field(description="Why this target was not used.")


class TraceView(_View):
    trace_id: str = Field(description="Stable id of the trace file.")
    session_id: str = Field(description="Session that produced it.")
    agent_id: str = Field(description="Agent that wrote it.")
    role: str = Field(description="Role of the agent.")
    rank: int = Field(description="Rank of the agent.")
    tool: str = Field(description="Backend that recorded it.")
    scope: str = Field(description="train (one trace per step or group) or the stage label.")
    steps: list[int] = Field(description="Steps covered by the trace.")
    path: str = Field(description="Absolute path on the node that wrote it.")
    file_name: str = Field(description="Base name of the file.")
    bytes: int = Field(description="Size on disk.")
    node_id: str | None = Field(description="Ray node holding the file.")
    node_ip: str | None = Field(description="Address of that node.")
    hostname: str = Field(description="Host name of that node.")
    created_at: float = Field(description="Unix time the file was written.")


class PartView(_View):
    agent_id: str = Field(description="Target agent.")
    role: str = Field(description="Role of the target.")
    rank: int = Field(description="Rank of the target.")
    role_block: str = Field(description="Request key that selected it (role, component or '*').")
    state: PartState = Field(description="Progress of this target.")
    reason: str = Field(description="Why the target is in this state, when not obvious.")
    recorded_steps: list[int] = Field(description="Steps recorded so far.")
    missed_steps: list[int] = Field(description="Steps that could not be recorded.")
    traces: list[str] = Field(description="Ids of the traces this target wrote.")
    armed_at: float | None = Field(None, description="Unix time the agent received its plan.")
    agent_done: bool = Field(
        False,
        description="The agent finished its share (its part_done or its end came): nothing "
        "more will arrive for this target, also after a cancel. Not kept over a coordinator "
        "restart.",
    )


class ProgressView(_View):
    planned_steps: int = Field(
        description="Steps to record, summed over targets (0 for a timed session)."
    )
    recorded_steps: int = Field(description="Of those, steps a written trace holds.")
    missed_steps: int = Field(description="Of those, steps that can no longer be recorded.")
    targets: int = Field(description="Targets of the session.")
    targets_finished: int = Field(description="Targets whose share is over, however it ended.")
    fraction: float = Field(
        description="recorded / planned steps (timed sessions: finished / all targets), 0..1; "
        "a session that ended short of its plan stays below 1."
    )


class SessionView(_View):
    session_id: str = Field(description="Session id, also the name of its directory.")
    state: SessionState = Field(description="Where the session is in its life cycle.")
    reason: str = Field(description="Why the session is in this state.")
    tool: str = Field(description="Backend used.")
    steps: list[int] | None = Field(description="Profiled steps (resolved for next_steps).")
    groups: list[list[int]] = Field(description="Steps grouped into collections.")
    discrete_roles: list[str] = Field(description="Role blocks recording one trace per stage.")
    save_dir: str = Field(description="Directory the traces are written to, on every node.")
    created_at: float = Field(description="Unix time the session was created.")
    finished_at: float | None = Field(description="Unix time it reached a terminal state.")
    deadline: float | None = Field(
        None, description="Unix time after which parts still unfinished expire."
    )
    targets: list[PartView] = Field(description="Every matched agent and its progress.")
    progress: ProgressView | None = Field(None, description="How far the session got, live.")
    ignored: list[IgnoredView] = Field(description="Requested targets that were not used, why.")
    traces: list[TraceView] = Field(description="Traces written so far.")
    warnings: list[str] = Field(description="Problems that did not stop the session.")
    hooks: list[HookView] = Field(description="Finish-hook runs, one per hook agent.")
    uploads: list[UploadView] = Field(description="Uploads to upload_uri, one per trace.")
    request: dict = Field(description="The request as validated (defaults filled in).")
    trigger_id: str | None = Field(
        None, description="The trigger that started this session (null: started by a request)."
    )
    evidence: dict | None = Field(
        None, description="Why that trigger fired: rank, observed vs baseline (see triggers)."
    )


class StatusView(_View):
    version: str = Field(description="profd version of the coordinator.")
    agents: int = Field(description="Agents currently alive.")
    agents_by_role: dict[str, int] = Field(description="Alive agents per role.")
    sessions_by_state: dict[str, int] = Field(description="Sessions per state.")
    live_sessions: list[str] = Field(description="Sessions not yet terminal.")
    traces: int = Field(description="Trace files known.")
    trace_bytes: int = Field(description="Total size of those files.")
    save_root: str = Field(description="Default directory sessions are saved under.")
    uptime_s: float = Field(description="Seconds since the coordinator started.")
    state_write_failures: int = Field(
        0, description="Writes to the state directory that failed (0 when persistence is healthy)."
    )
    state_last_error: str | None = Field(None, description="The last such failure, if any.")
    driver_step: int | None = Field(
        None,
        description="The step a single-controller driver (profd.controller()) announced last, "
        "while it announces (null when no driver was heard from within the heartbeat timeout).",
    )
    driver_seen_s: float | None = Field(
        None, description="Seconds since that driver's last announcement."
    )
    driver_steps: dict[str, int] = Field(
        default_factory=dict,
        description="Each announcing driver's Ray job ('none': outside Ray) -> its step: two "
        "jobs on the cluster, two drivers.",
    )
    ray_address: str | None = Field(
        None,
        description="GCS address of the Ray cluster the coordinator runs in: a job's agents "
        "register only from a job that joined it (ray.init(address=...) or RAY_ADDRESS); null "
        "outside Ray.",
    )


class HookView(_View):
    agent_id: str = Field(description="Agent whose node ran the hook.")
    role: str = Field(description="Role of that agent.")
    rank: int = Field(description="Rank of that agent.")
    node: str = Field(description="Node the hook ran on.")
    state: HookState = Field(description="pending, running, done, failed or timed_out.")
    exit_code: int | None = Field(description="Exit code of the command.")
    output: str = Field(description="Last 64 KB of the command's output.")
    duration_s: float | None = Field(description="How long the command ran.")
    error: str = Field(description="Why it could not run, if it could not.")


class UploadView(_View):
    trace_id: str = Field(description="Trace uploaded.")
    state: UploadState = Field(description="pending, done or failed.")
    path: str = Field(description="Source path on its node.")
    dest: str = Field(description="Destination URL.")
    error: str = Field(description="Why the upload failed, if it did.")
    node_id: str | None = Field(None, description="Node that holds the file and uploads it.")


SessionView.model_rebuild()


class FiringView(_View):
    firing_id: str = Field(description="Id of this firing ('<trigger_id>.<n>').")
    at: float = Field(description="Unix time the condition held.")
    state: str = Field(
        description="due (its session starts, or waits for ranks a live session holds), "
        "fired (its session exists) or failed (its session was refused)."
    )
    session_id: str | None = Field(description="The session it started.")
    error: str | None = Field(description="Why its session was refused (failed only).")
    evidence: dict = Field(
        description="rank, role, agent_id, mark ('step' or the stage), observed_s, "
        "baseline_s (the role's rolling median), factor, baseline_samples, step (the rank's "
        "step as the coordinator knew it then), kind (the trigger's). straggler: observed_s "
        "and late_s are its stage's end minus the peers' median end (peer_median_end_s; "
        "end_s its own, coordinator wall clock) in step, baseline_s and threshold_s the "
        "rule's bar, factor null, baseline_samples the peers compared, peer_rank the healthy "
        "peer, cause (late start, long duration or both). oom: error, snapshot_path (a "
        "torch_memory snapshot or null), mark the stage it left ('step': a step mark), "
        "observed_s and baseline_s 0, factor null."
    )


class TriggerView(_View):
    trigger_id: str = Field(description="Id, as returned by POST /api/v1/triggers.")
    name: str = Field(description="Its name.")
    request: dict = Field(description="The trigger as validated (defaults filled in).")
    created_at: float = Field(description="Unix time it was created.")
    fired: int = Field(description="Sessions it started (in the firings kept).")
    suppressed: dict[str, int] = Field(
        description="Times the condition held but no session started: cooldown, "
        "max_per_hour, disk_budget."
    )
    disk_bytes: int = Field(description="Trace bytes of the sessions it started.")
    firings: list[FiringView] = Field(description="Its newest firings (at most 50), newest first.")
    idle_reason: str | None = Field(
        default=None,
        description="Why it cannot judge anything now: no alive agent of its role, or its "
        "role's agents report times but none of the mark it watches (the ones they do time "
        "are named: a misspelt stage, a role prefix); null when it can.",
    )


class StackFrameView(_View):
    function: str = Field(description="The function's qualified name (as py-spy names it).")
    file: str = Field(description="Its source file.")
    line: int = Field(description="The line it is at.")


class StackRankView(_View):
    role: str = Field(description="The agent's role.")
    rank: int = Field(description="Its rank in the role.")
    pid: int = Field(description="Its process id.")
    node: str = Field(description="The host name of the process's node.")
    method: str = Field(description="Who read the stack: py_spy, or agent (its own thread).")
    thread: str = Field("", description="The name of the thread shown (the training thread).")


class StackGroupView(_View):
    stack: list[StackFrameView] = Field(description="The frames, innermost first.")
    ranks: list[StackRankView] = Field(description="The processes with exactly this stack.")


class StackMissingView(_View):
    role: str = Field(description="The agent's role ('*' for a rank asked of every role).")
    rank: int | None = Field(description="Its rank.")
    pid: int | None = Field(None, description="Its process id, when an agent was found.")
    node: str | None = Field(None, description="The host name of its node, when found.")
    reason: str = Field(description="Why no stack came back.")


class StacksView(_View):
    """``GET /api/v1/stacks``: where every attached process's training thread is now."""

    groups: list[StackGroupView] = Field(
        description="Processes grouped by identical stack, the smallest (odd) groups first."
    )
    missing: list[StackMissingView] = Field(
        default_factory=list, description="Processes asked that gave no stack, with why."
    )
    method: str = Field(description="The method asked for: auto, py_spy or agent.")
    native: bool = Field(description="Native frames were asked for (py-spy only).")
    notes: list[str] = Field(default_factory=list, description="What the reader should know.")
    taken_at: float = Field(description="When the stacks were read (Unix time).")
