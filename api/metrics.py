"""Prometheus ``/metrics``: the coordinator's ``metrics()`` snapshot as a custom collector.

Each app has its own :class:`~prometheus_client.CollectorRegistry` (never the global one),
holding one :class:`CoordinatorCollector`. A scrape asks the coordinator for a fresh snapshot
and renders it; when the coordinator does not answer, ``profd_coordinator_up`` is 0 and the
scrape still succeeds.

Live step and stage times (``profd_step_seconds``, ``profd_stage_seconds``): summaries per
(role, rank[, stage]) whose ``quantile="0.5"`` is the rolling median of the agent's last 256
durations and whose ``_count`` / ``_sum`` count every duration the coordinator received from
that agent; ``profd_step_seconds_last`` / ``profd_stage_seconds_last`` hold the last one. At
most 64 ranks per (role, stage) — the slowest by median — see
:mod:`profd.actors.mark_stats`.

Rates: ``profd_coordinator_events_total`` is a counter (reset when the coordinator restarts),
so use ``rate(profd_coordinator_events_total[1m])``; ``profd_coordinator_event_rate`` is the
average since the coordinator started (events / uptime), for a glance without PromQL.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from profd.api.deps import ClientDep, ReadTokenDep
from profd.api.errors import error_responses
from profd.core.errors import CoordinatorUnavailable

__all__ = ["CoordinatorCollector", "new_registry", "router"]

log = logging.getLogger(__name__)

router = APIRouter(tags=["metrics"])


class CoordinatorCollector(Collector):
    """Turns one coordinator snapshot into metric families (set :attr:`snapshot` first)."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] | None = None
        #: The last snapshot rendered and its text: a snapshot shared by many requests
        #: (``SharedReads``) is rendered once.
        self.rendered: tuple[dict[str, Any], bytes] | None = None

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        up = GaugeMetricFamily("profd_coordinator_up", "1 when the coordinator answered.")
        up.add_metric([], 1.0 if snap is not None else 0.0)
        yield up
        if snap is None:
            return
        yield from _registry_families(snap)
        yield from _trace_families(snap)
        yield from _activity_families(snap)
        yield from _mark_time_families(snap)
        yield from _trigger_families(snap)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families depend on the snapshot; skip the registration-time collect


def _labelled(
    family: GaugeMetricFamily, items: dict[str, float], labels: int = 1
) -> GaugeMetricFamily:
    """One sample per key; keys of several labels are "a|b" (only the first may hold "|")."""
    extra = labels - 1
    for key, value in sorted(items.items()):
        family.add_metric(key.rsplit("|", extra) if extra else [key], float(value))
    return family


def _registry_families(snap: dict[str, Any]) -> Iterator[Metric]:
    yield _labelled(
        GaugeMetricFamily(
            "profd_agents",
            "Agents by role and state (alive, lost, closed).",
            labels=["role", "state"],
        ),
        snap.get("agents", {}),
        labels=2,
    )
    yield _labelled(
        GaugeMetricFamily("profd_sessions", "Sessions by state.", labels=["state"]),
        snap.get("sessions", {}),
    )
    yield _labelled(
        GaugeMetricFamily(
            "profd_finish_hooks", "Finish-hook runs by outcome state.", labels=["state"]
        ),
        snap.get("hooks", {}),
    )
    yield _labelled(
        GaugeMetricFamily("profd_uploads", "Trace uploads by outcome state.", labels=["state"]),
        snap.get("uploads", {}),
    )


def _trace_families(snap: dict[str, Any]) -> Iterator[Metric]:
    traces = CounterMetricFamily("profd_traces", "Trace files written, by tool.", labels=["tool"])
    size = CounterMetricFamily(
        "profd_trace_bytes", "Bytes of trace files written, by tool.", labels=["tool"]
    )
    for tool, (count, nbytes) in sorted(snap.get("traces", {}).items()):
        traces.add_metric([tool], float(count))
        size.add_metric([tool], float(nbytes))
    yield traces
    yield size
    stall = SummaryMetricFamily(
        "profd_export_stall_seconds",
        "Training-thread stall at the end of a profiled window (stop + hand-off), by tool.",
        labels=["tool"],
    )
    worst = GaugeMetricFamily(
        "profd_export_stall_seconds_max", "Longest such stall, by tool.", labels=["tool"]
    )
    for tool, (count, total, peak) in sorted(snap.get("stalls", {}).items()):
        stall.add_metric([tool], count_value=float(count), sum_value=float(total))
        worst.add_metric([tool], float(peak))
    yield stall
    yield worst


