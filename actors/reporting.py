"""Views the coordinator answers with: sessions and metrics (pure functions)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from profd.actors.registry import AgentRegistry
from profd.actors.sessions import Session
from profd.core.request import RoleProfilerConfig
from profd.core.states import PartState
from profd.core.views import (
    HookView,
    IgnoredView,
    PartView,
    ProgressView,
    SessionView,
    TraceView,
    UploadView,
)

__all__ = ["metrics_snapshot", "progress_of", "session_view"]


def session_view(
    s: Session,
    blocks: dict[str, RoleProfilerConfig],
    traces: Iterable[TraceView],
    request: dict[str, Any] | None = None,
) -> SessionView:
    """``request``: ``s.request`` dumped to JSON, when the caller keeps it."""
    return SessionView(
        session_id=s.session_id,
        state=s.state,
        reason=s.reason,
        tool=s.request.tool.value,
        steps=list(s.steps) if s.steps is not None else None,
        groups=[list(g) for g in s.groups],
        discrete_roles=sorted(
            k for k, b in blocks.items() if b.discrete and s.request.duration_s is None
        ),
        save_dir=s.save_dir,
        created_at=s.created_at,
        finished_at=s.finished_at,
        deadline=s.deadline,
        targets=[
            PartView.model_construct(  # from the coordinator's own typed parts: valid
                agent_id=p.agent_id,
                role=p.role,
                rank=p.rank,
                role_block=p.role_block,
                state=p.state,
                reason=p.reason,
                recorded_steps=sorted(p.recorded),
                missed_steps=sorted(p.missed),
                traces=list(p.traces),
                armed_at=p.armed_at,
                agent_done=p.ended_by_agent,
            )
            for p in sorted(s.targets.values(), key=lambda p: (p.role, p.rank))
        ],
        progress=progress_of(s),
        ignored=[IgnoredView(role=i.role, rank=i.rank, reason=i.reason) for i in s.ignored],
        traces=[t for t in traces if t.session_id == s.session_id],
        warnings=list(s.warnings),
        hooks=[HookView.model_validate(h.to_dict()) for h in s.hooks.values()],
        uploads=[
            UploadView(
                trace_id=tid,
                state=u.state,
                path=u.path,
                dest=u.dest,
                error=u.error,
                node_id=u.node_id,
            )
            for tid, u in s.uploads.items()
        ],
        request=request if request is not None else s.request.model_dump(mode="json"),
        trigger_id=(s.origin or {}).get("trigger_id"),
        evidence=(s.origin or {}).get("evidence"),
    )


_WROTE = (PartState.DONE, PartState.PARTIAL)


def progress_of(s: Session) -> ProgressView:
    """Steps recorded out of steps planned, across targets: what a progress bar shows."""
    parts = list(s.targets.values())
    wanted = set(s.steps or ())
    planned = len(wanted) * len(parts)
    recorded = sum(len(p.recorded & wanted) for p in parts)
    missed = sum(len((p.missed - p.recorded) & wanted) for p in parts)
    finished = sum(1 for p in parts if p.state.is_terminal)
    if planned:
        fraction = recorded / planned
    else:  # a timed window: the targets whose window ended with traces
        wrote = sum(1 for p in parts if p.traces and p.state in _WROTE)
        fraction = wrote / len(parts) if parts else 0.0
    return ProgressView(
        planned_steps=planned,
        recorded_steps=recorded,
        missed_steps=missed,
        targets=len(parts),
        targets_finished=finished,
        fraction=round(fraction, 4),
    )


def metrics_snapshot(
    registry: AgentRegistry,
    sessions: Iterable[Session],
    written: dict[str, list[int]],
    stalls: dict[str, list[float]],
    *,
    events: int,
    reports: int,
    uptime_s: float,
    duplicate_events: int = 0,
    rejected_events: int = 0,
    mark_times: dict[str, list[list[Any]]] | None = None,
    triggers: dict[str, dict[str, int]] | None = None,
) -> dict[str, Any]:
    """A snapshot for the sidecar's Prometheus endpoint (``written``: tool -> ``[files,
    bytes]`` of the traces indexed; ``stalls``: tool -> ``[count, sum, max]``; ``events``
    and ``reports``: agent events and reports since the coordinator started;
    ``duplicate_events``: events received again and dropped; ``rejected_events``: events
    that could not be applied (logged, skipped); ``mark_times``: live step and
    stage times, :meth:`~profd.actors.mark_stats.MarkStats.metric_rows`; ``triggers``: per
    trigger name, sessions started and conditions suppressed by reason)."""
    agents = Counter(f"{r.info.role}|{r.state.value}" for r in registry.all())
    by_state: Counter[str] = Counter()
    hooks: Counter[str] = Counter()
    uploads: Counter[str] = Counter()
    for s in sessions:
        by_state[s.state.value] += 1
        hooks.update(h.state.value for h in s.hooks.values())
        uploads.update(u.state.value for u in s.uploads.values())
    return {
        "agents": dict(agents),
        "sessions": dict(by_state),
        "traces": written,
        "stalls": {k: list(v) for k, v in stalls.items()},
        "hooks": dict(hooks),
        "uploads": dict(uploads),
        "events_total": events,
        "reports_total": reports,
        "duplicate_events_total": duplicate_events,
        "rejected_events_total": rejected_events,
        "uptime_s": uptime_s,
        "mark_times": mark_times or {"step": [], "stage": []},
        "triggers": triggers or {},
    }
