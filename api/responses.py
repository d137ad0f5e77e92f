"""Answers that are already validated models, serialized once.

The coordinator returns frozen, validated views; letting FastAPI dump, re-validate and
re-encode them against the route's ``response_model`` costs more than the rest of a status
or trace listing request. Routes keep ``response_model`` for the OpenAPI schema and return
:func:`model_response`; the fuzz test checks the bodies against that schema.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import Response
from pydantic import BaseModel

from profd.core.json_body import JsonItems

__all__ = ["json_listing", "json_response", "model_response"]


def model_response(model: BaseModel, status_code: int = 200) -> Response:
    """The model as JSON (pydantic's serializer), without FastAPI's second validation."""
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")


def json_response(body: bytes) -> Response:
    """A view the coordinator already encoded (:mod:`profd.core.json_body`)."""
    return Response(body, media_type="application/json")


def json_listing(listing: JsonItems, **fields: Any) -> Response:
    """``{"data": [...], "count": n, ...}`` around a listing the coordinator encoded;
    ``fields`` names the route's page fields (``total``, ``next_cursor``, ``bytes``)."""
    tail = orjson.dumps({"count": listing.count, **fields})
    return json_response(b'{"data":' + listing.items + b"," + tail[1:])
