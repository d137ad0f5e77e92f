"""Answers that are already validated models, serialized once.

The coordinator returns frozen, validated views; letting FastAPI dump, re-validate and
re-encode them against the route's ``response_model`` costs more than the rest of a status
or trace listing request. Routes keep ``response_model`` for the OpenAPI schema and return
:func:`model_response`; the fuzz test checks the bodies against that schema.
"""

from __future__ import annotations

from fastapi.responses import Response
from pydantic import BaseModel

__all__ = ["model_response"]


def model_response(model: BaseModel, status_code: int = 200) -> Response:
    """The model as JSON (pydantic's serializer), without FastAPI's second validation."""
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")
