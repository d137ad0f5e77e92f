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

import json
import pickle
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from profd.testing.fake_base import FakeEngine, chrome_trace_bytes, read_trace
from profd.testing.fake_vllm import VLLM_PROFILER_CONFIG_FIELDS, FakeVllmServer

__all__ = [
    "VLLM_PROFILER_CONFIG_FIELDS",
    "FakeSglangServer",
    "FakeVllmServer",
    "chrome_trace_bytes",
    "read_trace",
]


class FakeSglangServer(FakeEngine):
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
        api_key: str | None = None,
        **kw: Any,
    ) -> None:
        self.ep = ep
        #: Launched with --api-key / --admin-api-key: the profile routes want the bearer key.
        self.api_key = api_key
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
            if not self._authorized(request):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
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
            if not self._authorized(request):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            self._hang_if_asked()
            with self._lock:
                if not self.in_progress:
                    self.start_at = self.target = None
                    return PlainTextResponse("Internal Server Error", status_code=500)
                self._stop(blocking=self.stop_blocks)
            return PlainTextResponse("Stop profiling. This will take some time.\n", status_code=200)

    def _authorized(self, request: Request) -> bool:
        return self.api_key is None or (
            request.headers.get("authorization") == f"Bearer {self.api_key}"
        )

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
            if num_steps:  # SGLang: checked before each pass, so exactly num_steps run
                self.target = self.forward_ct + int(num_steps) + 1

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
                    if self.ep > 1:  # SGLang's moe_ep_rank: tp ranks in ep blocks
                        parts.append(f"EP-{t // (self.tp // self.ep)}")
                    data = chrome_trace_bytes(
                        "sglang", t, self.tp, list(self.recorded), meta, list(self.recorded_ns)
                    )
                    files.append((out / ("-".join(parts) + ".trace.json.gz"), data))
        if "MEM" in self.req["activities"]:
            # A CUDA memory-history snapshot per tp rank; its name has no DP/PP/EP part.
            files += [
                (out / f"{time.time()}-TP-{t}-memory.pickle", pickle.dumps({"tp_rank": t}))
                for t in range(self.tp)
            ]
        self._emit(files, blocking)
