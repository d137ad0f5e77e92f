"""Where the coordinator keeps sessions (one row per part) and the trace index.

:class:`SqliteStore` writes them to one SQLite file in the state directory on the head node
(WAL mode, one row per object as JSON), so a restarted coordinator — Ray restarts it after a
crash — picks up where it stopped. :class:`MemoryStore` keeps nothing (the demo and tests
that do not exercise restarts).

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
import os
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import orjson

__all__ = ["MemoryStore", "SqliteStore", "StateDirInUse", "StateLock", "Store", "open_store"]

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
"""


class Store(Protocol):
    failed_writes: int
    last_error: str | None

    def load(self) -> dict[str, list[dict[str, Any]]]: ...

    def save_session(
        self, session_id: str, data: dict[str, Any], parts: dict[str, dict[str, Any]]
    ) -> bool: ...

    def save_trace(self, trace_id: str, session_id: str, data: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class MemoryStore:
    """Keeps nothing: a coordinator with this store starts empty after a restart."""

    failed_writes = 0
    last_error: str | None = None

    def load(self) -> dict[str, list[dict[str, Any]]]:
        return {"sessions": [], "traces": []}

    def save_session(
        self, session_id: str, data: dict[str, Any], parts: dict[str, dict[str, Any]]
    ) -> bool:
        return True

    def save_trace(self, trace_id: str, session_id: str, data: dict[str, Any]) -> None:
        pass

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
    def __init__(self, path: Path, lock: StateLock | None = None) -> None:
        self.lock = lock
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        os.chmod(path, 0o600)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self.failed_writes = 0
        self.last_error: str | None = None

    def load(self) -> dict[str, list[dict[str, Any]]]:
        """Sessions (each with its ``targets`` put back together; upload records are part
        of the session) and the trace index."""
        with self._lock:
            out = {}
            for table in ("sessions", "traces"):
                rows = self._db.execute(f"SELECT data FROM {table}").fetchall()  # fixed table names
                out[table] = [orjson.loads(r[0]) for r in rows]
            parts = self._db.execute("SELECT session_id, agent_id, data FROM parts").fetchall()
        by_session: dict[str, dict[str, Any]] = {}
        for session_id, agent_id, data in parts:
            by_session.setdefault(session_id, {})[agent_id] = orjson.loads(data)
        for d in out["sessions"]:
            d["targets"] = {**d.get("targets", {}), **by_session.get(d["session_id"], {})}
        return out

    def _put(self, key: str, *rows: tuple[str, tuple[Any, ...], dict[str, Any]]) -> bool:
        """Write rows ``(sql, leading values, data)`` in one transaction. A failed write (disk
        full, a value JSON cannot hold) is logged and counted, never raised: the coordinator's
        live state stays authoritative and serving."""
        try:
            encoded = [(sql, (*args, orjson.dumps(data))) for sql, args, data in rows]
            with self._lock:
                self._db.execute("BEGIN")
                try:
                    for sql, values in encoded:
                        self._db.execute(sql, values)
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
        except (sqlite3.Error, TypeError, ValueError, OSError) as exc:
            self.failed_writes += 1
            self.last_error = f"{key}: {exc}"
            if self.failed_writes == 1 or self.failed_writes % 1000 == 0:
                log.warning("state write failed (%d so far): %s", self.failed_writes, exc)
            return False
        return True

    def save_session(
        self, session_id: str, data: dict[str, Any], parts: dict[str, dict[str, Any]]
    ) -> bool:
        """The session's header and the parts that changed since its last save (all or
        nothing); ``False`` when the write failed."""
        part_sql = "INSERT OR REPLACE INTO parts VALUES (?, ?, ?)"
        return self._put(
            session_id,
            ("INSERT OR REPLACE INTO sessions VALUES (?, ?)", (session_id,), data),
            *((part_sql, (session_id, aid), d) for aid, d in parts.items()),
        )

    def save_trace(self, trace_id: str, session_id: str, data: dict[str, Any]) -> None:
        sql = "INSERT OR REPLACE INTO traces VALUES (?, ?, ?)"
        self._put(trace_id, (sql, (trace_id, session_id), data))

    def close(self) -> None:
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
