"""Adapters that drive an inference engine's own profiler, behind one small interface.

* :class:`VllmHttpEngine` — vLLM's OpenAI-compatible server: ``POST /start_profile`` and
  ``POST /stop_profile``, ``200`` with an empty body. The routes exist only when the server
  was launched with profiling on (else ``404``); where traces go and what they hold was fixed
  at launch (:func:`profd.rollout.engine_args.vllm_launch_settings`). From vLLM 0.32 (read
  from ``GET /version``) the start carries the session's iteration window as a JSON body; a
  second start while a window is open is refused with ``409``. ``/stop_profile`` returns only
  after the workers have written their traces, which takes minutes on large runs, hence the
  long default stop timeout.
* :class:`SglangHttpEngine` — SGLang's server: ``POST /start_profile`` with a JSON body
  (output_dir, start_step, num_steps, activities, with_stack, record_shapes) and
  ``POST /stop_profile``. Both answer ``200`` with a short text; a refusal inside the engine
  surfaces as an error status (HTTP 500 for "not in progress"). A server launched with
  ``--api-key`` / ``--admin-api-key`` wants ``Authorization: Bearer <key>`` (the admin key
  when both are set); one launched with ``SGLANG_PROFILE_V2`` is refused before any request,
  since its manual start/stop stop the server.
* :class:`InProcessEngine` — an engine object in this process with ``start_profile(**kw)`` /
  ``stop_profile()`` methods (sync or async).

Every failure is an :class:`EngineError` with a kind and a readable reason, so the rollout
agent can turn it into the session's reason; nothing else escapes an adapter.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field

from profd.rollout.engine_args import (
    EngineProfileOptions,
    parse_vllm_version,
    sglang_env_refusal,
    sglang_start_request,
    vllm_start_body,
)

__all__ = [
    "EngineError",
    "EngineErrorKind",
    "EngineKind",
    "EngineTimeouts",
    "EngineWindow",
    "InProcessEngine",
    "ProfilingEngine",
    "SglangHttpEngine",
    "VllmHttpEngine",
]

log = logging.getLogger(__name__)

Flavor = Literal["vllm", "sglang"]


class EngineKind(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    IN_PROCESS = "in_process"


class EngineErrorKind(StrEnum):
    UNREACHABLE = "unreachable"  # nothing listens, or the connection broke
    REFUSED = "refused"  # the engine answered with an error
    TIMEOUT = "timeout"  # the engine did not answer in time (a hanging stop)
    FAILED = "failed"  # anything else (protocol error, unexpected answer)


class EngineError(Exception):
    """An engine operation failed; ``reason`` is meant for the session's reason field."""

    def __init__(self, kind: EngineErrorKind, reason: str) -> None:
        super().__init__(reason)
        self.kind = EngineErrorKind(kind)
        self.reason = reason

    def __reduce__(self):
        return (EngineError, (self.kind, self.reason))


