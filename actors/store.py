"""Where the coordinator keeps sessions (one row per part) and the trace index.

:class:`SqliteStore` writes them to one SQLite file in the state directory on the head node
(WAL mode, one row per object as JSON), so a restarted coordinator — Ray restarts it after a
crash — picks up where it stopped. :class:`MemoryStore` keeps nothing (the demo and tests
that do not exercise restarts).

The SQLite store writes behind: a save encodes its rows on the caller's thread (the
coordinator's event loop) and queues them; one writer thread commits everything queued in one
transaction, so a slow disk never delays an RPC. The queue holds one row per session, part
and trace — a later save of a row replaces the waiting one — so however slow the disk, it
holds at most one copy of the state (it never grows with the rate of writes), and each commit
leaves the file as the state was at one moment (a session's header and its parts together).
A failed commit is counted (``failed_writes``, ``last_error``: the status view), logged and
tried again under what was queued since. :meth:`SqliteStore.close` writes what is queued
(waiting up to ``CLOSE_TIMEOUT_S``, then logging what it dropped). What a coordinator killed
outright loses is what its writer had not committed yet: normally the last few milliseconds.

A coordinator that persists holds :class:`StateLock` on its state directory for as long as it
lives (an ``flock``, released by the kernel when its process dies, so Ray's restart of a
crashed coordinator takes it over): two coordinators — of two clusters started from one state
directory — can never write one SQLite file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import orjson

__all__ = [
    "CLOSE_TIMEOUT_S",
    "MemoryStore",
    "SqliteStore",
    "StateDirInUse",
    "StateLock",
    "Store",
    "open_store",
]

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (id TEXT PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS traces (
    id TEXT PRIMARY KEY, session_id TEXT NOT NULL, data BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS parts (
    session_id TEXT NOT NULL, agent_id TEXT NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (session_id, agent_id)
);
CREATE TABLE IF NOT EXISTS triggers (id TEXT PRIMARY KEY, data BLOB NOT NULL);
"""
_SESSION_SQL = "INSERT OR REPLACE INTO sessions VALUES (?, ?)"
_PART_SQL = "INSERT OR REPLACE INTO parts VALUES (?, ?, ?)"
_TRACE_SQL = "INSERT OR REPLACE INTO traces VALUES (?, ?, ?)"
_TRIGGER_SQL = "INSERT OR REPLACE INTO triggers VALUES (?, ?)"

#: How long closing a store waits for its queued rows to reach the disk.
CLOSE_TIMEOUT_S = 10.0
#: After a failed commit the writer tries its rows again this much later.
RETRY_S = 1.0
#: A commit slower than this is logged (once a minute at most).
SLOW_COMMIT_S = 1.0

#: A row's identity: ``("sessions", id)``, ``("parts", session id, agent id)``, ``("traces", id)``.
_RowKey = tuple[str, ...]
#: A row ready to write: its statement and values (the data already JSON).
_Row = tuple[str, tuple[Any, ...]]


class Store(Protocol):
    failed_writes: int
    last_error: str | None

    def load(self) -> dict[str, list[dict[str, Any]]]: ...

    def save_session(
        self, session_id: str, data: dict[str, Any], parts: dict[str, dict[str, Any]]
    ) -> bool: ...

    def save_trace(self, trace_id: str, session_id: str, data: dict[str, Any]) -> None: ...

    def save_traces(self, rows: list[tuple[str, str, bytes]]) -> None:
        """Many traces at once: ``(trace id, session id, its JSON)`` each."""
        ...

    def save_trigger(self, trigger_id: str, data: dict[str, Any] | None) -> None: ...

    def flush(self, timeout_s: float) -> bool: ...

    def close(self) -> None: ...


class MemoryStore:
    """Keeps nothing: a coordinator with this store starts empty after a restart."""

    failed_writes = 0
    last_error: str | None = None

    def load(self) -> dict[str, list[dict[str, Any]]]:
        return {"sessions": [], "traces": [], "triggers": []}

    def save_session(
        self, session_id: str, data: dict[str, Any], parts: dict[str, dict[str, Any]]
    ) -> bool:
        return True

    def save_trace(self, trace_id: str, session_id: str, data: dict[str, Any]) -> None:
        pass

    def save_traces(self, rows: list[tuple[str, str, bytes]]) -> None:
        pass

    def save_trigger(self, trigger_id: str, data: dict[str, Any] | None) -> None:
        pass

    def flush(self, timeout_s: float) -> bool:
        return True

    def close(self) -> None:
        pass


class StateDirInUse(RuntimeError):
    """Another live coordinator holds the state directory."""


