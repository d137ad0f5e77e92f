"""The SQLite store writes behind the coordinator: a slow disk never delays an RPC, queued
rows coalesce to the latest state, and closing writes what is still queued."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from profd.actors import store as store_module
from profd.actors.coordinator import ProfileCoordinator
from profd.actors.store import SqliteStore, StateLock
from profd.core.views import TraceView
from profd.testing.coordinator import InProcessCoordinator

from helpers import coordinator_settings, start_agents

#: What a commit takes on the tests' slow disk.
SLOW_S = 0.2


class GatedStore(SqliteStore):
    """A slow disk whose first commit waits for :attr:`gate` (after :attr:`entered` is set),
    so a test knows rows are pending for as long as it likes."""

    def __init__(self, path: Path, lock: StateLock | None = None, **kw: Any) -> None:
        super().__init__(path, lock, **kw)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def _before_commit(self) -> None:
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        super()._before_commit()


def state_store(tmp_path: Path, cls: type[SqliteStore] = GatedStore, **kw: Any) -> Any:
    """The store a coordinator of ``tmp_path`` would open, as ``cls``."""
    state = Path(coordinator_settings(tmp_path).state_dir)
    return cls(state / "coordinator.sqlite3", StateLock(state), **kw)


def timed(fn: Any, *args: Any) -> tuple[float, Any]:
    t0 = time.monotonic()
    out = fn(*args)
    return time.monotonic() - t0, out


def trace_row(session_id: str, n: int) -> dict[str, Any]:
    return TraceView(
        trace_id=f"{session_id}-t{n}",
        session_id=session_id,
        agent_id="a",
        role="actor",
        rank=0,
        tool="torch",
        scope="step",
        steps=[n],
        path=f"/tmp/{session_id}/t{n}.json",
        file_name=f"t{n}.json",
        bytes=1,
        node_id=None,
        node_ip=None,
        hostname="host",
        created_at=float(n),
    ).model_dump(mode="json")


def test_rpcs_answer_while_a_slow_commit_is_pending_and_a_restart_sees_every_write(
    tmp_path: Path,
) -> None:
    settings = coordinator_settings(tmp_path)
    store = state_store(tmp_path, commit_delay_s=SLOW_S)
    owner = InProcessCoordinator(ProfileCoordinator(settings, store=store))
    (agent,) = start_agents(owner)
    try:
        first = owner.call("create_session", {"steps": [10**6]}).session_id
        assert store.entered.wait(5), "the first commit never started"
        # the disk holds the first commit: every RPC, writes included, answers meanwhile
        took = [timed(owner.call, "status")[0], timed(owner.call, "get_session", first)[0]]
        took.append(timed(owner.call, "cancel_session", first)[0])
        t, second = timed(owner.call, "create_session", {"steps": [10**6]})
        took.append(t)
        assert store.pending > 0 and not store.gate.is_set()
        assert max(took) < SLOW_S / 2, took
        store.save_trace(f"{first}-t1", first, trace_row(first, 1))
    finally:
        store.gate.set()
        owner.down = True  # the coordinator stops with the second session live
        owner.close()  # writes what is still queued
        agent.close(timeout=1)
    assert store.pending == 0 and store.failed_writes == 0

    again = InProcessCoordinator(ProfileCoordinator(settings))
    try:
        assert again.call("get_session", first).state.value == "cancelled"
        assert again.call("get_session", second.session_id).state.value == second.state.value
        assert [t.trace_id for t in again.call("list_traces", first)] == [f"{first}-t1"]
    finally:
        again.close()


def test_rows_queued_at_close_are_written(tmp_path: Path) -> None:
    store = state_store(tmp_path, commit_delay_s=SLOW_S)
    store.save_session("s0", {"session_id": "s0"}, {"a": {"n": 0}})
    assert store.entered.wait(5)
    for n in range(1, 4):
        store.save_session(f"s{n}", {"session_id": f"s{n}"}, {"a": {"n": n}})
        store.save_trace(f"t{n}", f"s{n}", {"trace_id": f"t{n}"})
    assert store.pending == 2 + 3 * 3  # the commit under way, and what waits behind it
    store.gate.set()
    store.close()
    again = SqliteStore(store.path)
    saved = again.load()
    again.close()
    assert sorted(s["session_id"] for s in saved["sessions"]) == ["s0", "s1", "s2", "s3"]
    assert sorted(t["trace_id"] for t in saved["traces"]) == ["t1", "t2", "t3"]


def test_repeated_writes_coalesce_to_the_latest_state(tmp_path: Path) -> None:
    store = state_store(tmp_path)
    store.save_session("s", {"session_id": "s", "v": 0}, {"a": {"v": 0}})
    assert store.entered.wait(5)
    for v in range(1, 100):  # the disk is stuck: a hundred saves of one session's rows
        store.save_session("s", {"session_id": "s", "v": v}, {"a": {"v": v}, f"p{v % 3}": {"v": v}})
        store.save_trace("t", "s", {"trace_id": "t", "v": v})
    assert store.pending == 2 + 1 + 4 + 1  # in flight; then header, a, p0..p2, the trace
    store.gate.set()
    assert store.flush(5)
    saved = store.load()
    store.close()
    assert store.commits == 2
    (session,) = saved["sessions"]
    assert session["v"] == 99
    assert session["targets"] == {"a": {"v": 99}, "p0": {"v": 99}, "p1": {"v": 97}, "p2": {"v": 98}}
    assert saved["traces"] == [{"trace_id": "t", "v": 99}]


class FailingOnceStore(SqliteStore):
    """A disk whose first commit fails (disk I/O error) after the test queued a newer row."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def _before_commit(self) -> None:
        if not self.entered.is_set():
            self.entered.set()
            assert self.gate.wait(10)
            raise sqlite3.OperationalError("disk I/O error")


