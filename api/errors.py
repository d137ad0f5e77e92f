"""The one error body of the sidecar, as an OpenAPI model, and the responses routes declare."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from profd.core.request import FieldError

__all__ = ["ErrorBody", "error_responses"]


class ErrorBody(BaseModel):
    """Every error the sidecar returns has this shape."""

    error: str = Field(
        description="Machine-readable code: invalid_request, conflict, not_found, unauthorized, "
        "forbidden, payload_too_large, host_not_allowed, coordinator_unavailable, ..."
    )
    message: str = Field(description="What is wrong, naming the field or id and the rule.")
    fields: list[FieldError] = Field(
        description="For bad input: each offending dotted field and the rule it broke."
    )
    detail: dict[str, Any] | None = Field(
        None, description="Extra data, e.g. the sessions holding busy targets (409)."
    )


_WHY = {
    400: "The Host header names no host this sidecar answers to (`profd up --allow-host`)",
    401: "Bearer token missing (needed for changes; for every route beyond loopback)",
    403: "Wrong bearer token",
    404: "Unknown id",
    409: "Conflict with the current state",
    413: "Request body larger than the sidecar's limit",
    422: "Invalid input; `fields` names each offending field and the rule",
    503: "The coordinator does not answer",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for ``codes``, each with the one error body."""
    return {code: {"model": ErrorBody, "description": _WHY[code]} for code in codes}
