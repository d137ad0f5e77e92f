"""A small HTTP client for the sidecar, with errors a person can act on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from profd.cli.ray_cluster import load_state, read_token
from profd.core.constants import DEFAULT_PORT, TOKEN_FILE
from profd.core.paging import MAX_LIMIT

__all__ = ["ApiClient", "CliError", "resolve_url"]

EXIT_FAILED = 1
EXIT_UNREACHABLE = 3


class CliError(Exception):
    def __init__(self, message: str, exit_code: int = EXIT_FAILED, status: int | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.status = status


def resolve_url(url: str | None, state_dir: Path) -> str:
    if url:
        return url.rstrip("/")
    state = load_state(state_dir)
    if state is not None:
        return state.url
    return f"http://127.0.0.1:{DEFAULT_PORT}"


class ApiClient:
    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float = 30.0,
        token_file: Path | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.has_token = bool(token)
        self.token_file = token_file
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    @classmethod
    def from_state(cls, url: str | None, state_dir: Path, token: str | None = None) -> ApiClient:
        return cls(
            resolve_url(url, state_dir),
            token or read_token(state_dir),
            token_file=state_dir / TOKEN_FILE,
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
        hint = self._auth_hint(resp.status_code) if resp.status_code in (401, 403) else ""
        return CliError(f"HTTP {resp.status_code}: {msg}{hint}", EXIT_FAILED, resp.status_code)

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
