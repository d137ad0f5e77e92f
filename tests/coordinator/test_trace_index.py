"""The coordinator's trace index: listings by role and rank stay exact when traces arrive
in bursts between reads (they are listed when first read), restored ones among them."""

from __future__ import annotations

import random

from profd.actors.store import MemoryStore
from profd.actors.trace_index import TraceIndex
from profd.core.paging import Page
from profd.core.protocol import AgentEvent, AgentInfo, EventKind, TraceWritten


def info(rank: int, role: str) -> AgentInfo:
    return AgentInfo(f"a-{role}-{rank}", role, rank, 4, {}, "host", 1, node_id="n1")


def event(n: int, rank: int, at: float) -> AgentEvent:
    path = f"/s/sess-1/actor_step{n}_rank{rank}.json.gz"
    written = TraceWritten(f"t{n:04d}-{rank}", path, 100 + n, (n,), "train", "torch")
    return AgentEvent(EventKind.TRACE, "sess-1", n, payload=written, time=at)


def every_page(index: TraceIndex, role: str | None, rank: int | None) -> tuple[list[str], int]:
    out, cursor, total = [], None, -1
    while True:
        page = index.find(None, role, rank, 7, cursor)
        assert isinstance(page, Page)
        out += [t.trace_id for t in page.items]
        total = page.total
        if page.next_cursor is None:
            return out, total
        cursor = page.next_cursor


def test_listings_follow_traces_arriving_between_reads() -> None:
    rng = random.Random(3)
    index = TraceIndex(MemoryStore())
    restored = TraceIndex(MemoryStore())
    kept: list = []
    for n in range(300):
        rank, role = rng.randrange(4), rng.choice(["actor", "critic"])
        # times out of order within a burst, as relays' batches interleave
        view = index.index(info(rank, role), event(n, rank, 1000.0 + rng.random() * 50), None)
        assert view is not None
        kept.append(view)
        if rng.random() < 0.1:  # a read between bursts
            for role_q, rank_q in ((None, None), ("actor", None), (None, 2), ("critic", 1)):
                want = sorted(
                    (v for v in kept if role_q in (None, v.role) and rank_q in (None, v.rank)),
                    key=lambda v: (v.created_at, v.trace_id),
                    reverse=True,
                )
                got, total = every_page(index, role_q, rank_q)
                assert got == [v.trace_id for v in want] and total == len(want)
            assert index.total_bytes == sum(v.bytes for v in kept)
    restored.restore(v.model_dump(mode="json") for v in reversed(kept))
    for query in ((None, None), ("actor", 3)):
        assert every_page(restored, *query) == every_page(index, *query)
    assert restored.total_bytes == index.total_bytes


class Recorder(MemoryStore):
    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def save_traces(self, rows: list[tuple[str, str, bytes]]) -> None:
        self.calls.append([tid for tid, _, _ in rows])


def test_a_batch_hands_its_traces_to_the_store_once_and_they_restore(tmp_path) -> None:
    """A relay's batch of window ends is one hand-over to the store, at the batch's end
    (nested batches: at the outer end); outside a batch each trace is handed at once. What
    was handed is what a restarted coordinator's index restores, views and pages alike."""
    rec = Recorder()
    index = TraceIndex(rec)
    with index.batch():
        for n in range(3):
            index.index(info(n, "actor"), event(n, n, 1000.0 + n), None)
            with index.batch():
                index.index(info(n, "critic"), event(10 + n, n, 1100.0 + n), None)
        assert rec.calls == []
    assert rec.calls == [["t0000-0", "t0010-0", "t0001-1", "t0011-1", "t0002-2", "t0012-2"]]
    index.index(info(0, "actor"), event(20, 0, 1200.0), None)
    assert rec.calls[1:] == [["t0020-0"]]

    from profd.actors.store import SqliteStore

    store = SqliteStore(tmp_path / "state.sqlite3")
    first = TraceIndex(store)
    with first.batch():
        for n in range(5):
            first.index(info(n % 2, "actor"), event(n, n % 2, 1000.0 + n), None)
    store.close()
    store = SqliteStore(tmp_path / "state.sqlite3")
    try:
        again = TraceIndex(store)
        assert again.restore(store.load()["traces"]) == 5
        assert [again.get(t.trace_id) for t in first.all()] == list(first.all())
        assert every_page(again, "actor", 1) == every_page(first, "actor", 1)
    finally:
        store.close()
