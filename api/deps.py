"""FastAPI dependencies: the coordinator client, the sidecar config, where trace files are
read, the token check, and the query parameters the list routes share.

All are ``async def``: they never block, and FastAPI runs a plain ``def`` dependency on a
worker thread (two thread hand-offs per dependency, per request).
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Query, Request, status
from pydantic import BeforeValidator

from profd.actors.runner import NodeRunner, TraceLocator
from profd.api.client import CoordinatorClient
from profd.api.summaries import SummaryCache
from profd.core.paging import DEFAULT_LIMIT, MAX_CURSOR_CHARS, MAX_LIMIT
from profd.core.request import MAX_INT
from profd.core.settings import SidecarConfig

__all__ = [
    "ClientDep",
    "ConfigDep",
    "CursorQuery",
    "LimitQuery",
    "LocatorDep",
    "NodeIdDep",
    "RankQuery",
    "ReadTokenDep",
    "RunnerDep",
    "SummariesDep",
    "TokenDep",
    "digits",
    "get_client",
    "get_config",
    "get_locator",
    "get_node_id",
    "get_runner",
    "require_read_token",
    "require_token",
]


async def get_client(request: Request) -> CoordinatorClient:
    return request.app.state.client


async def get_config(request: Request) -> SidecarConfig:
    return request.app.state.config


async def get_runner(request: Request) -> NodeRunner:
    return request.app.state.runner


async def get_node_id(request: Request) -> str | None:
    return request.app.state.node_id


async def get_summaries(request: Request) -> SummaryCache:
    return request.app.state.summaries


ClientDep = Annotated[CoordinatorClient, Depends(get_client)]
ConfigDep = Annotated[SidecarConfig, Depends(get_config)]
RunnerDep = Annotated[NodeRunner, Depends(get_runner)]
NodeIdDep = Annotated[str | None, Depends(get_node_id)]
SummariesDep = Annotated[SummaryCache, Depends(get_summaries)]


async def get_locator(runner: RunnerDep, node_id: NodeIdDep) -> TraceLocator:
    """Where each trace file is read: here, on the live node that holds it, or nowhere."""
    return TraceLocator(runner, node_id)


LocatorDep = Annotated[TraceLocator, Depends(get_locator)]


def digits(value: object) -> object:
    """Query integers are written in digits only ("0.0" or "1e3" is not a rank)."""
    text = str(value)
    if not (text.isascii() and text.isdigit()):
        raise ValueError("must be a non-negative integer written in digits")
    return value


LimitQuery = Annotated[
    int,
    Query(
        ge=1,
        le=MAX_LIMIT,
        description=f"Items per page, 1 to {MAX_LIMIT} (default {DEFAULT_LIMIT}).",
    ),
    BeforeValidator(digits),
]
CursorQuery = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=MAX_CURSOR_CHARS,
        description="Opaque cursor: the `next_cursor` of the previous page (omit for the "
        "newest page).",
    ),
]
RankQuery = Annotated[
    int | None,
    Query(ge=0, le=MAX_INT, description=f"Only this rank (an integer, 0 to {MAX_INT})."),
    BeforeValidator(digits),
]


def _check_bearer(request: Request, token: str) -> None:
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing bearer token: send `Authorization: Bearer <token>` with the token from the "
            "file `profd up` printed (`token` in its state directory: ~/.profd unless "
            "PROFD_STATE_DIR moved it)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    # Constant time in the token's content (compare_digest); its length is not a secret.
    if not secrets.compare_digest(given.strip().encode(), token.encode()):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "invalid token")


async def require_token(request: Request, config: ConfigDep) -> None:
    """Every state-changing route needs ``Authorization: Bearer <token>`` when a token is set."""
    if config.token:
        _check_bearer(request, config.token)


async def require_read_token(request: Request, config: ConfigDep) -> None:
    """Reads too need the token when the sidecar listens beyond loopback."""
    if config.token and not config.loopback:
        _check_bearer(request, config.token)


TokenDep = Depends(require_token)
ReadTokenDep = Depends(require_read_token)
