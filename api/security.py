"""What the sidecar accepts from the network: loopback rule, confinement, request size.

* :func:`is_loopback` decides whether reads need the token too (a sidecar bound beyond
  loopback answers nothing without it).
* :func:`confine_save_path` / :func:`confine_upload_uri` keep a session's output inside what
  the operator configured at ``profd up`` (``--allow-save-root`` / ``--allow-upload-prefix``);
  a request that tries to leave it gets a 422 naming the field and the rule.
* :class:`BodyLimit` refuses request bodies over ``SidecarConfig.max_body_bytes`` with 413.
* :class:`HostCheck` answers only requests whose ``Host`` header names the sidecar
  (:func:`allowed_host_names`; ``SidecarConfig.allowed_hosts`` adds names): a web page that
  a local user opens cannot read it through DNS rebinding (its requests carry its own name).

Paths are checked on the sidecar's node with symlinks resolved (``os.path.realpath``); a
path that a symlink created *after* the check leads elsewhere is not caught (the coordinator
and the agents write where the request says).
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from collections.abc import Iterable

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from profd.core.errors import RequestInvalid
from profd.core.settings import SidecarConfig

__all__ = [
    "BodyLimit",
    "BodyTooLarge",
    "HostCheck",
    "allowed_host_names",
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


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
    elif not _encodable(uri):
        problem = "must be valid Unicode text (no lone surrogates)"
    elif not any(_upload_matches(uri, p) for p in prefixes):
        problem = f"must start with an allowed upload prefix ({', '.join(prefixes)})"
    if problem:
        raise RequestInvalid.at("upload_uri", f"{problem}; got {uri!r}", allowed=prefixes)


class BodyTooLarge(StarletteHTTPException):
    """Raised while the body is read when it turns out larger than the limit (FastAPI passes
    HTTP exceptions from body reading through, so the app's handler answers 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body too large: more than {limit} bytes (the limit)")


async def send_error(
    send: Send, status: int, error: str, message: str, fields: list[dict[str, str]]
) -> None:
    """Answer from raw ASGI middleware with the app's error shape, closing the connection."""
    body = json.dumps({"error": error, "message": message, "fields": fields}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


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
        message = f"request body too large: {size}; the limit is {self.limit} bytes"
        await send_error(send, 413, "payload_too_large", message, [])


#: Names of this machine's loopback interface, answered whatever the bind address.
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "127.0.0.1", "::1"})


def machine_names() -> set[str]:
    """This machine's host name and fully qualified name (lower case), as far as known."""
    names: set[str] = set()
    for get in (socket.gethostname, socket.getfqdn):
        try:
            name = SidecarConfig.host_name(get())
        except OSError:
            continue
        if name:
            names.add(name)
    return names


def allowed_host_names(config: SidecarConfig) -> frozenset[str] | None:
    """The names (as :meth:`SidecarConfig.host_name` writes them) a request's ``Host`` may
    give, for ``config``; ``None`` when ``allowed_hosts`` holds ``"*"`` (no check).

    Always the loopback names and ``allowed_hosts``; plus the bind address, or, bound to
    every interface, this machine's names (:class:`HostCheck` then also takes any IP literal).
    """
    if "*" in config.allowed_hosts:
        return None
    names = set(LOOPBACK_NAMES) | set(config.allowed_hosts)
    if SidecarConfig.host_is_wildcard(config.host):
        names |= machine_names()
    else:
        bind = SidecarConfig.host_name(config.host)
        if bind:
            names.add(bind)
    return frozenset(names)


class HostCheck:
    """ASGI middleware: a request whose ``Host`` header is missing, repeated or not one of
    ``allowed`` gets 400 with the one error body, before any route runs (every route: the
    API, ``/healthz``, ``/metrics``, the dashboard and the schema).

    ``allowed=None`` checks nothing (``allowed_hosts=("*",)``). Beyond the names, any
    loopback address literal (``127.x.y.z``, ``::1``) is taken, and with ``any_ip`` (a
    wildcard bind) any IP-address literal: DNS rebinding needs a name, never an address.
    The cost per request: the header normalised, one frozenset lookup.
    """

    def __init__(self, app: ASGIApp, allowed: frozenset[str] | None, any_ip: bool = False) -> None:
        self.app = app
        self.allowed = allowed
        self.any_ip = any_ip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.allowed is None or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        hosts = [v for k, v in scope.get("headers", []) if k == b"host"]
        if len(hosts) == 1:
            raw = hosts[0].decode("latin-1")
            if self.permits(raw):
                await self.app(scope, receive, send)
                return
            got = f"Host {raw[:200]!r} is not a name this sidecar answers to"
        elif hosts:
            got = f"{len(hosts)} Host headers (exactly one is needed)"
        else:
            got = "no Host header (the sidecar answers only requests that name it)"
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await self._refuse(send, got)

    def permits(self, raw: str) -> bool:
        """Whether a ``Host`` header value names this sidecar."""
        name = SidecarConfig.host_name(raw)
        if name is None:
            return False
        if name in self.allowed:  # type: ignore[operator]  (None is handled by the caller)
            return True
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            return False
        return self.any_ip or address.is_loopback

    def _shown(self) -> str:
        names = sorted(n if ":" not in n else f"[{n}]" for n in self.allowed or ())
        extra = "any IP address" if self.any_ip else "any 127.x.y.z"
        return ", ".join([*names, extra])

    async def _refuse(self, send: Send, got: str) -> None:
        message = (
            f"{got}; allowed: {self._shown()} (with or without a :port). This guards against "
            "DNS rebinding. To reach the sidecar by another name, the operator adds it with "
            "`profd up --allow-host NAME` (repeatable)"
        )
        fields = [{"field": "host", "message": got, "type": "host_not_allowed"}]
        await send_error(send, 400, "host_not_allowed", message, fields)


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", []):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
