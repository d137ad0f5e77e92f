"""The straggler rule for a whole group at once (``against_all``) gives exactly what the rule
gives member by member (``against_peers``: the median of the others, their deviation), with
ties, groups of two, odd and even sizes; a group of one has no peers."""

from __future__ import annotations

import random

import pytest

from profd.core.peer_rule import against_all, against_peers


@pytest.mark.parametrize("kind", ["spread", "ties", "mixed"])
def test_the_whole_group_at_once_is_the_rule_member_by_member(kind: str) -> None:
    rng = random.Random(kind)
    for _ in range(600):
        n = rng.randrange(2, 60)
        if kind == "spread":
            values = [rng.uniform(-50, 150) for _ in range(n)]
        elif kind == "ties":
            values = [float(rng.randrange(4)) for _ in range(n)]
        else:
            values = [rng.choice([0.1 + 0.2, 0.3, 2.5, -1.0, 1e9]) for _ in range(n)]
        floor, k = rng.choice([0.0, 0.5, 20.0]), rng.choice([3.0, 1.0])
        want = [against_peers(values, i, floor, k) for i in range(n)]
        assert list(against_all(values, floor, k).rows()) == want  # the same floats, not close


def test_a_member_alone_has_no_peers() -> None:
    with pytest.raises(ValueError, match="values"):
        against_all([1.0], 0.0, 3.0)
