"""Fake vLLM and SGLang servers (tests and ``profd demo``): real HTTP on 127.0.0.1, the
engines' real profiling endpoints, trace files named as the engines name them.

What is reproduced (read from the engines' public code):

* **vLLM** (OpenAI-compatible server): ``POST /start_profile`` and ``POST /stop_profile``, no
  body, ``200`` with an empty body; the routes exist only when profiling was configured at
  launch (``--profiler-config`` with ``profiler: torch`` on vLLM >= 0.13, else
  ``VLLM_TORCH_PROFILER_DIR``), otherwise ``404``. A start while active and a stop while
  inactive are ignored (``200``). Each GPU worker writes
  ``<instance id>-rank-<k>.<time ns>.pt.trace.json.gz`` (``k`` = the worker's rank inside one
  data-parallel engine, so dp > 1 repeats ranks); older versions name files
  ``<host>_<pid>.<time ns>.pt.trace.json.gz``; unless ``ignore_frontend`` the API server adds
  ``<host>_<pid>.async_llm.<time ns>.pt.trace.json.gz``. ``delay_iterations`` /
  ``max_iterations`` (launch settings) bound the recorded engine iterations; after
  ``max_iterations`` the workers stop and write on their own.
* **SGLang**: ``GET|POST /start_profile`` with an optional JSON body (output_dir, start_step,
  num_steps, activities, with_stack, record_shapes, ...) answering ``200 "Start
  profiling.\\n"``; ``GET|POST /stop_profile`` answering ``200 "Stop profiling. This will take
  some time.\\n"``. A refusal inside the engine (start while profiling, stop while not) is an
  unhandled ``RuntimeError`` → ``500 Internal Server Error``. ``start_step`` counts forward
  passes since launch; ``num_steps`` stops the profiler by itself. Each scheduler writes
  ``<profile id>-TP-<t>[-DP-<d>][-PP-<p>][-EP-<e>].trace.json.gz`` (the markers only when
  that size is above 1), ``<profile id>`` being ``str(time.time())``.

Failure knobs: ``refuse_start``, ``stop_hangs`` (until released or the server closes),
``flush_s`` / ``stop_blocks=False`` (files appear after stop and grow over time, their gzip
stream unfinished until the end), ``kill()`` (endpoint down), and for vLLM
``no_files_after_first_window`` (a repeated start/stop in one process writes nothing).
Engine iterations advance only when a test calls :meth:`advance`.
"""

from __future__ import annotations

import gzip
import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from profd.testing.server import UvicornThread

__all__ = ["FakeSglangServer", "FakeVllmServer", "chrome_trace_bytes", "read_trace"]

#: Fields of vLLM's ProfilerConfig (vllm/config/profiler.py); anything else fails the launch.
VLLM_PROFILER_CONFIG_FIELDS = {
    "profiler",
    "torch_profiler_dir",
    "torch_profiler_with_stack",
    "torch_profiler_with_flops",
    "torch_profiler_use_gzip",
    "torch_profiler_dump_cuda_time_total",
    "torch_profiler_record_shapes",
    "torch_profiler_with_memory",
    "capture_torch_profiler",
    "detailed_trace_annotation",
    "ignore_frontend",
    "delay_iterations",
    "max_iterations",
    "warmup_iterations",
    "active_iterations",
    "wait_iterations",
}


def chrome_trace_bytes(
    engine: str,
    rank: int,
    world: int,
    iterations: list[int],
    meta: dict[str, Any],
    times_ns: list[int] | None = None,
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
                "name": f"execute_model_{it}",
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
    }
    return gzip.compress(json.dumps(doc).encode(), 6)