def _activity_families(snap: dict[str, Any]) -> Iterator[Metric]:
    events = float(snap.get("events_total", 0))
    uptime = float(snap.get("uptime_s", 0.0))
    fam = CounterMetricFamily("profd_coordinator_events", "Agent events the coordinator received.")
    fam.add_metric([], events)
    yield fam
    fam = CounterMetricFamily(
        "profd_coordinator_reports", "Event reports (batches) the coordinator received."
    )
    fam.add_metric([], float(snap.get("reports_total", 0)))
    yield fam
    fam = CounterMetricFamily(
        "profd_coordinator_duplicate_events",
        "Agent events received again (a report sent again after a timeout) and dropped.",
    )
    fam.add_metric([], float(snap.get("duplicate_events_total", 0)))
    yield fam
    fam = CounterMetricFamily(
        "profd_coordinator_rejected_events",
        "Agent events that could not be applied (a broken agent's payload): logged, skipped.",
    )
    fam.add_metric([], float(snap.get("rejected_events_total", 0)))
    yield fam
    fam = GaugeMetricFamily(
        "profd_coordinator_event_rate",
        "Events per second averaged since the coordinator started (prefer rate() on "
        "profd_coordinator_events_total).",
    )
    fam.add_metric([], events / uptime if uptime > 0 else 0.0)
    yield fam
    fam = GaugeMetricFamily("profd_coordinator_uptime_seconds", "Seconds since it started.")
    fam.add_metric([], uptime)
    yield fam


def _mark_time_families(snap: dict[str, Any]) -> Iterator[Metric]:
    """Step and stage times: a summary (rolling median as quantile 0.5, count and sum of
    every duration) and a gauge of the last duration, per (role, rank[, stage])."""
    times = snap.get("mark_times") or {}
    for kind, names in (("step", ["role", "rank"]), ("stage", ["role", "rank", "stage"])):
        name = f"profd_{kind}_seconds"
        what = "step mark (with agent.step(n))" if kind == "step" else "stage mark"
        summary = Metric(
            name,
            f"Duration of each {what}: quantile 0.5 is the rolling median of the agent's "
            "last 256; _count and _sum cover every duration received.",
            "summary",
        )
        last = GaugeMetricFamily(f"{name}_last", f"Duration of the last {what}.", labels=names)
        for row in times.get(kind, []):
            *ident, last_s, median_s, count, total = row
            labels = dict(zip(names, (str(v) for v in ident), strict=True))
            summary.add_sample(name, {**labels, "quantile": "0.5"}, float(median_s))
            summary.add_sample(f"{name}_count", labels, float(count))
            summary.add_sample(f"{name}_sum", labels, float(total))
            last.add_metric([labels[n] for n in names], float(last_s))
        yield summary
        yield last


def _trigger_families(snap: dict[str, Any]) -> Iterator[Metric]:
    """Per trigger (by name): sessions it started, and holding conditions it suppressed."""
    fired = CounterMetricFamily(
        "profd_trigger_firings", "Sessions a trigger started.", labels=["trigger"]
    )
    quiet = CounterMetricFamily(
        "profd_trigger_suppressed",
        "Times a trigger's condition held but no session started (cooldown, max_per_hour, "
        "disk_budget).",
        labels=["trigger", "reason"],
    )
    for name, counts in sorted((snap.get("triggers") or {}).items()):
        fired.add_metric([name], float(counts.get("fired", 0)))
        for reason, n in sorted(counts.items()):
            if reason != "fired":
                quiet.add_metric([name, reason], float(n))
    yield fired
    yield quiet


def new_registry() -> tuple[CollectorRegistry, CoordinatorCollector]:
    """A registry of one app's own, with its coordinator collector."""
    registry = CollectorRegistry(auto_describe=False)
    collector = CoordinatorCollector()
    registry.register(collector)
    return registry, collector


@router.get(
    "/metrics",
    dependencies=[ReadTokenDep],
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text exposition format",
            "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
        },
        **error_responses(401, 403),
    },
)
async def metrics(request: Request, client: ClientDep) -> Response:
    """Agents, sessions, traces, export stalls, hooks, uploads, coordinator activity, and
    live step and stage times."""
    try:
        snapshot = await client.call("metrics")
    except CoordinatorUnavailable as exc:
        log.warning("metrics: %s", exc.message)
        snapshot = None
    registry, collector = request.app.state.metrics
    kept = collector.rendered
    if snapshot is not None and kept is not None and kept[0] is snapshot:
        return Response(kept[1], media_type=CONTENT_TYPE_LATEST)
    collector.snapshot = snapshot  # no await between here and the render: no interleaving
    body = generate_latest(registry)
    collector.rendered = (snapshot, body) if snapshot is not None else None
    return Response(body, media_type=CONTENT_TYPE_LATEST)
