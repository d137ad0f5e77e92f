"""Who is profiled: role matching and rank selection, implemented once (reference §4.1).

Rank rule of one role block: ``all_ranks`` → every rank; else a non-empty ``ranks`` → those
ranks; else rank 0. Unlike verl, a requested rank that no agent has is *reported*, never
silently dropped. The finish-hook rule is
:func:`profd.actors.finisher.hook_agents` (it chooses agents, one per node by default).

Role matching: an agent registered as ``actor_rollout_ref`` hosts the actor, rollout and ref
roles in one process. A request block matches an agent when its key equals the agent's role,
or names one of the agent's component roles. When several blocks match one agent, the exact
role wins, then the component that comes first in the agent's role (so ``actor`` governs
``actor_rollout_ref``, as in verl); ``"*"`` matches what nothing else matched.

No Ray or torch import; pure functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from profd.core.protocol import Ignored
from profd.core.request import RoleProfilerConfig

__all__ = [
    "WILDCARD",
    "RankSelection",
    "match_role_block",
    "rank_ranges",
    "role_components",
    "select_ranks",
]

WILDCARD = "*"
#: Role names verl uses; a registered role is split into these where it is a combination.
KNOWN_ROLES = ("actor", "rollout", "ref", "critic", "reward", "reward_model", "value_model")


@dataclass(frozen=True, slots=True)
class RankSelection:
    selected: tuple[int, ...]
    ignored: tuple[Ignored, ...] = field(default=())


def select_ranks(
    role: str, block: RoleProfilerConfig, available: Iterable[int], world_size: int | None = None
) -> RankSelection:
    """Apply the rank rule of ``block`` to the ranks that have a live agent."""
    have = sorted(set(available))
    if not block.enable:
        return RankSelection((), (Ignored(role, None, "role block has enable=false"),))
    if block.all_ranks:
        return RankSelection(tuple(have))
    wanted = sorted(set(block.ranks)) if block.ranks else [0]
    chosen = [r for r in wanted if r in have]
    ignored = []
    for r in wanted:
        if r in have:
            continue
        if world_size is not None and r >= world_size:
            reason = f"rank {r} out of range (world_size {world_size})"
        else:
            reason = f"no agent registered for rank {r}"
        ignored.append(Ignored(role, r, reason))
    return RankSelection(tuple(chosen), tuple(ignored))


def role_components(role: str) -> tuple[str, ...]:
    """Split a combined role (``actor_rollout_ref``) into the known roles it hosts, in order."""
    parts = role.split("_")
    out: list[str] = []
    i = 0
    while i < len(parts):
        # Prefer two-word roles (reward_model, value_model) over their first word.
        two = "_".join(parts[i : i + 2])
        if i + 1 < len(parts) and two in KNOWN_ROLES:
            out.append(two)
            i += 2
        elif parts[i] in KNOWN_ROLES:
            out.append(parts[i])
            i += 1
        else:
            return (role,)
    return tuple(out) or (role,)


def match_role_block(
    agent_role: str, blocks: Mapping[str, RoleProfilerConfig]
) -> tuple[str, RoleProfilerConfig] | None:
    """Pick the block governing an agent's role, or ``None`` when no block applies."""
    if agent_role in blocks:
        return agent_role, blocks[agent_role]
    for component in role_components(agent_role):
        if component in blocks:
            return component, blocks[component]
    if WILDCARD in blocks:
        return WILDCARD, blocks[WILDCARD]
    if not blocks:
        return WILDCARD, RoleProfilerConfig()
    return None


def rank_ranges(ranks: Iterable[int]) -> str:
    """Ranks as ranges: ``[0, 1, 2, 5, 7, 8]`` -> ``0-2,5,7-8``."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
