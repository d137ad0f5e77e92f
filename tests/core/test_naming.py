"""The trace stem grammar (reference §6.1) against the reference's examples (§6.3)."""

from __future__ import annotations

from datetime import datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from profd.core.naming import (
    format_timestamp,
    mb_suffix,
    parse_trace_name,
    part_suffix,
    sanitize,
    trace_stem,
)

WHEN = datetime(2026, 8, 14, 12, 27, 31, 89_456)
TS = "20260814122731089"


def test_timestamp_is_17_digits_with_milliseconds() -> None:
    assert format_timestamp(WHEN) == TS


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            dict(prefix="actor_rollout_ref", scope="train", step=1, rank=0, world_size=16),
            f"actor-rollout-ref_train_step1_rank0-of-16_pid10256_{TS}",
        ),
        (
            dict(
                prefix="actor",
                scope="train",
                rank=5,
                world_size=16,
                topology={"tp": 1, "pp": 0, "dp": 2, "cp": 0},
            ),
            f"actor_train_rank5-of-16_tp1-pp0-dp2-cp0_pid10256_{TS}",
        ),
        (
            dict(prefix="value_model", step=3, rank=5, world_size=16),
            f"value-model_step3_rank5-of-16_pid10256_{TS}",
        ),
        (dict(prefix="ref", rank=5, world_size=16), f"ref_rank5-of-16_pid10256_{TS}"),
        (dict(rank=3), f"rank3_pid10256_{TS}"),
        (
            dict(prefix="actor/rollout", scope="update actor", rank=0),
            f"actor-rollout_update-actor_rank0_pid10256_{TS}",
        ),
        (
            dict(rank=7, world_size=8, topology={"dp": 0, "tp": 1}),
            f"rank7-of-8_tp1-dp0_pid10256_{TS}",
        ),
        (dict(rank=2, world_size=0), f"rank2_pid10256_{TS}"),
        (dict(scope="__x__", rank=0), f"x_rank0_pid10256_{TS}"),
        (dict(prefix="v1.5+rc=2", rank=0), f"v1.5+rc=2_rank0_pid10256_{TS}"),
        (dict(step=0, rank=0), f"step0_rank0_pid10256_{TS}"),
    ],
)
def test_reference_examples(kwargs: dict, expected: str) -> None:
    assert trace_stem(pid=10256, when=WHEN, **kwargs) == expected


def test_suffixes() -> None:
    assert mb_suffix(3, 4) == "_mb3-4"
    assert mb_suffix(5, 5) == "_mb5"
    assert part_suffix(0) == "" and part_suffix(2) == "_part2"


def test_sanitize_rules() -> None:
    assert sanitize("a_b c/d") == "a-b-c-d"
    assert sanitize("--keep--inner--") == "keep--inner"
    assert sanitize(12) == "12"


def test_parse_reads_back_fields() -> None:
    stem = trace_stem(
        prefix="actor_rollout_ref",
        scope="actor_update",
        step=2,
        rank=0,
        world_size=8,
        topology={"tp": 1, "dp": 0},
        pid=10256,
        when=WHEN,
    )
    parts = parse_trace_name(stem + "_mb3-4.json.gz")
    assert parts is not None
    assert parts.head == ("actor-rollout-ref", "actor-update")
    assert (parts.step, parts.rank, parts.world_size) == ("2", 0, 8)
    assert parts.parallel == {"tp": 1, "dp": 0}
    assert (parts.pid, parts.timestamp, parts.suffix) == (10256, TS, "_mb3-4")
    assert parse_trace_name("worker_process_123.nsys-rep") is None


@given(
    prefix=st.one_of(st.none(), st.text(min_size=1, max_size=12)),
    scope=st.one_of(st.none(), st.text(min_size=1, max_size=12)),
    step=st.one_of(st.none(), st.integers(0, 10**6)),
    rank=st.integers(0, 4096),
    world=st.one_of(st.none(), st.integers(1, 4096)),
    topo=st.dictionaries(st.sampled_from(["tp", "pp", "dp", "cp", "ep"]), st.integers(0, 64)),
)
def test_stems_always_parse_back(prefix, scope, step, rank, world, topo) -> None:
    stem = trace_stem(
        prefix=prefix,
        scope=scope,
        step=step,
        rank=rank,
        world_size=world,
        topology=topo,
        pid=42,
        when=WHEN,
    )
    parts = parse_trace_name(stem + ".json.gz")
    assert parts is not None, stem
    assert parts.rank == rank and parts.pid == 42 and parts.timestamp == TS
    assert parts.step == (None if step is None else str(step))
    assert parts.parallel == {k: v for k, v in topo.items() if k != "ep"}
    assert "/" not in stem and " " not in stem
