"""Stacks: where every attached process's training thread is now (a live or hung job)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from profd.api.deps import ClientDep
from profd.api.errors import error_responses
from profd.api.responses import model_response
from profd.core.errors import RequestInvalid
from profd.core.stacks import StackMethod, StackQuery
from profd.core.views import StacksView

__all__ = ["router"]

router = APIRouter(
    prefix="/api/v1/stacks", tags=["stacks"], responses=error_responses(401, 403, 503)
)


def _ranks(raw: list[str] | None) -> tuple[int, ...] | None:
    """``ranks=0,2`` or ``ranks=0&ranks=2``; a ``ranks=`` naming none is refused (it reads
    as "these ranks", and every rank would be a surprise)."""
    if raw is None:
        return None
    out = []
    for part in ",".join(raw).split(","):
        part = part.strip()
        if not part:
            continue
        if not (part.isascii() and part.isdigit() and len(part) <= 9):
            raise RequestInvalid.at("ranks", f"{part[:20]!r} is not a rank (an int >= 0)")
        out.append(int(part))
    if not out:
        raise RequestInvalid.at("ranks", "names no rank (leave it out for every rank)")
    return tuple(out)


@router.get("", response_model=StacksView, responses=error_responses(404, 409, 422))
async def get_stacks(
    client: ClientDep,
    role: Annotated[str | None, Query(description="Only this role's processes.")] = None,
    ranks: Annotated[
        list[str] | None, Query(description="Only these ranks: `0,2` or repeated.")
    ] = None,
    job_id: Annotated[
        str | None, Query(description="Only this Ray job's processes ('none': outside Ray).")
    ] = None,
    native: Annotated[bool, Query(description="Native frames too (py-spy only).")] = False,
    method: Annotated[
        StackMethod,
        Query(description="auto: py-spy where it can attach, else the agents; py_spy; agent."),
    ] = StackMethod.AUTO,
    timeout_s: Annotated[
        float, Query(gt=0, le=60, allow_inf_nan=False, description="How long to wait for answers.")
    ] = 5.0,
) -> Response:
    """The Python stack of every matching attached process's training thread now, grouped by
    identical stack, the smallest (odd) groups first. Works with no session and no step
    marks: a hung job makes none. Processes that gave no stack are in `missing`, with why."""
    query = StackQuery.parse(
        role=role,
        ranks=_ranks(ranks),
        job_id=job_id,
        native=native,
        method=method,
        timeout_s=timeout_s,
    )
    view = await client.call("stacks", query)
    return model_response(view)