class StateLock:
    """An exclusive ``flock`` on ``<state dir>/coordinator.lock``, naming its holder inside."""

    FILE = "coordinator.lock"

    def __init__(self, state_dir: Path, wait_s: float = 10.0) -> None:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = state_dir / self.FILE
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        # A coordinator just killed may take a moment to exit (and release the lock).
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = self._holder()
                    os.close(self._fd)
                    self._fd = None
                    raise StateDirInUse(
                        f"state directory {state_dir} is in use by another profd coordinator "
                        f"({holder}); two coordinators must never share one state file: stop "
                        "that one (`profd down` where it was started) or give this one another "
                        "PROFD_STATE_DIR"
                    ) from None
                time.sleep(0.1)
        os.ftruncate(self._fd, 0)
        os.write(self._fd, json.dumps(self._me()).encode())

    @staticmethod
    def _me() -> dict[str, Any]:
        address = None
        with contextlib.suppress(Exception):
            import ray

            if ray.is_initialized():
                address = ray.get_runtime_context().gcs_address
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "ray": address,
            "since": time.time(),
        }

    def _holder(self) -> str:
        try:
            d = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return "holder unknown"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.get("since", 0)))
        return f"pid {d.get('pid')} on {d.get('host')}, Ray at {d.get('ray')}, since {since}"

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class SqliteStore:
    """The SQLite store, written behind the coordinator's back (see the module docstring).

    ``commit_delay_s`` is for measurement only: every commit takes that much longer (an
    injected slow disk; ``bench/trigger.py --slow-commit-ms`` and the store's tests). It may be
    changed while the store runs. Tests that must hold a commit open override
    :meth:`_before_commit`.
    """

    def __init__(
        self, path: Path, lock: StateLock | None = None, *, commit_delay_s: float = 0.0
    ) -> None:
        self.lock = lock
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = path
        self.commit_delay_s = commit_delay_s
        self._lock = threading.Lock()  # the connection: the writer thread, load()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        os.chmod(path, 0o600)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self.failed_writes = 0
        self.last_error: str | None = None
        #: Transactions committed (each carries every row that was waiting when it began).
        self.commits = 0
        self._cond = threading.Condition()  # guards everything below, and the counters above
        self._waiting: dict[_RowKey, _Row] = {}  # one per row: a later write replaces it
        self._in_flight = 0  # rows of the commit under way
        self._retry_at = 0.0  # after a failed commit: not before (monotonic)
        self._slow_logged = -math.inf
        self._writer: threading.Thread | None = None  # started by the first write
        self._closing = False
        self._abandon = False  # close() gave up waiting: the writer stops after its commit

    @property
    def pending(self) -> int:
        """Rows not committed yet (waiting, or in the commit under way)."""
        with self._cond:
            return len(self._waiting) + self._in_flight

    def load(self) -> dict[str, list[dict[str, Any]]]:
        """Sessions (each with its ``targets`` put back together; upload records are part
        of the session) and the trace index: what was committed, after this store's own
        queued writes (waited for up to ``CLOSE_TIMEOUT_S``)."""
        self.flush(CLOSE_TIMEOUT_S)
        with self._lock:
            out = {}
            for table in ("sessions", "traces", "triggers"):
                rows = self._db.execute(f"SELECT data FROM {table}").fetchall()  # fixed table names
                out[table] = [orjson.loads(r[0]) for r in rows]
            parts = self._db.execute("SELECT session_id, agent_id, data FROM parts").fetchall()
        out["triggers"] = [t for t in out["triggers"] if not t.get("deleted")]
        by_session: dict[str, dict[str, Any]] = {}
        for session_id, agent_id, data in parts:
            by_session.setdefault(session_id, {})[agent_id] = orjson.loads(data)
        for d in out["sessions"]:
            d["targets"] = {**d.get("targets", {}), **by_session.get(d["session_id"], {})}
        return out

    def save_session(
        self, session_id: str, data: dict[str, Any], parts: dict[str, dict[str, Any]]
    ) -> bool:
        """Queue the session's header and the parts that changed since its last save (they
        reach the disk together); ``False`` when they cannot be written (a value JSON cannot
        hold, a closed store)."""
        return self._enqueue(
            session_id,
            (("sessions", session_id), _SESSION_SQL, (session_id,), data),
            *(
                (("parts", session_id, aid), _PART_SQL, (session_id, aid), d)
                for aid, d in parts.items()
            ),
        )

    def save_trace(self, trace_id: str, session_id: str, data: dict[str, Any]) -> None:
        self._enqueue(trace_id, (("traces", trace_id), _TRACE_SQL, (trace_id, session_id), data))

    def save_traces(self, rows: list[tuple[str, str, bytes]]) -> None:
        """Queue many traces, their JSON encoded already (one hand-over for a relay's batch)."""
        if rows:
            self._enqueue(
                rows[0][0],
                *((("traces", tid), _TRACE_SQL, (tid, sid), data) for tid, sid, data in rows),
            )

    def save_trigger(self, trigger_id: str, data: dict[str, Any] | None) -> None:
        """Queue a trigger's request (``None``: it was deleted, kept as a tombstone row)."""
        row = data if data is not None else {"trigger_id": trigger_id, "deleted": True}
        self._enqueue(trigger_id, (("triggers", trigger_id), _TRIGGER_SQL, (trigger_id,), row))

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued row is committed; ``False`` if some are not after
        ``timeout_s`` (a slow or failing disk)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._waiting or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0 or self._writer is None or self._abandon:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is still queued (for up to ``timeout_s``; what is left then is logged
        and dropped), close the file and release the state directory. Idempotent."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
            writer = self._writer
        if writer is None:
            self._shut()
            return
        writer.join(timeout_s)
        if not writer.is_alive():
            return
        with self._cond:
            self._abandon = True
            dropped, in_flight = len(self._waiting), self._in_flight
            self._cond.notify_all()
        log.warning(
            "profd state: %d queued row(s) not written within %.1f s of closing %s (dropped; "
            "%d more still committing); last error: %s",
            dropped,
            timeout_s,
            self.path,
            in_flight,
            self.last_error,
        )

    # -- the caller's side -----------------------------------------------------------------
    def _enqueue(
        self, key: str, *rows: tuple[_RowKey, str, tuple[Any, ...], dict[str, Any] | bytes]
    ) -> bool:
        """Encode ``rows`` here (a value JSON cannot hold fails the save now; the caller's
        objects may change once this returns) and queue them for the writer. Data given as
        bytes is JSON already."""
        try:
            encoded = {
                rk: (sql, (*args, data if isinstance(data, bytes) else orjson.dumps(data)))
                for rk, sql, args, data in rows
            }
        except (TypeError, ValueError) as exc:
            with self._cond:
                self._failed(key, exc)
            return False
        with self._cond:
            if self._closing:
                self._failed(key, "the store is closed")
                return False
            self._waiting.update(encoded)
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._run, name="profd-state-writer", daemon=True
                )
                self._writer.start()
            self._cond.notify_all()
        return True

    def _failed(self, what: str, exc: BaseException | str) -> None:
        """Count and log a failed write (the first, then every 1000th); under ``_cond``."""
        self.failed_writes += 1
        self.last_error = f"{what}: {exc}"
        if self.failed_writes == 1 or self.failed_writes % 1000 == 0:
            log.warning("state write failed (%d so far): %s", self.failed_writes, exc)

    # -- the writer thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while (batch := self._take()) is not None:
                ok = self._commit(batch)
                with self._cond:
                    self._in_flight = 0
                    if not ok:  # tried again later, under whatever was queued since
                        self._waiting = {**batch, **self._waiting}
                        self._retry_at = time.monotonic() + RETRY_S
                    self._cond.notify_all()
        finally:
            self._shut()

    def _take(self) -> dict[_RowKey, _Row] | None:
        """Everything waiting (one transaction), or ``None`` when the writer is done."""
        with self._cond:
            while not self._abandon:
                if not self._waiting:
                    if self._closing:
                        return None
                    self._cond.wait()
                    continue
                backoff = self._retry_at - time.monotonic()
                if backoff > 0:
                    self._cond.wait(backoff)
                    continue
                batch, self._waiting = self._waiting, {}
                self._in_flight = len(batch)
                return batch
        return None

    def _commit(self, batch: dict[_RowKey, _Row]) -> bool:
        """Write ``batch`` in one transaction (all or nothing). A failure (disk full, I/O
        error) is logged and counted, never raised: the coordinator's live state stays
        authoritative and serving, and the rows are tried again."""
        started = time.monotonic()
        try:
            with self._lock:
                self._db.execute("BEGIN")
                try:
                    by_sql: dict[str, list[Any]] = {}
                    for sql, values in batch.values():
                        by_sql.setdefault(sql, []).append(values)
                    for sql, rows in by_sql.items():  # one statement per table, not per row
                        self._db.executemany(sql, rows)
                    self._before_commit()
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
        except Exception as exc:  # the writer must outlive any one failure
            with self._cond:
                self._failed(f"{len(batch)} row(s)", exc)
            return False
        with self._cond:
            self.commits += 1
        self._note_slow(time.monotonic() - started, len(batch))
        return True

    def _before_commit(self) -> None:
        """The slow-disk hook (measurement and tests; see the class docstring)."""
        if self.commit_delay_s > 0:
            time.sleep(self.commit_delay_s)

    def _note_slow(self, took_s: float, rows: int) -> None:
        now = time.monotonic()
        if took_s >= SLOW_COMMIT_S and now - self._slow_logged >= 60:
            self._slow_logged = now
            log.warning(
                "profd state: a commit of %d row(s) to %s took %.1f s (slow disk); the "
                "coordinator keeps serving, rows written again meanwhile are merged",
                rows,
                self.path,
                took_s,
            )

    def _shut(self) -> None:
        with self._lock:
            self._db.close()
        if self.lock is not None:
            self.lock.release()


def open_store(state_dir: str | None) -> Store:
    """The coordinator's store: SQLite under ``state_dir``, held with :class:`StateLock`."""
    if not state_dir:
        return MemoryStore()
    lock = StateLock(Path(state_dir))
    try:
        return SqliteStore(Path(state_dir) / "coordinator.sqlite3", lock=lock)
    except BaseException:
        lock.release()
        raise
