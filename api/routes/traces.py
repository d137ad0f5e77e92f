"""Trace files the coordinator knows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path as FsPath
from typing import Annotated

from fastapi import APIRouter, Path, Query
from fastapi.responses import FileResponse, Response, StreamingResponse
from pydantic import BaseModel, BeforeValidator, Field

from profd.actors.runner import NodeRunner
from profd.api.deps import ClientDep, NodeIdDep, RunnerDep
from profd.api.errors import error_responses
from profd.api.responses import model_response
from profd.errors import NotFoundError
from profd.files import file_size, read_chunk
from profd.views import TraceView

__all__ = ["TraceList", "router"]

router = APIRouter(
    prefix="/api/v1/traces", tags=["traces"], responses=error_responses(401, 403, 503)
)


class TraceList(BaseModel):
    data: list[TraceView] = Field(description="Traces, by session, role, rank and step.")
    count: int = Field(description="Number of traces listed.")
    bytes: int = Field(description="Total size of the traces listed.")


def _digits(value: object) -> object:
    """Query integers are written in digits only ("0.0" or "1e3" is not a rank)."""
    text = str(value)
    if not (text.isascii() and text.isdigit()):
        raise ValueError("must be a non-negative integer written in digits")
    return value


@router.get("", response_model=TraceList, responses=error_responses(422))
async def list_traces(
    client: ClientDep,
    session_id: str | None = Query(None, description="Only this session."),
    role: str | None = Query(None, description="Only this role."),
    rank: Annotated[
        int | None,
        Query(ge=0, description="Only this rank (a non-negative integer)."),
        BeforeValidator(_digits),
    ] = None,
) -> Response:
    """Traces, optionally filtered."""
    traces = await client.call("list_traces", session_id, role, rank)
    listing = TraceList(data=traces, count=len(traces), bytes=sum(t.bytes for t in traces))
    return model_response(listing)


#: Bytes per Ray task when a file is streamed from another node.
CHUNK = 8 << 20


async def _remote_chunks(runner: NodeRunner, trace: TraceView, size: int) -> AsyncIterator[bytes]:
    offset = 0
    while offset < size:
        chunk = await runner.run(trace.node_id, read_chunk, trace.path, offset, CHUNK)
        if not chunk:
            break
        offset += len(chunk)
        yield chunk


@router.get(
    "/{trace_id}/download",
    response_class=FileResponse,
    responses={
        200: {
            "description": "The trace file",
            "content": {"application/gzip": {"schema": {"type": "string", "format": "binary"}}},
        },
        **error_responses(404, 422),
    },
)
async def download_trace(
    client: ClientDep,
    runner: RunnerDep,
    node_id: NodeIdDep,
    trace_id: str = Path(
        pattern=r"^[0-9a-f]{16}$", description="Trace id (16 hex digits) from GET /api/v1/traces."
    ),
) -> Response:
    """The file of a known trace (never an arbitrary path), read on the node that holds it."""
    trace = await client.call("get_trace", trace_id)
    headers = {"Content-Disposition": f'attachment; filename="{trace.file_name}"'}
    remote = trace.node_id is not None and node_id is not None and trace.node_id != node_id
    if remote:
        try:
            size = await asyncio.wait_for(runner.run(trace.node_id, file_size, trace.path), 30)
        except Exception as exc:  # the node died or cannot be reached
            raise NotFoundError(
                f"trace {trace_id} lives on node {trace.node_id} ({trace.hostname}), which does "
                f"not answer: {type(exc).__name__}",
                trace_id=trace_id,
            ) from None
        if size is None:
            raise NotFoundError(
                f"trace {trace_id} is gone from its node ({trace.hostname})", trace_id=trace_id
            )
        headers.update({"Content-Length": str(size), "X-Profd-Node": trace.node_id or ""})
        return StreamingResponse(
            _remote_chunks(runner, trace, size), media_type="application/gzip", headers=headers
        )
    path = FsPath(trace.path)
    if not path.is_file():
        raise NotFoundError(f"trace {trace_id} is gone from {trace.hostname}", trace_id=trace_id)
    headers["X-Profd-Node"] = node_id or ""
    return FileResponse(path, media_type="application/gzip", headers=headers)
