"""Rollout replicas: which replicas own the requested global GPU ranks (reference §4.2).

A rollout replica spans ``tp × dp × pp`` GPUs. With ``W`` GPUs per replica, replica ``r`` owns
the global ranks ``[r·W, (r+1)·W)``. A request names *global GPU ranks*; the engine is always
profiled as a whole replica (its tp group must be traced together), and only the requested
GPUs' files are brought up into the session directory (:mod:`profd.rollout.relocate`).

Rules, as verl applies them, except that nothing is dropped silently:

* ``enable: false`` → nothing, reported;
* ``all_ranks`` → every replica, every file comes up (keep set ``None``);
* non-empty ``ranks`` → the replicas owning them; keep set = the requested ranks that exist;
* empty ``ranks`` → the replica owning global rank 0, every file of it comes up (as verl);
* a rank on a replica that does not exist, or on a replica without a registered agent, is
  reported in ``ignored`` with the reason (verl drops it silently).

No Ray or torch import; pure functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Protocol

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from profd.core.protocol import Ignored

__all__ = [
    "ROLLOUT_ROLE",
    "ReplicaMap",
    "ReplicaParallelism",
    "ReplicaSelection",
    "select_replicas",
]

#: Role name rollout agents register with.
ROLLOUT_ROLE = "rollout"

PosInt = Annotated[StrictInt, Field(gt=0)]


class ReplicaParallelism(BaseModel):
    """How one replica's GPUs are split. The world size of a replica is ``tp × dp × pp``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tp: PosInt = Field(1, description="Tensor-parallel size.")
    dp: PosInt = Field(1, description="Data-parallel size inside the replica.")
    pp: PosInt = Field(1, description="Pipeline-parallel size.")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    @classmethod
    def of(cls, value: ReplicaParallelism | tuple[int, int, int] | dict) -> ReplicaParallelism:
        """Accept a model, a ``(tp, dp, pp)`` tuple or a mapping."""
        if isinstance(value, ReplicaParallelism):
            return value
        if isinstance(value, tuple | list):
            if len(value) != 3:
                raise ValueError(f"parallelism: expected (tp, dp, pp), got {value!r}")
            tp, dp, pp = value
            return cls(tp=tp, dp=dp, pp=pp)
        return cls.model_validate(value)


class _RankBlock(Protocol):
    """What :func:`select_replicas` reads from a role block (``RoleProfilerConfig`` fits)."""

    enable: bool
    all_ranks: bool
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReplicaSelection:
    """Replicas to profile, the global ranks whose files come up, and what was not used.

    ``keep_global_ranks`` is ``None`` when every file of the selected replicas comes up.
    """

    replicas: tuple[int, ...]
    keep_global_ranks: frozenset[int] | None
    ignored: tuple[Ignored, ...] = field(default=())


class ReplicaMap:
    """``replicas`` replicas of ``world_size_per_replica`` GPUs each, laid out back to back."""

    __slots__ = ("replicas", "world_size")

    def __init__(self, world_size_per_replica: int, replicas: int) -> None:
        for name, value in (
            ("world_size_per_replica", world_size_per_replica),
            ("replicas", replicas),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        self.world_size = world_size_per_replica
        self.replicas = replicas

    def __repr__(self) -> str:
        return f"ReplicaMap(world_size_per_replica={self.world_size}, replicas={self.replicas})"

    @property
    def total_ranks(self) -> int:
        return self.world_size * self.replicas

    def rank_range(self, replica: int) -> range:
        """Global ranks owned by ``replica``."""
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica: must be in 0..{self.replicas - 1}, got {replica}")
        return range(replica * self.world_size, (replica + 1) * self.world_size)

    def replica_of(self, global_rank: int) -> int | None:
        """The replica owning ``global_rank``, or ``None`` when no such replica exists."""
        if global_rank < 0:
            return None
        replica = global_rank // self.world_size
        return replica if replica < self.replicas else None

    def local_rank(self, global_rank: int) -> int:
        """Offset of ``global_rank`` inside its replica."""
        return global_rank % self.world_size

    def global_rank(self, replica: int, local_rank: int) -> int:
        if not 0 <= local_rank < self.world_size:
            raise ValueError(f"local_rank: must be in 0..{self.world_size - 1}, got {local_rank}")
        return self.rank_range(replica).start + local_rank

    def describe_range(self, replica: int) -> str:
        r = self.rank_range(replica)
        return f"global ranks {r.start}..{r.stop - 1}"


def select_replicas(
    block: _RankBlock,
    replica_map: ReplicaMap,
    available: Iterable[int] | None = None,
    role: str = ROLLOUT_ROLE,
) -> ReplicaSelection:
    """Apply a role block's rank rule to global GPU ranks.

    ``available`` lists the replicas that have a registered agent (``None``: all of them). A
    replica that exists but has no agent is reported for each requested rank it owns.
    """
    have = set(range(replica_map.replicas)) if available is None else set(available)
    if not block.enable:
        return ReplicaSelection(
            (), frozenset(), (Ignored(role, None, "role block has enable=false"),)
        )
    if block.all_ranks:
        chosen = tuple(sorted(r for r in have if 0 <= r < replica_map.replicas))
        return ReplicaSelection(chosen, None)
    if not block.ranks:
        # verl: an empty list profiles the replica owning rank 0 and brings all its files up.
        if 0 in have:
            return ReplicaSelection((0,), None)
        reason = f"no rollout agent registered for replica 0 ({replica_map.describe_range(0)})"
        return ReplicaSelection((), frozenset(), (Ignored(role, 0, reason),))
    return _select_listed(sorted(set(block.ranks)), replica_map, have, role)


def _select_listed(
    ranks: list[int], replica_map: ReplicaMap, have: set[int], role: str
) -> ReplicaSelection:
    replicas: set[int] = set()
    keep: set[int] = set()
    ignored: list[Ignored] = []
    for g in ranks:
        replica = replica_map.replica_of(g)
        if replica is None:
            reason = (
                f"global rank {g} would be on replica {g // replica_map.world_size}, but only "
                f"{replica_map.replicas} replica(s) of {replica_map.world_size} GPU(s) exist "
                f"(global ranks 0..{replica_map.total_ranks - 1})"
            )
            ignored.append(Ignored(role, g, reason))
        elif replica not in have:
            reason = (
                f"no rollout agent registered for replica {replica} "
                f"({replica_map.describe_range(replica)}), which owns global rank {g}"
            )
            ignored.append(Ignored(role, g, reason))
        else:
            replicas.add(replica)
            keep.add(g)
    return ReplicaSelection(tuple(sorted(replicas)), frozenset(keep), tuple(ignored))
