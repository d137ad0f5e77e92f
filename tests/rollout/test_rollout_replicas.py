"""Replica map: global GPU ranks → replicas, keep sets, and what is reported instead of dropped."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from profd.core.request import RoleProfilerConfig
from profd.rollout.replicas import ReplicaMap, ReplicaParallelism, select_replicas


def block(**kw) -> RoleProfilerConfig:
    return RoleProfilerConfig(**kw)


def test_replica_owns_a_contiguous_range_of_global_ranks() -> None:
    m = ReplicaMap(world_size_per_replica=2, replicas=4)
    assert m.rank_range(0) == range(0, 2) and m.rank_range(3) == range(6, 8)
    assert [m.replica_of(g) for g in range(9)] == [0, 0, 1, 1, 2, 2, 3, 3, None]
    assert m.replica_of(-1) is None
    assert m.global_rank(2, 1) == 5 and m.local_rank(5) == 1
    with pytest.raises(ValueError, match="local_rank"):
        m.global_rank(0, 2)


def test_documented_example_tp2_ranks_0_and_8() -> None:
    # Reference §8.5: tp=2, ranks [0, 8] → replicas 0 and 4, keep {0, 8}.
    sel = select_replicas(block(ranks=(8, 0)), ReplicaMap(2, 8))
    assert sel.replicas == (0, 4)
    assert sel.keep_global_ranks == frozenset({0, 8})
    assert sel.ignored == ()


def test_all_ranks_selects_every_replica_and_keeps_every_file() -> None:
    sel = select_replicas(block(all_ranks=True, ranks=(3,)), ReplicaMap(4, 3))
    assert sel.replicas == (0, 1, 2) and sel.keep_global_ranks is None


def test_empty_ranks_selects_the_replica_owning_rank_0() -> None:
    sel = select_replicas(block(), ReplicaMap(4, 3))
    assert sel.replicas == (0,) and sel.keep_global_ranks is None and sel.ignored == ()


def test_rank_on_a_missing_replica_is_reported_with_rank_and_replica_count() -> None:
    sel = select_replicas(block(ranks=(1, 9, 40)), ReplicaMap(4, 2))
    assert sel.replicas == (0,)
    assert sel.keep_global_ranks == frozenset({1})
    reasons = {i.rank: i.reason for i in sel.ignored}
    assert set(reasons) == {9, 40}
    assert "global rank 9" in reasons[9] and "replica 2" in reasons[9]
    assert "only 2 replica(s)" in reasons[9] and "0..7" in reasons[9]
    assert all(i.role == "rollout" for i in sel.ignored)


def test_replica_without_agent_is_reported() -> None:
    sel = select_replicas(block(ranks=(0, 5)), ReplicaMap(2, 4), available=[0, 1])
    assert sel.replicas == (0,) and sel.keep_global_ranks == frozenset({0})
    (ign,) = sel.ignored
    assert ign.rank == 5 and "no rollout agent registered for replica 2" in ign.reason
    empty = select_replicas(block(), ReplicaMap(2, 4), available=[1])
    assert empty.replicas == () and "replica 0" in empty.ignored[0].reason
    assert select_replicas(
        block(all_ranks=True), ReplicaMap(2, 4), available=[3, 1, 9]
    ).replicas == (
        1,
        3,
    )


def test_disabled_block_selects_nothing_and_says_so() -> None:
    sel = select_replicas(block(enable=False, all_ranks=True), ReplicaMap(1, 2))
    assert sel.replicas == () and "enable=false" in sel.ignored[0].reason


def test_bad_sizes_fail_early_naming_the_field() -> None:
    with pytest.raises(ValueError, match="world_size_per_replica"):
        ReplicaMap(0, 1)
    with pytest.raises(ValueError, match="replicas"):
        ReplicaMap(2, True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tp"):
        ReplicaParallelism(tp=0)
    with pytest.raises(ValueError, match="tp, dp, pp"):
        ReplicaParallelism.of((2, 1))
    assert ReplicaParallelism.of((2, 3, 4)).world_size == 24
    assert ReplicaParallelism.of({"tp": 2}).world_size == 2


@settings(max_examples=300, deadline=None)
@given(
    w=st.integers(1, 8),
    n=st.integers(1, 6),
    ranks=st.lists(st.integers(0, 70), max_size=12),
    available=st.none() | st.sets(st.integers(0, 7)),
)
def test_every_requested_rank_is_kept_or_reported(w, n, ranks, available) -> None:
    m = ReplicaMap(w, n)
    sel = select_replicas(block(ranks=tuple(ranks)), m, available=available)
    if not ranks:
        return
    have = set(range(n)) if available is None else set(available)
    keep = sel.keep_global_ranks or frozenset()
    reported = {i.rank for i in sel.ignored}
    # Nothing silent: each requested rank is exactly one of kept / reported.
    assert keep | reported == set(ranks) and not keep & reported
    # The selected replicas are exactly the owners of the kept ranks, each one with an agent.
    assert set(sel.replicas) == {g // w for g in keep}
    assert set(sel.replicas) <= have and list(sel.replicas) == sorted(sel.replicas)
    for g in keep:
        assert g in m.rank_range(g // w)
    for g in reported:
        assert g // w >= n or g // w not in have
