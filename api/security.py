"""What the sidecar accepts from the network: loopback rule, confinement, request size.

* :func:`is_loopback` decides whether reads need the token too (a sidecar bound beyond
  loopback answers nothing without it).
* :func:`confine_save_path` / :func:`confine_upload_uri` keep a session's output inside what
  the operator configured at ``profd up`` (``--allow-save-root`` / ``--allow-upload-prefix``);
  a request that tries to leave it gets a 422 naming the field and the rule.
* :class:`BodyLimit` refuses request bodies over ``SidecarConfig.max_body_bytes`` with 413.

Paths are checked on the sidecar's node with symlinks resolved (``os.path.realpath``); a
path that a symlink created *after* the check leads elsewhere is not caught (the coordinator
and the agents write where the request says).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from profd.errors import RequestInvalid
from profd.settings import SidecarConfig

__all__ = [
    "BodyLimit",
    "BodyTooLarge",
    "confine_save_path",
    "confine_upload_uri",
    "is_loopback",
    "under",
]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address) only accepts connections from this machine."""
    return SidecarConfig.host_is_loopback(host)


def under(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or inside it (both already resolved, absolute)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _resolve(path: str, base: str | None) -> str:
    """Absolute, symlinks and ``..`` resolved (components that do not exist yet kept)."""
    if not os.path.isabs(path):
        if base is None:
            raise ValueError("relative")
        path = os.path.join(base, path)
    return os.path.realpath(path)


def confine_save_path(save_path: str, roots: Iterable[str], base_dir: str | None) -> None:
    """Refuse a ``save_path`` that does not resolve under one of ``roots`` (422)."""
    roots = [os.path.realpath(r) for r in roots]
    if "\x00" in save_path:
        raise RequestInvalid.at("save_path", "must not contain NUL bytes")
    try:
        resolved = _resolve(save_path, base_dir)
    except ValueError:
        raise RequestInvalid.at(
            "save_path",
            "must be an absolute path (the sidecar does not know the coordinator's base "
            f"directory); allowed roots: {', '.join(roots) or 'none'}",
        ) from None
    if not any(under(resolved, r) for r in roots):
        raise RequestInvalid.at(
            "save_path",
            f"must resolve (symlinks and '..' followed) under an allowed save root "
            f"({', '.join(roots) or 'none configured'}); {save_path!r} resolves to {resolved!r}. "
            "The operator allows more with `profd up --allow-save-root DIR`",
            allowed=roots,
        )


def _split(uri: str) -> tuple[str, str]:
    """``(protocol, rest)``; a plain path is the ``file`` protocol."""
    if "://" in uri:
        proto, rest = uri.split("://", 1)
        return proto.lower(), rest
    return "file", uri


def _upload_matches(uri: str, prefix: str) -> bool:
    proto, rest = _split(uri)
    p_proto, p_rest = _split(prefix)
    if proto != p_proto:
        return False
    if proto in ("file", "local"):
        if not os.path.isabs(rest) or not os.path.isabs(p_rest):
            return False
        return under(os.path.realpath(rest), os.path.realpath(p_rest))
    return rest == p_rest or rest.startswith(p_rest.rstrip("/") + "/")


def confine_upload_uri(uri: str, prefixes: Iterable[str]) -> None:
    """Refuse an ``upload_uri`` outside every allowed prefix (422); none allowed by default."""
    prefixes = list(prefixes)
    if not prefixes:
        raise RequestInvalid.at(
            "upload_uri",
            "uploads over HTTP are disabled: no upload prefix is allowed; the operator allows "
            "one with `profd up --allow-upload-prefix URI`",
        )
    segments = _split(uri)[1].replace("\\", "/").split("/")
    problem = None
    if "::" in uri:
        problem = "must not chain filesystems ('::')"
    elif any(s in ("..", ".") for s in segments) or "\x00" in uri:
        problem = "must not contain '.' or '..' segments or NUL bytes"
    elif not any(_upload_matches(uri, p) for p in prefixes):
        problem = f"must start with an allowed upload prefix ({', '.join(prefixes)})"
    if problem:
        raise RequestInvalid.at("upload_uri", f"{problem}; got {uri!r}", allowed=prefixes)


class BodyTooLarge(StarletteHTTPException):
    """Raised while the body is read when it turns out larger than the limit (FastAPI passes
    HTTP exceptions from body reading through, so the app's handler answers 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body too large: more than {limit} bytes (the limit)")


class BodyLimit:
    """ASGI middleware: request bodies above ``limit`` bytes get 413 with the one error body.

    A declared ``Content-Length`` over the limit is refused before anything is read; a body
    without one (chunked) is counted as it arrives.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            await self._refuse(send, declared)
            return
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send, None)

    async def _refuse(self, send: Send, declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else "more than that"
        body = json.dumps(
            {
                "error": "payload_too_large",
                "message": f"request body too large: {size}; the limit is {self.limit} bytes",
                "fields": [],
            }
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", []):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