def test_a_failed_commit_is_counted_and_written_again_under_newer_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "RETRY_S", 0.05)
    store = state_store(tmp_path, FailingOnceStore)
    store.save_session("s", {"session_id": "s", "v": 0}, {"a": {"v": 0}, "b": {"v": 0}})
    assert store.entered.wait(5)
    store.save_session("s", {"session_id": "s", "v": 1}, {"a": {"v": 1}})
    store.gate.set()
    assert store.flush(5)
    assert store.failed_writes == 1 and "disk I/O error" in (store.last_error or "")
    saved = store.load()
    store.close()
    (session,) = saved["sessions"]  # the newer header and part; b from the failed commit
    assert session == {"session_id": "s", "v": 1, "targets": {"a": {"v": 1}, "b": {"v": 0}}}


def test_close_gives_up_on_a_stuck_disk_and_says_what_it_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = state_store(tmp_path)
    store.save_session("s0", {"session_id": "s0"}, {})
    assert store.entered.wait(5)
    store.save_session("s1", {"session_id": "s1"}, {})
    with caplog.at_level(logging.WARNING, logger="profd.actors.store"):
        took, _ = timed(store.close, 0.2)
    assert took < 2
    assert "1 queued row(s) not written within 0.2 s" in caplog.text
    assert not store.save_session("s2", {"session_id": "s2"}, {})  # closed: refused, counted
    assert store.failed_writes == 1 and "closed" in (store.last_error or "")
    store.gate.set()  # the stuck commit ends; the writer then lets go of the state directory
    StateLock(store.path.parent, wait_s=5).release()


def test_flush_state_writes_what_is_queued_before_profd_down_kills_the_coordinator(
    tmp_path: Path,
) -> None:
    """`profd down` kills the coordinator actor (no ``close()``): it asks ``flush_state``
    first, which returns once the queued rows are on disk (False while the disk is stuck)."""
    store = state_store(tmp_path)
    owner = InProcessCoordinator(ProfileCoordinator(coordinator_settings(tmp_path), store=store))
    try:
        start_agents(owner, 1, "actor")
        sid = owner.call("create_session", {"next_steps": 1, "roles": {"actor": {}}}).session_id
        assert store.entered.wait(5)  # its rows wait behind a stuck commit
        assert owner.call("flush_state", 0.2) is False
        store.gate.set()
        assert owner.call("flush_state", 5.0) is True
        saved = SqliteStore(store.path).load()  # what a restarted coordinator would read
        assert sid in [s["session_id"] for s in saved["sessions"]]
    finally:
        store.gate.set()
        owner.close()
