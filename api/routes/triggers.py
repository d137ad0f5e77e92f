"""Triggers: conditions on live step / stage times that start sessions by themselves."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Depends, Path, status
from fastapi.responses import Response
from pydantic import BaseModel, Field, ValidationError

from profd.api.deps import ClientDep, ConfigDep, TokenDep
from profd.api.errors import error_responses
from profd.api.responses import model_response
from profd.api.routes.sessions import check_session_fields, upload_prefix_first
from profd.core.errors import RequestInvalid
from profd.core.request import field_errors
from profd.core.trigger_request import TriggerRequest
from profd.core.views import TriggerView

__all__ = ["TriggerList", "router"]

router = APIRouter(
    prefix="/api/v1/triggers", tags=["triggers"], responses=error_responses(401, 403, 503)
)

TriggerId = Path(
    description="Trigger id, as returned by POST /api/v1/triggers.",
    pattern=r"^[A-Za-z0-9._\-]{1,64}$",
)

EXAMPLES = {
    "step_time": {
        "summary": "Profile the next 2 steps of an actor rank whose step takes 2x the median",
        "value": {
            "name": "slow-actor-step",
            "when": {"kind": "step_time", "role": "actor", "factor": 2.0, "baseline_steps": 20},
            "session": {"next_steps": 2},
            "cooldown_s": 600,
            "max_per_hour": 3,
        },
    },
    "stage_time": {
        "summary": "One slow update_actor stage, at least 500 ms",
        "value": {
            "name": "slow-update",
            "when": {
                "kind": "stage_time",
                "role": "actor",
                "stage": "update_actor",
                "factor": 1.5,
                "min_ms": 500,
            },
        },
    },
}


class TriggerList(BaseModel):
    data: list[TriggerView] = Field(description="Every trigger, newest first.")
    count: int = Field(description="Number of triggers.")


@router.post(
    "",
    response_model=TriggerView,
    status_code=status.HTTP_201_CREATED,
    dependencies=[TokenDep, Depends(upload_prefix_first("session"))],
    responses=error_responses(409, 413, 422),
)
async def create_trigger(
    body: Annotated[TriggerRequest, Body(openapi_examples=EXAMPLES)],
    client: ClientDep,
    config: ConfigDep,
) -> TriggerView:
    """Watch one role's live step (or stage) times; when a rank's newest duration exceeds
    `factor` x the role's rolling median (and `min_ms`), profile the next `next_steps` steps
    of that rank and one healthy peer. The session template is checked now, with the rules
    of POST /api/v1/sessions (422 naming the field). Names are unique: a name already
    watched is 409 (PUT /api/v1/triggers/{id} changes that trigger)."""
    await _check_template(body, client, config)
    return await client.call("add_trigger", body)


@router.put(
    "/{trigger_id}",
    response_model=TriggerView,
    dependencies=[TokenDep, Depends(upload_prefix_first("session"))],
    responses=error_responses(404, 409, 413, 422),
)
async def replace_trigger(
    body: Annotated[TriggerRequest, Body(openapi_examples=EXAMPLES)],
    client: ClientDep,
    config: ConfigDep,
    trigger_id: str = TriggerId,
) -> TriggerView:
    """Change a trigger at once, under the same id: its firings so far stay (cooldown, the
    hourly cap and the disk budget count them); what it judged on starts afresh. Checked as
    POST is; the name may be kept or changed to one no other trigger has (409)."""
    await _check_template(body, client, config)
    return await client.call("replace_trigger", trigger_id, body)


async def _check_template(body: TriggerRequest, client: ClientDep, config: ConfigDep) -> None:
    try:
        template = body.session_for((0,))
    except ValidationError as exc:  # checked by the model already; never a 500 regardless
        raise RequestInvalid.from_fields(field_errors(exc, root="session")) from None
    await check_session_fields(template, client, config, root="session")


@router.get("", response_model=TriggerList)
async def list_triggers(client: ClientDep) -> Response:
    """Every trigger with its newest firings (evidence, session started) and what it
    suppressed."""
    triggers = await client.call("list_triggers")
    return model_response(TriggerList(data=triggers, count=len(triggers)))


@router.get("/{trigger_id}", response_model=TriggerView, responses=error_responses(404, 422))
async def get_trigger(client: ClientDep, trigger_id: str = TriggerId) -> Response:
    """One trigger with its newest firings and what it suppressed."""
    return model_response(await client.call("get_trigger", trigger_id))


@router.delete(
    "/{trigger_id}",
    response_model=TriggerView,
    dependencies=[TokenDep],
    responses=error_responses(404, 422),
)
async def delete_trigger(client: ClientDep, trigger_id: str = TriggerId) -> Response:
    """Stop watching; the sessions it started stay."""
    return model_response(await client.call("delete_trigger", trigger_id))
