"""Trace files the coordinator knows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path as FsPath

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import FileResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from profd.actors.runner import NodeRunner
from profd.api.deps import (
    ClientDep,
    CursorQuery,
    LimitQuery,
    LocatorDep,
    NodeIdDep,
    RankQuery,
    RunnerDep,
)
from profd.api.errors import error_responses
from profd.api.responses import json_listing
from profd.core.errors import NotFoundError
from profd.core.files import file_size, read_chunk
from profd.core.paging import DEFAULT_LIMIT
from profd.core.views import TraceView

__all__ = ["TraceList", "router"]

router = APIRouter(
    prefix="/api/v1/traces", tags=["traces"], responses=error_responses(401, 403, 503)
)


class TraceList(BaseModel):
    data: list[TraceView] = Field(
        description="This page of traces, newest first (created_at, then trace_id, descending)."
    )
    count: int = Field(description="Number of traces in this page.")
    total: int = Field(description="Number of traces matching the filters, in all pages.")
    next_cursor: str | None = Field(
        description="Pass as `cursor` to get the next page; null on the last page."
    )
    bytes: int = Field(
        description="Total size of every trace matching the filters (all pages, not only this one)."
    )


@router.get("", response_model=TraceList, responses=error_responses(422))
async def list_traces(
    client: ClientDep,
    session_id: str | None = Query(None, description="Only this session."),
    role: str | None = Query(None, description="Only this role."),
    rank: RankQuery = None,
    limit: LimitQuery = DEFAULT_LIMIT,
    cursor: CursorQuery = None,
) -> Response:
    """Traces, optionally filtered, a page at a time (newest first; follow `next_cursor`)."""
    page = await client.call("read_json", "list_traces", session_id, role, rank, limit, cursor)
    return json_listing(page, total=page.total, next_cursor=page.next_cursor, bytes=page.bytes)


#: Bytes per Ray task when a file is streamed from another node.
CHUNK = 8 << 20


async def _remote_chunks(
    runner: NodeRunner, node_id: str, trace: TraceView, size: int
) -> AsyncIterator[bytes]:
    offset = 0
    while offset < size:
        chunk = await runner.run(node_id, read_chunk, trace.path, offset, CHUNK)
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
    request: Request,
    client: ClientDep,
    runner: RunnerDep,
    locator: LocatorDep,
    node_id: NodeIdDep,
    trace_id: str = Path(
        pattern=r"^[0-9a-f]{16}$", description="Trace id (16 hex digits) from GET /api/v1/traces."
    ),
) -> Response:
    """The file of a known trace (never an arbitrary path), read on the node that holds it.

    The node is found by its Ray node id, or, for a trace of an earlier Ray cluster (node ids
    change with each one), by its address or host name; 404 when no node of this cluster is
    it.
    """
    trace = await client.call("get_trace", trace_id)
    headers = {"Content-Disposition": f'attachment; filename="{trace.file_name}"'}
    place = await locator.place(trace)
    if not place.found:
        raise NotFoundError(f"trace {trace_id}: {place.reason}", trace_id=trace_id)
    if not place.local and place.node_id:
        there = place.node_id
        try:
            size = await asyncio.wait_for(runner.run(there, file_size, trace.path), 30)
        except Exception as exc:  # the node died or cannot be reached
            raise NotFoundError(
                f"trace {trace_id} lives on node {there} ({trace.node_ip or trace.hostname}), "
                f"which does not answer: {type(exc).__name__}",
                trace_id=trace_id,
            ) from None
        if size is None:
            raise NotFoundError(
                f"trace {trace_id} is gone from its node ({trace.hostname})", trace_id=trace_id
            )
        headers.update({"Content-Length": str(size), "X-Profd-Node": there})
        if request.method == "HEAD":
            return Response(media_type="application/gzip", headers=headers)
        return StreamingResponse(
            _remote_chunks(runner, there, trace, size),
            media_type="application/gzip",
            headers=headers,
        )
    path = FsPath(trace.path)
    if not path.is_file():
        raise NotFoundError(f"trace {trace_id} is gone from {trace.hostname}", trace_id=trace_id)
    headers["X-Profd-Node"] = node_id or ""
    return FileResponse(path, media_type="application/gzip", headers=headers)


# HEAD (`curl -I`, a browser's check before a download): the size and name without the bytes.
router.add_api_route(
    "/{trace_id}/download",
    download_trace,
    methods=["HEAD"],
    operation_id="head_trace_download",
    summary="Download Trace (headers only)",
    responses=error_responses(404, 422),
)
