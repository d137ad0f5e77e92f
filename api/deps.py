"""FastAPI dependencies: the coordinator client, the sidecar config and the token check."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status

from profd.actors.runner import NodeRunner
from profd.api.client import CoordinatorClient
from profd.settings import SidecarConfig

__all__ = [
    "ClientDep",
    "ConfigDep",
    "NodeIdDep",
    "RunnerDep",
    "get_client",
    "get_config",
    "get_node_id",
    "get_runner",
    "require_token",
]


def get_client(request: Request) -> CoordinatorClient:
    return request.app.state.client


def get_config(request: Request) -> SidecarConfig:
    return request.app.state.config


def get_runner(request: Request) -> NodeRunner:
    return request.app.state.runner


def get_node_id(request: Request) -> str | None:
    return request.app.state.node_id


ClientDep = Annotated[CoordinatorClient, Depends(get_client)]
ConfigDep = Annotated[SidecarConfig, Depends(get_config)]
RunnerDep = Annotated[NodeRunner, Depends(get_runner)]
NodeIdDep = Annotated[str | None, Depends(get_node_id)]


def require_token(request: Request, config: ConfigDep) -> None:
    """Every state-changing route needs ``Authorization: Bearer <token>`` when a token is set."""
    if not config.token:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing bearer token (see the token file printed by `profd up`)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not secrets.compare_digest(given.strip().encode(), config.token.encode()):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "invalid token")


TokenDep = Depends(require_token)
