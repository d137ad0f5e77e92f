"""Resolve a session request against the registered agents (pure logic).

Every requested role and rank ends up either as a target or in ``ignored`` with the reason:
role absent, role governed by another block (colocated), rank out of range, no agent for the
rank, tool unavailable on the agent. Nothing is dropped silently.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from profd.actors.selection import (
    WILDCARD,
    RankSelection,
    match_role_block,
    rank_ranges,
    role_components,
    select_ranks,
)
from profd.core.protocol import AgentInfo, Ignored
from profd.core.request import RoleProfilerConfig, SessionRequest
from profd.rollout.replicas import ReplicaMap, select_replicas

__all__ = ["Target", "Targeting", "resolve_targets"]


@dataclass(frozen=True, slots=True)
class Target:
    agent: AgentInfo
    block_key: str
    block: RoleProfilerConfig
    #: Rollout replicas: global ranks whose engine files come up (``None`` = all).
    keep_global_ranks: frozenset[int] | None = None


@dataclass(frozen=True, slots=True)
class Targeting:
    targets: tuple[Target, ...]
    ignored: tuple[Ignored, ...]


def _about(items: Iterable[Ignored], key: str, rule: str) -> list[Ignored]:
    """``items`` saying which field of block ``key`` they are about: ``rule`` for a rank's
    (a rank no agent has, or whose coordinates differ), ``enable`` for the whole block."""
    return [
        replace(i, field=f"roles.{key}.{rule if i.rank is not None else 'enable'}")
        if i.field == "roles"
        else i
        for i in items
    ]


def _matches(info: AgentInfo, topology: dict[str, int]) -> bool:
    return all(info.topology.get(k) == v for k, v in topology.items())


def _by_topology(
    role: str,
    key: str,
    block: RoleProfilerConfig,
    ranks: dict[int, AgentInfo],
    world: int | None,
) -> tuple[dict[int, AgentInfo], RankSelection]:
    """Filter by parallel coordinates, then apply the rank rule; without ranks / all_ranks
    every matching agent is selected (a filter like ``tp=0`` means all of them)."""
    keep = {r: i for r, i in ranks.items() if _matches(i, block.topology)}
    want = " ".join(f"{k}={v}" for k, v in block.topology.items())
    if not block.enable:
        return keep, select_ranks(role, block, keep.keys(), world)
    if not block.ranks:
        if not keep:
            return keep, RankSelection(
                (), (Ignored(role, None, f"no agent has {want}", f"roles.{key}.topology"),)
            )
        return keep, RankSelection(tuple(sorted(keep)))
    sel = select_ranks(role, block, keep.keys(), world)
    ignored = []
    for item in sel.ignored:
        info = ranks.get(item.rank) if item.rank is not None else None
        if info is not None:
            have = " ".join(f"{k}={info.topology.get(k)}" for k in block.topology)
            why = f"rank {item.rank} has {have}, not {want}"
            item = Ignored(role, item.rank, why, f"roles.{key}.topology")
        ignored.append(item)
    return keep, RankSelection(sel.selected, tuple(ignored))


def _tool_refused(req: SessionRequest, info: AgentInfo) -> Ignored | None:
    """The agent cannot run the session's tool: say so, with its own reason."""
    reason = info.capabilities.get(req.tool.value, "the agent did not report this tool")
    if reason is None:
        return None
    return Ignored(info.role, info.rank, f"tool {req.tool.value} unavailable: {reason}", "tool")


def _is_rollout(ranks: dict[int, AgentInfo]) -> bool:
    return any(i.replica is not None for i in ranks.values())


def _replicas(
    req: SessionRequest,
    role: str,
    key: str,
    block: RoleProfilerConfig,
    agents: dict[int, AgentInfo],
) -> tuple[list[Target], list[Ignored]]:
    """Rollout agents (rank = replica index): requested *global GPU ranks* select replicas."""
    width = max(i.replica.world_size if i.replica else 1 for i in agents.values())
    count = max([i.world_size or 0 for i in agents.values()] + [max(agents) + 1])
    sel = select_replicas(block, ReplicaMap(width, count), available=agents.keys(), role=role)
    out, skipped = [], list(sel.ignored)
    if block.topology:
        skipped.append(
            Ignored(
                role,
                None,
                "topology does not apply to rollout replicas (select them by global GPU rank "
                "with `ranks`); it was not used",
                f"roles.{key}.topology",
            )
        )
    for replica in sel.replicas:
        info = agents[replica]
        refused = _tool_refused(req, info)
        if refused is not None:
            skipped.append(refused)
            continue
        out.append(Target(info, key, block, sel.keep_global_ranks))
    return out, skipped


