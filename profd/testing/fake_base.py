"""Plumbing the fake engines share: a real uvicorn server on 127.0.0.1, an iteration counter,
trace files written at once or flushed slowly, and wall-clock Chrome traces shaped like the
engines' own torch traces. See :mod:`profd.testing.fake_engines`."""

from __future__ import annotations

import gzip
import json
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from profd.testing.server import UvicornThread

__all__ = ["FakeEngine", "chrome_trace_bytes", "read_trace", "truthy"]


def chrome_trace_bytes(
    engine: str,
    rank: int,
    world: int,
    iterations: list[int],
    meta: dict[str, Any],
    times_ns: list[int] | None = None,
    *,
    header: dict[str, Any] | None = None,
    annotation: str = "execute_model_{it}",
) -> bytes:
    """A small, valid, gzipped Chrome trace with one step range per recorded iteration, on the
    wall clock as the engines' own torch traces are: ``ts`` in µs after the header's
    ``baseTimeNanoseconds`` (the first iteration's time; ``times_ns`` gives each one's)."""
    pid = 1000 + rank
    now = time.time_ns()
    times = list(times_ns or ()) or [now + i * 1_000_000 for i in range(len(iterations))]
    base_ns = times[0] if times else now
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{engine} rank {rank}"}}
    ]
    for it, t_ns in zip(iterations, times, strict=False):
        at_us = (t_ns - base_ns) // 1000
        events.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": annotation.format(it=it),
                "pid": pid,
                "tid": 1,
                "ts": at_us,
                "dur": 800,
                "args": {"iteration": it},
            }
        )
        events.append(
            {
                "ph": "X",
                "cat": "kernel",
                "name": "fake_gemm",
                "pid": pid,
                "tid": 7,
                "ts": at_us + 100,
                "dur": 500,
            }
        )
    doc = {
        "schemaVersion": 1,
        "baseTimeNanoseconds": base_ns,
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world},
        "traceEvents": events,
        "fake_engine": {"engine": engine, "rank": rank, "iterations": iterations, **meta},
        **(header or {}),
    }
    return gzip.compress(json.dumps(doc).encode(), 6)


def read_trace(path: str | Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        return json.load(f)


class FakeEngine:
    """Shared server plumbing, iteration counter, file writing and failure knobs."""

    engine = "fake"

    def __init__(
        self,
        tp: int = 1,
        dp: int = 1,
        pp: int = 1,
        *,
        refuse_start: bool = False,
        stop_hangs: bool = False,
        stop_blocks: bool = True,
        flush_s: float = 0.0,
        appear_delay_s: float = 0.0,
        relative_clock: bool = False,
    ) -> None:
        self.tp, self.dp, self.pp = tp, dp, pp
        #: Write traces as a tool without a wall clock does (no baseTimeNanoseconds).
        self.relative_clock = relative_clock
        self.refuse_start = refuse_start
        self.stop_hangs = stop_hangs
        self.stop_blocks = stop_blocks
        self.flush_s = flush_s
        self.appear_delay_s = appear_delay_s
        self.forward_ct = 0
        self.requests: list[tuple[str, str, Any]] = []
        self.written: list[Path] = []
        self.windows_written = 0
        self._lock = threading.RLock()
        self._release = threading.Event()
        self._writers: list[threading.Thread] = []
        self.app = FastAPI()
        self.app.get("/health")(lambda: Response(status_code=200))
        self._routes(self.app)
        # The port is picked now, so adapters can be built before the server starts.
        self._server: UvicornThread | None = UvicornThread(self.app)
        self._url = self._server.url
        self._started = False

    # -- server ---------------------------------------------------------------------------
    def _routes(self, app: FastAPI) -> None:
        raise NotImplementedError

    def __enter__(self) -> FakeEngine:
        assert self._server is not None and not self._started, "a fake server starts once"
        self._server.__enter__()
        self._started = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._release.set()
        if self._server is not None and self._started:
            self._server.__exit__(*exc)
        self._server = None
        self.join_writers()

    @property
    def url(self) -> str:
        return self._url

    def kill(self) -> None:
        """Take the endpoint down (nothing listens on its port afterwards)."""
        self.__exit__(None, None, None)

    def release(self) -> None:
        """Let a hanging stop return."""
        self._release.set()

    def join_writers(self, timeout: float = 30.0) -> None:
        for t in list(self._writers):
            t.join(timeout)

    # -- iterations -------------------------------------------------------------------------
    def advance(self, n: int = 1) -> None:
        """Run ``n`` engine iterations (forward passes)."""
        for _ in range(n):
            with self._lock:
                self.forward_ct += 1
                recorded = len(self.recorded)
                self._on_iteration()
                if len(self.recorded) > recorded:  # this iteration is in the window
                    self.recorded_ns.append(time.time_ns())

    def _on_iteration(self) -> None:
        raise NotImplementedError

    # -- files ----------------------------------------------------------------------------
    def _emit(self, files: list[tuple[Path, bytes]], blocking: bool) -> None:
        """Write files now, or in the background over ``flush_s`` (slow flush)."""
        self.windows_written += 1
        if self.relative_clock:
            files = [
                (path, _without_wall_clock(data) if path.name.endswith(".gz") else data)
                for path, data in files
            ]
        if blocking and self.flush_s <= 0:
            for path, data in files:
                _write_now(path, data)
                self.written.append(path)
            return
        t = threading.Thread(target=self._flush_slowly, args=(files,), daemon=True)
        self._writers.append(t)
        t.start()
        if blocking:
            t.join()

    def _flush_slowly(self, files: list[tuple[Path, bytes]]) -> None:
        time.sleep(self.appear_delay_s)
        pieces = 4
        handles = []
        for path, data in files:
            path.parent.mkdir(parents=True, exist_ok=True)
            handles.append((path, data, open(path, "wb")))  # noqa: SIM115 - closed below
        try:
            for i in range(pieces):
                for _path, data, fh in handles:
                    step = -(-len(data) // pieces)
                    fh.write(data[i * step : (i + 1) * step])
                    fh.flush()
                time.sleep(self.flush_s / pieces)
        finally:
            for path, _data, fh in handles:
                fh.close()
                self.written.append(path)

    def _hang_if_asked(self) -> None:
        if self.stop_hangs:
            self._release.wait(120)


def _without_wall_clock(data: bytes) -> bytes:
    doc = json.loads(gzip.decompress(data))
    doc.pop("baseTimeNanoseconds", None)
    return gzip.compress(json.dumps(doc).encode(), 6)


def _write_now(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def truthy(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