class EngineTimeouts(BaseModel):
    """Client-side limits for engine calls, in seconds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    connect_s: float = Field(3.0, gt=0, description="Connecting to the engine's server.")
    start_s: float = Field(60.0, gt=0, description="Answer to a start request.")
    stop_s: float = Field(
        1800.0,
        gt=0,
        description="Answer to a stop request; vLLM answers only after the traces are written "
        "(minutes for large runs, cf. VLLM_RPC_TIMEOUT).",
    )


@dataclass(frozen=True, slots=True)
class EngineWindow:
    """One profiling window as an engine sees it."""

    output_dir: str
    options: EngineProfileOptions


class ProfilingEngine(Protocol):
    """What the rollout agent needs from an engine adapter. Optional: a true
    ``stop_writes_files`` attribute says :meth:`stop` returns only once the engine's files
    are written (the replica's next window then starts while they settle)."""

    kind: EngineKind
    #: Whose semantics apply: vLLM (settings fixed at launch) or SGLang (per request).
    flavor: Flavor
    endpoint: str

    @property
    def output_dir_per_window(self) -> bool:
        """True when the engine takes the output directory with each start request."""
        ...

    def start(self, window: EngineWindow) -> list[str]:
        """Start profiling; return warnings. Raises :class:`EngineError`."""
        ...

    def stop(self) -> list[str]:
        """Stop profiling (the engine writes its files); return warnings. Raises
        :class:`EngineError`."""
        ...

    def close(self) -> None: ...


class _HttpEngine:
    """Shared HTTP plumbing; subclasses say which requests to send."""

    kind: EngineKind
    flavor: Flavor

    def __init__(
        self,
        base_url: str,
        timeouts: EngineTimeouts | None = None,
        transport: httpx.BaseTransport | None = None,
        *,
        api_key: str | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: must start with http:// or https://, got {base_url!r}")
        if api_key is not None and (not api_key or api_key != api_key.strip()):
            raise ValueError("api_key: must be a non-empty key without surrounding spaces")
        self.endpoint = base_url.rstrip("/")
        self.timeouts = timeouts or EngineTimeouts()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # trust_env=False: engine endpoints are cluster-internal; a proxy from the
        # environment would only get in the way.
        self._client = httpx.Client(
            base_url=self.endpoint,
            timeout=httpx.Timeout(self.timeouts.start_s, connect=self.timeouts.connect_s),
            transport=transport,
            trust_env=False,
            headers=headers,
        )

    def close(self) -> None:
        self._client.close()

    def _post(self, path: str, read_timeout: float, body: dict | None = None) -> httpx.Response:
        url = f"{self.endpoint}{path}"
        timeout = httpx.Timeout(read_timeout, connect=self.timeouts.connect_s)
        try:
            return self._client.post(path, json=body, timeout=timeout)
        except httpx.ConnectTimeout as exc:
            raise EngineError(
                EngineErrorKind.UNREACHABLE, f"{self.flavor} endpoint {url} unreachable: {exc!r}"
            ) from None
        except httpx.TimeoutException:
            raise EngineError(
                EngineErrorKind.TIMEOUT,
                f"{self.flavor} {path} did not answer within {read_timeout:g}s",
            ) from None
        except httpx.ConnectError as exc:
            raise EngineError(
                EngineErrorKind.UNREACHABLE, f"{self.flavor} endpoint {url} unreachable: {exc}"
            ) from None
        except httpx.HTTPError as exc:
            raise EngineError(
                EngineErrorKind.FAILED, f"{self.flavor} {path} failed: {type(exc).__name__}: {exc}"
            ) from None

    def _refusal(self, path: str, resp: httpx.Response) -> EngineError:
        text = " ".join(resp.text.split())[:500] or "(empty body)"
        return EngineError(
            EngineErrorKind.REFUSED,
            f"{self.flavor} refused {path}: HTTP {resp.status_code}: {text}",
        )


class VllmHttpEngine(_HttpEngine):
    """vLLM's OpenAI-compatible server at ``base_url``."""

    kind = EngineKind.VLLM
    flavor: Flavor = "vllm"
    #: ``/stop_profile`` answers once every worker wrote its files (vLLM's profiler stops
    #: and exports inside the call): a replica's next window may start while they settle.
    stop_writes_files = True

    def __init__(self, *args: Any, version: str | None = None, **kwargs: Any) -> None:
        """``version``: the server's vLLM version when known (else read from ``/version``
        at the first start; the launch settings' version when that cannot be read)."""
        super().__init__(*args, **kwargs)
        self._version = parse_vllm_version(version) if version else None
        self._version_read = bool(version)
        self.launch_version: tuple[int, int, int] | None = None

    @property
    def output_dir_per_window(self) -> bool:
        return False

    def server_version(self) -> tuple[int, int, int] | None:
        """The server's version (``GET /version``, read once); None when it does not say."""
        if self._version_read:
            return self._version
        timeout = httpx.Timeout(min(self.timeouts.start_s, 5.0), connect=self.timeouts.connect_s)
        try:
            resp = self._client.get("/version", timeout=timeout)
            resp.raise_for_status()
            self._version = parse_vllm_version(str(resp.json().get("version", "")))
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            # not now (down, a proxy, a key): asked again at the next start
            log.info("vllm at %s: /version unreadable (%s)", self.endpoint, exc)
            return self.launch_version
        self._version_read = True
        return self._version

    def start(self, window: EngineWindow) -> list[str]:
        version = self.server_version()
        body = vllm_start_body(version, window.options)
        warnings = []
        if version is None and window.options.window.is_set:
            warnings.append(
                "vllm: the server's version is unknown (GET /version did not answer), so the "
                "session's iteration window was not sent; the replica records its launch window"
            )
        resp = self._post("/start_profile", self.timeouts.start_s, body)
        if resp.status_code == 404:
            raise EngineError(
                EngineErrorKind.REFUSED,
                f"vllm at {self.endpoint} has no /start_profile (HTTP 404): the server was "
                f"launched without profiling; launch it with profd's vLLM launch settings",
            )
        if not resp.is_success:
            raise self._refusal("/start_profile", resp)
        return warnings

    def stop(self) -> list[str]:
        resp = self._post("/stop_profile", self.timeouts.stop_s)
        if not resp.is_success:
            raise self._refusal("/stop_profile", resp)
        return []


class SglangHttpEngine(_HttpEngine):
    """SGLang's server at ``base_url``."""

    kind = EngineKind.SGLANG
    flavor: Flavor = "sglang"

    def __init__(
        self, *args: Any, server_env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> None:
        """``server_env``: the environment the server was launched with (its profiler reads
        ``SGLANG_PROFILE_*`` there); ``api_key``: its ``--admin-api-key`` or ``--api-key``."""
        super().__init__(*args, **kwargs)
        self.server_env = dict(server_env or {})
        self._stops_by_itself = False

    @property
    def output_dir_per_window(self) -> bool:
        return True

    def start(self, window: EngineWindow) -> list[str]:
        refusal = sglang_env_refusal(self.server_env)
        if refusal:
            raise EngineError(EngineErrorKind.REFUSED, refusal)
        req = sglang_start_request(window.options, window.output_dir, self.server_env)
        resp = self._post("/start_profile", self.timeouts.start_s, req.body)
        if not resp.is_success:
            raise self._refusal("/start_profile", resp)
        self._stops_by_itself = req.stops_by_itself
        return list(req.warnings)

    def stop(self) -> list[str]:
        resp = self._post("/stop_profile", self.timeouts.stop_s)
        if resp.is_success:
            return []
        if self._stops_by_itself:
            # With num_steps SGLang stops on its own and then refuses /stop_profile
            # ("Profiling is not in progress"); its files are already written.
            return [
                f"sglang: /stop_profile answered HTTP {resp.status_code}; the engine had "
                f"already stopped after num_steps"
            ]
        raise self._refusal("/stop_profile", resp)


def _run_with_timeout(
    fn: Callable[[], Any], timeout: float, what: str, loop: asyncio.AbstractEventLoop | None
) -> Any:
    """Run ``fn`` (sync, or returning an awaitable) on a daemon thread, bounded by ``timeout``.

    A daemon thread: a hung engine call must neither block the caller nor interpreter exit.
    """
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            value = fn()
            if inspect.isawaitable(value):
                if loop is not None:
                    value = asyncio.run_coroutine_threadsafe(_awaited(value), loop).result()
                else:
                    value = asyncio.run(_awaited(value))
            box["value"] = value
        except BaseException as exc:
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name=f"profd-engine-{what}", daemon=True).start()
    if not done.wait(timeout):
        raise EngineError(
            EngineErrorKind.TIMEOUT, f"in-process {what} did not return within {timeout:g}s"
        )
    if "error" in box:
        exc = box["error"]
        raise EngineError(
            EngineErrorKind.REFUSED, f"in-process {what} failed: {type(exc).__name__}: {exc}"
        )
    return box.get("value")


async def _awaited(value: Any) -> Any:
    return await value


class InProcessEngine:
    """An engine object in this process with ``start_profile(**kw)`` / ``stop_profile()``.

    ``flavor`` says which arguments to pass: ``"sglang"`` passes the SGLang request fields
    (output_dir, start_step, num_steps, activities, with_stack, record_shapes) as keywords;
    ``"vllm"`` passes none (vLLM's settings were fixed when the engine was built). Async
    methods run on ``loop`` when given (an engine bound to its own event loop), else on a
    private loop. ``stop_writes_files``: its ``stop_profile()`` returns once its files are
    written (see :class:`VllmHttpEngine`).
    """

    kind = EngineKind.IN_PROCESS

    def __init__(
        self,
        engine: Any,
        flavor: Flavor = "vllm",
        *,
        timeouts: EngineTimeouts | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        name: str = "in-process",
        stop_writes_files: bool = False,
    ) -> None:
        for method in ("start_profile", "stop_profile"):
            if not callable(getattr(engine, method, None)):
                raise ValueError(f"engine: {type(engine).__name__} has no {method}() method")
        if flavor not in ("vllm", "sglang"):
            raise ValueError(f"flavor: must be 'vllm' or 'sglang', got {flavor!r}")
        self._engine = engine
        self.flavor: Flavor = flavor
        self.endpoint = name
        self.timeouts = timeouts or EngineTimeouts()
        self._loop = loop
        #: Whether ``stop_profile()`` returns only once the engine's files are written
        #: (vLLM's ``LLM.stop_profile`` does; say so to let the replica's next window start
        #: while they settle). Not assumed: a stop that returns earlier would hand the
        #: earlier window's late files to the next window.
        self.stop_writes_files = stop_writes_files

    @property
    def output_dir_per_window(self) -> bool:
        return self.flavor == "sglang"

    def start(self, window: EngineWindow) -> list[str]:
        kwargs: dict[str, Any] = {}
        warnings: list[str] = []
        if self.flavor == "sglang":
            req = sglang_start_request(window.options, window.output_dir)
            kwargs, warnings = dict(req.body), list(req.warnings)
        _run_with_timeout(
            lambda: self._engine.start_profile(**kwargs),
            self.timeouts.start_s,
            "start_profile",
            self._loop,
        )
        return warnings

    def stop(self) -> list[str]:
        _run_with_timeout(
            self._engine.stop_profile, self.timeouts.stop_s, "stop_profile", self._loop
        )
        return []

    def close(self) -> None:
        return None
