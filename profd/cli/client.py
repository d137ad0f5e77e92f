"""A small HTTP client for the sidecar, with errors a person can act on."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from profd.cli.ray_cluster import load_state, read_token
from profd.core.constants import DEFAULT_PORT, TOKEN_FILE
from profd.core.paging import MAX_LIMIT

__all__ = [
    "LAST_FILE",
    "ApiClient",
    "CliError",
    "LastAddress",
    "default_url",
    "format_bytes",
    "load_last",
    "record_last",
    "resolve_url",
]

EXIT_FAILED = 1
#: Bad usage: a bad option, or input the sidecar refused as invalid (HTTP 422).
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

#: In the state directory: where the sidecar was when `profd down` removed its record, so
#: that `profd status` can say where profd last ran instead of naming the default port.
LAST_FILE = "last-sidecar.json"

_UNITS = ("kB", "MB", "GB", "TB", "PB")


def format_bytes(n: float) -> str:
    """A size as the CLI prints every size: decimal units (1 kB = 1000 bytes), one decimal
    from kB up: ``999 B``, ``1.5 kB``, ``12.3 MB``, ``1.0 GB``."""
    n = float(n)
    if abs(n) < 1000:
        return f"{n:.0f} B"
    for unit in _UNITS:
        n /= 1000
        if abs(n) < 999.95 or unit == _UNITS[-1]:
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class LastAddress:
    """Where the sidecar answered before `profd down` stopped it (and removed its record)."""

    url: str
    stopped_at: float
    ray_address: str | None = None


def record_last(state_dir: Path, url: str, ray_address: str | None = None) -> Path:
    """Remember ``url`` as where profd last ran (owner-only file; no token in it)."""
    path = state_dir / LAST_FILE
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(LastAddress(url, time.time(), ray_address)), f)
    os.replace(tmp, path)
    return path


def load_last(state_dir: Path) -> LastAddress | None:
    """Where profd last ran, as `profd down` recorded it; None when unknown or unreadable."""
    try:
        return LastAddress(**json.loads((state_dir / LAST_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def default_url(host: str | None = None, port: int | None = None) -> str:
    """The sidecar URL when neither --url nor a `profd up` record gives one: the host and
    port `profd up` would bind (PROFD_HOST / PROFD_PORT), a wildcard host as loopback."""
    host = host or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{port or DEFAULT_PORT}"  # 0 (any free port) cannot be guessed


class CliError(Exception):
    def __init__(self, message: str, exit_code: int = EXIT_FAILED, status: int | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.status = status


def resolve_url(url: str | None, state_dir: Path, default: str | None = None) -> str:
    """--url, else the URL `profd up` recorded, else ``default`` (the default port)."""
    if url:
        return url.rstrip("/")
    state = load_state(state_dir)
    if state is not None:
        return state.url
    return default or default_url()


def _ago(seconds: float) -> str:
    if seconds < 90:
        return f"{max(0, seconds):.0f} s ago"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / 86400:.0f} days ago"


class ApiClient:
    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float = 30.0,
        token_file: Path | None = None,
        last: LastAddress | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        #: where profd last ran, when this URL is only the default (no record, no --url)
        self.last = last
        self.has_token = bool(token)
        self.token_file = token_file
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    @classmethod
    def from_state(
        cls,
        url: str | None,
        state_dir: Path,
        token: str | None = None,
        default: str | None = None,
        timeout: float = 30.0,
    ) -> ApiClient:
        """A client of --url, else of the sidecar `profd up` recorded, else of ``default``
        (then an unreachable sidecar is reported with where profd last ran, if known: also
        the recorded one after `profd down --keep-ray`, which keeps the record)."""
        last = load_last(state_dir) if not url else None
        state = load_state(state_dir) if last is not None else None
        if state is not None and last is not None and last.url != state.url:
            last = None  # an older profd's: the recorded one came after it
        return cls(
            resolve_url(url, state_dir, default),
            token or read_token(state_dir),
            token_file=state_dir / TOKEN_FILE,
            last=last,
            timeout=timeout,
        )

    def _auth_hint(self, status: int) -> str:
        where = str(self.token_file) if self.token_file else "the profd state directory"
        if not self.has_token:
            return (
                f" (no token: {where} does not exist; run `profd up` on this machine, or copy "
                "the token file of the `profd up` that started this sidecar there; "
                "PROFD_STATE_DIR picks another state directory)"
            )
        return (
            f" (the token in {where} was refused: it belongs to another `profd up`; copy the "
            "token file of the `profd up` that started this sidecar)"
        )

    def _unreachable(self, exc: Exception) -> CliError:
        if self.last is not None and self.last.url != self.url:
            ago = _ago(time.time() - self.last.stopped_at)
            return CliError(
                f"profd is not running (last at {self.last.url}, stopped by `profd down` "
                f"{ago}; nothing answers at {self.url} either): `profd up` starts it "
                "(or pass --url)",
                EXIT_UNREACHABLE,
            )
        if self.last is not None:
            ago = _ago(time.time() - self.last.stopped_at)
            return CliError(
                f"profd is not running (last at {self.url}, stopped by `profd down` {ago}): "
                "`profd up` starts it (or pass --url)",
                EXIT_UNREACHABLE,
            )
        return CliError(
            f"cannot reach the profd sidecar at {self.url} ({type(exc).__name__}); "
            "is `profd up` running? (or pass --url)",
            EXIT_UNREACHABLE,
        )

    def _error(self, resp: httpx.Response) -> CliError:
        try:
            body = resp.json()
            msg = body.get("message") or str(body)
        except (ValueError, AttributeError):
            msg = resp.text[:500]
        status = resp.status_code
        hint = self._auth_hint(status) if status in (401, 403) else ""
        code = EXIT_USAGE if status == 422 else EXIT_FAILED  # refused input is bad usage
        return CliError(f"HTTP {status}: {msg}{hint}", code, status)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None
        if resp.status_code >= 400:
            raise self._error(resp)
        if resp.headers.get("content-type", "").startswith("application/json"):
            return resp.json()
        return resp.content

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, json=body)

    def get_all(self, path: str, page_size: int = MAX_LIMIT, **params: Any) -> list[Any]:
        """Every item of a paged listing (``data`` of each page, following ``next_cursor``)."""
        items: list[Any] = []
        cursor = None
        while True:
            body = self.get(path, **params, limit=page_size, cursor=cursor)
            items.extend(body["data"])
            cursor = body.get("next_cursor")
            if not cursor:
                return items

    def download(self, path: str, dest: Path) -> int:
        """Stream ``path`` into ``dest``; its size. A transfer that breaks off after it began
        is a failure of this download (exit 1), not an unreachable sidecar."""
        size = 0
        try:
            with self._http.stream("GET", path) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise self._error(resp)
                with open(dest, "wb") as f:
                    try:
                        for chunk in resp.iter_bytes():
                            f.write(chunk)
                            size += len(chunk)
                    except httpx.TransportError as exc:
                        raise CliError(
                            f"the transfer broke off after {size} bytes ({type(exc).__name__})"
                        ) from None
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None
        return size
