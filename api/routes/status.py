"""Liveness and cluster status."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, Field

from profd.api.deps import ClientDep, ReadTokenDep
from profd.api.errors import error_responses
from profd.api.responses import json_response
from profd.core.constants import __version__
from profd.core.errors import CoordinatorUnavailable
from profd.core.views import StatusView

__all__ = ["Health", "router"]

router = APIRouter(tags=["status"])


class Health(BaseModel):
    status: str = Field(description="ok when the coordinator answers, else degraded.")
    coordinator: bool = Field(description="Whether the coordinator answered.")
    version: str = Field(description="profd version of the sidecar.")


@router.get("/healthz", response_model=Health)
async def healthz(client: ClientDep) -> Health:
    """The sidecar is up; says whether the coordinator answers too."""
    try:
        await client.call("ping")
    except CoordinatorUnavailable:
        return Health(status="degraded", coordinator=False, version=__version__)
    return Health(status="ok", coordinator=True, version=__version__)


@router.get(
    "/api/v1/status",
    response_model=StatusView,
    dependencies=[ReadTokenDep],
    responses=error_responses(401, 403, 503),
)
async def get_status(client: ClientDep) -> Response:
    """Agents, sessions and traces at a glance."""
    return json_response(await client.call("read_json", "status"))