def read_trace(path: str | Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        return json.load(f)


class _FakeEngine:
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

    def __enter__(self) -> _FakeEngine:
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
            files = [(path, _without_wall_clock(data)) for path, data in files]
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


class FakeVllmServer(_FakeEngine):
    """vLLM's OpenAI-compatible server with torch profiling configured at launch."""

    engine = "vllm"

    def __init__(
        self,
        tp: int = 1,
        dp: int = 1,
        pp: int = 1,
        *,
        profiler_config: dict[str, Any] | str | None = None,
        env: dict[str, str] | None = None,
        legacy_names: bool = False,
        no_files_after_first_window: bool = False,
        **kw: Any,
    ) -> None:
        self.launch = self._read_launch(profiler_config, env)
        self.legacy_names = legacy_names
        self.no_files_after_first_window = no_files_after_first_window
        self.instance_id = secrets.token_hex(3)[:5]
        self.host = socket.gethostname()
        self.active = False
        self.running = False
        self.iter_in_window = 0
        self.recorded: list[int] = []
        self.recorded_ns: list[int] = []  # when each recorded iteration ran
        self.starts = 0
        super().__init__(tp, dp, pp, **kw)

    @classmethod
    def from_launch(
        cls, settings: Any, tp: int = 1, dp: int = 1, pp: int = 1, **kw: Any
    ) -> FakeVllmServer:
        """Launch with profd's :class:`VllmLaunchSettings`, as a real server would read them."""
        kwargs = settings.engine_kwargs()
        return cls(
            tp,
            dp,
            pp,
            profiler_config=kwargs.get("profiler_config"),
            env=settings.env or None,
            **kw,
        )

    @staticmethod
    def _read_launch(config: dict[str, Any] | str | None, env: dict[str, str] | None) -> dict:
        if isinstance(config, str):
            config = json.loads(config)
        if config:
            unknown = set(config) - VLLM_PROFILER_CONFIG_FIELDS
            if unknown:
                raise ValueError(
                    f"vLLM would refuse to launch: unknown profiler config keys {unknown}"
                )
            enabled = config.get("profiler") == "torch"
            return {
                "enabled": enabled,
                "dir": config.get("torch_profiler_dir", ""),
                "delay": int(config.get("delay_iterations", 0)),
                "max": int(config.get("max_iterations", 0)),
                "frontend": not _truthy(config.get("ignore_frontend", False)),
                "with_stack": _truthy(config.get("torch_profiler_with_stack", True)),
                "record_shapes": _truthy(config.get("torch_profiler_record_shapes", False)),
                "with_memory": _truthy(config.get("torch_profiler_with_memory", False)),
            }
        env = env or {}
        return {
            "enabled": bool(env.get("VLLM_TORCH_PROFILER_DIR")),
            "dir": env.get("VLLM_TORCH_PROFILER_DIR", ""),
            "delay": int(env.get("VLLM_PROFILER_DELAY_ITERS", "0")),
            "max": int(env.get("VLLM_PROFILER_MAX_ITERS", "0")),
            "frontend": env.get("VLLM_TORCH_PROFILER_DISABLE_ASYNC_LLM", "0") != "1",
            "with_stack": env.get("VLLM_TORCH_PROFILER_WITH_STACK", "1") == "1",
            "record_shapes": env.get("VLLM_TORCH_PROFILER_RECORD_SHAPES", "0") == "1",
            "with_memory": env.get("VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY", "0") == "1",
        }

    def _routes(self, app: FastAPI) -> None:
        if not self.launch["enabled"]:
            return  # vLLM registers the profiling routes only when profiling is configured

        @app.post("/start_profile")
        def start_profile() -> Response:
            self.requests.append(("POST", "/start_profile", None))
            if self.refuse_start:
                return PlainTextResponse("Internal Server Error", status_code=500)
            with self._lock:
                if not self.active:
                    self.active = True
                    self.starts += 1
                    self.iter_in_window = 0
                    self.recorded, self.recorded_ns = [], []
                    self.running = self.launch["delay"] == 0
            return Response(status_code=200)

        @app.post("/stop_profile")
        def stop_profile() -> Response:
            self.requests.append(("POST", "/stop_profile", None))
            self._hang_if_asked()
            with self._lock:
                if self.active:
                    self.active = False
                    if self.running:
                        self.running = False
                        self._write_window(blocking=self.stop_blocks)
            return Response(status_code=200)

    def _on_iteration(self) -> None:
        if not self.active:
            return
        delay, limit = self.launch["delay"], self.launch["max"]
        if not self.running and delay > 0 and self.iter_in_window == delay:
            self.running = True
        if self.running:
            self.recorded.append(self.iter_in_window)
        self.iter_in_window += 1
        if self.running and limit > 0 and len(self.recorded) >= limit:
            self.running = False  # max_iterations reached: the workers stop and write
            self._write_window(blocking=True)

    def _write_window(self, blocking: bool) -> None:
        if self.no_files_after_first_window and self.starts > 1:
            return  # the vLLM issue: a repeated start/stop in one process writes nothing
        out = Path(self.launch["dir"])
        meta = {k: self.launch[k] for k in ("with_stack", "record_shapes", "with_memory")}
        files = []
        per_engine = self.tp * self.pp
        for d in range(self.dp):
            for k in range(per_engine):
                ns = time.time_ns()
                if self.legacy_names:
                    stem = f"{self.host}_{os.getpid() + 1 + d * per_engine + k}"
                else:
                    stem = f"{self.instance_id}-rank-{k}"
                data = chrome_trace_bytes(
                    "vllm",
                    k,
                    per_engine,
                    list(self.recorded),
                    {**meta, "dp": d, "vllm_version": "0.13.0"},
                    list(self.recorded_ns),
                )
                files.append((out / f"{stem}.{ns}.pt.trace.json.gz", data))
        if self.launch["frontend"]:
            ns = time.time_ns()
            data = chrome_trace_bytes("vllm-frontend", 0, 1, [], meta)
            files.append((out / f"{self.host}_{os.getpid()}.async_llm.{ns}.pt.trace.json.gz", data))
        self._emit(files, blocking)


def _truthy(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


class FakeSglangServer(_FakeEngine):
    """SGLang's HTTP server."""

    engine = "sglang"

    def __init__(
        self,
        tp: int = 1,
        dp: int = 1,
        pp: int = 1,
        *,
        ep: int = 1,
        default_output_dir: str | Path | None = None,
        **kw: Any,
    ) -> None:
        self.ep = ep
        self.default_output_dir = str(default_output_dir or "/tmp")
        self.in_progress = False
        self.req: dict[str, Any] = {}
        self.start_at: int | None = None
        self.target: int | None = None
        self.recorded: list[int] = []
        self.recorded_ns: list[int] = []  # when each recorded iteration ran
        super().__init__(tp, dp, pp, **kw)

    def _routes(self, app: FastAPI) -> None:
        @app.api_route("/start_profile", methods=["GET", "POST"])
        async def start_profile(request: Request) -> Response:
            raw = await request.body()
            body = json.loads(raw) if raw else {}
            self.requests.append((request.method, "/start_profile", body))
            with self._lock:
                if self.refuse_start or self.in_progress or self.start_at is not None:
                    # SGLang raises RuntimeError("Profiling is already in progress...") and
                    # lets it escape the handler.
                    return PlainTextResponse("Internal Server Error", status_code=500)
                self._init_profile(body)
            return PlainTextResponse("Start profiling.\n", status_code=200)

        @app.api_route("/stop_profile", methods=["GET", "POST"])
        def stop_profile(request: Request) -> Response:
            self.requests.append((request.method, "/stop_profile", None))
            self._hang_if_asked()
            with self._lock:
                if not self.in_progress:
                    self.start_at = self.target = None
                    return PlainTextResponse("Internal Server Error", status_code=500)
                self._stop(blocking=self.stop_blocks)
            return PlainTextResponse("Stop profiling. This will take some time.\n", status_code=200)

    def _init_profile(self, body: dict[str, Any]) -> None:
        self.req = {
            "output_dir": body.get("output_dir") or self.default_output_dir,
            "activities": body.get("activities") or ["CPU", "GPU"],
            "with_stack": body.get("with_stack"),
            "record_shapes": body.get("record_shapes"),
            "profile_id": str(time.time()),
        }
        start_step, num_steps = body.get("start_step"), body.get("num_steps")
        self.recorded, self.recorded_ns = [], []
        self.start_at = self.target = None
        if start_step:
            self.start_at = max(int(start_step), self.forward_ct + 1)
            if num_steps:
                self.target = self.start_at + int(num_steps)
        else:
            self.in_progress = True
            if num_steps:
                self.target = self.forward_ct + int(num_steps)

    def _on_iteration(self) -> None:
        if self.target is not None and self.target <= self.forward_ct and self.in_progress:
            self._stop(blocking=True)  # num_steps reached: the scheduler stops and writes
        if self.start_at is not None and self.start_at == self.forward_ct:
            self.in_progress = True
            self.start_at = None
        if self.in_progress:
            self.recorded.append(self.forward_ct)

    def _stop(self, blocking: bool) -> None:
        self.in_progress = False
        self.start_at = self.target = None
        out = Path(self.req["output_dir"])
        meta = {k: self.req[k] for k in ("activities", "with_stack", "record_shapes")}
        files = []
        for d in range(self.dp):
            for p in range(self.pp):
                for t in range(self.tp):
                    parts = [self.req["profile_id"], f"TP-{t}"]
                    if self.dp > 1:
                        parts.append(f"DP-{d}")
                    if self.pp > 1:
                        parts.append(f"PP-{p}")
                    if self.ep > 1:
                        parts.append(f"EP-{t % self.ep}")
                    data = chrome_trace_bytes(
                        "sglang", t, self.tp, list(self.recorded), meta, list(self.recorded_ns)
                    )
                    files.append((out / ("-".join(parts) + ".trace.json.gz"), data))
        self._emit(files, blocking)
