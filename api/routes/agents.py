"""Registered agents."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, Field

from profd.api.deps import ClientDep
from profd.api.errors import error_responses
from profd.api.responses import json_listing
from profd.core.views import AgentView

__all__ = ["AgentList", "router"]

router = APIRouter(
    prefix="/api/v1/agents", tags=["agents"], responses=error_responses(401, 403, 503)
)


class AgentList(BaseModel):
    data: list[AgentView] = Field(description="Agents, ordered by role and rank.")
    count: int = Field(description="Number of agents listed.")


@router.get("", response_model=AgentList)
async def list_agents(client: ClientDep) -> Response:
    """Every agent the coordinator knows, alive, lost or closed, with its live step and
    stage times (last, rolling median, newest durations)."""
    return json_listing(await client.call("read_json", "list_agents"))