def _by_job(
    req: SessionRequest, agents: Iterable[AgentInfo]
) -> tuple[dict[str, dict[str | None, dict[int, AgentInfo]]], set[str | None]]:
    """Agents by role, then Ray job, then rank (``req.job_id``'s job only, when it names
    one); and every job seen."""
    by_role: dict[str, dict[str | None, dict[int, AgentInfo]]] = {}
    jobs: set[str | None] = set()
    want = None if req.job_id == NO_JOB else req.job_id
    for info in agents:
        jobs.add(info.job_id)
        if req.job_id is not None and info.job_id != want:
            continue
        # Several agents on one (role, rank) of a job happen after a worker restart: the
        # last wins. The same (role, rank) in two jobs are two targets, never one.
        by_role.setdefault(info.role, {}).setdefault(info.job_id, {})[info.rank] = info
    return by_role, jobs


#: ``job_id`` of agents outside any Ray job (a process that attached without Ray).
NO_JOB = "none"


def _several_jobs(role: str, jobs: dict[str | None, dict[int, AgentInfo]]) -> Ignored:
    each = "; ".join(
        f"{job or f'{NO_JOB} (outside Ray)'}: ranks {rank_ranges(ranks)}"
        for job, ranks in sorted(jobs.items(), key=lambda j: j[0] or "")
    )
    reason = (
        f"role {role} has agents in {len(jobs)} Ray jobs ({each}); name one with job_id "
        "(profd profile --job)"
    )
    return Ignored(role, None, reason, "job_id")


def resolve_targets(req: SessionRequest, agents: Iterable[AgentInfo]) -> Targeting:
    """The request's targets among live ``agents``; every requested target not used is in
    ``ignored`` with the reason (nothing is dropped silently)."""
    by_job, jobs = _by_job(req, agents)
    if req.job_id is not None and (None if req.job_id == NO_JOB else req.job_id) not in jobs:
        known = ", ".join(sorted(j or NO_JOB for j in jobs))
        among = f"jobs with agents: {known}" if known else "no agent is registered"
        reason = f"no live agent of Ray job {req.job_id} ({among})"
        return Targeting((), (Ignored(WILDCARD, None, reason, "job_id"),))
    targets: list[Target] = []
    ignored: list[Ignored] = []
    used_keys: set[str] = set()
    for role in sorted(by_job):
        matched = match_role_block(role, req.roles)
        if matched is None:
            continue
        key, block = matched
        used_keys.add(key)
        if len(by_job[role]) > 1:
            if not block.enable:  # a block that profiles nothing is in no job
                ignored.append(
                    Ignored(role, None, "role block has enable=false", f"roles.{key}.enable")
                )
            else:
                ignored.append(_several_jobs(role, by_job[role]))
            continue
        (ranks,) = by_job[role].values()
        worlds = [i.world_size for i in ranks.values() if i.world_size]
        world = max(worlds) if worlds else None
        if _is_rollout(ranks):
            found, skipped = _replicas(req, role, key, block, ranks)
            targets.extend(found)
            ignored.extend(_about(skipped, key, "ranks"))
            continue
        if block.topology:
            ranks, sel = _by_topology(role, key, block, ranks, world)
        else:
            sel = select_ranks(role, block, ranks.keys(), world)
        ignored.extend(_about(sel.ignored, key, "ranks"))
        for rank in sel.selected:
            refused = _tool_refused(req, ranks[rank])
            if refused is not None:
                ignored.append(refused)
                continue
            targets.append(Target(ranks[rank], key, block))
    for key in req.roles:
        if key in used_keys or key == WILDCARD:
            continue
        hosts = [r for r in by_job if key in role_components(r)]
        if hosts:
            reason = f"role {key} runs inside {', '.join(hosts)}, governed by another block"
        else:
            known = ", ".join(sorted(by_job)) or "none"
            reason = f"no live agent has role {key} (live roles: {known})"
        ignored.append(Ignored(key, None, reason, f"roles.{key}"))
    return Targeting(tuple(targets), tuple(ignored))
