"""Trace files the coordinator knows."""

from __future__ import annotations

from pathlib import Path as FsPath

from fastapi import APIRouter, Path, Query
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field

from profd.api.deps import ClientDep
from profd.errors import NotFoundError
from profd.views import TraceView

router = APIRouter(prefix="/api/v1/traces", tags=["traces"])


class TraceList(BaseModel):
    data: list[TraceView] = Field(description="Traces, by session, role, rank and step.")
    count: int = Field(description="Number of traces listed.")
    bytes: int = Field(description="Total size of the traces listed.")


@router.get("", response_model=TraceList)
async def list_traces(
    client: ClientDep,
    session_id: str | None = Query(None, description="Only this session."),
    role: str | None = Query(None, description="Only this role."),
    rank: int | None = Query(None, ge=0, description="Only this rank."),
) -> TraceList:
    """Traces, optionally filtered."""
    traces = await client.call("list_traces", session_id, role, rank)
    return TraceList(data=traces, count=len(traces), bytes=sum(t.bytes for t in traces))


@router.get(
    "/{trace_id}/download",
    response_class=FileResponse,
    responses={404: {"description": "Unknown trace or file gone"}},
)
async def download_trace(
    client: ClientDep, trace_id: str = Path(pattern=r"^[0-9a-f]{16}$", description="Trace id")
) -> FileResponse:
    """The file of a known trace (never an arbitrary path)."""
    traces = {t.trace_id: t for t in await client.call("list_traces", None, None, None)}
    trace = traces.get(trace_id)
    if trace is None:
        raise NotFoundError(f"no trace {trace_id!r}", trace_id=trace_id)
    path = FsPath(trace.path)
    if not path.is_file():
        raise NotFoundError(
            f"trace {trace_id} is not readable from the sidecar's node "
            f"(it lives on {trace.hostname})",
            trace_id=trace_id,
        )
    return FileResponse(path, media_type="application/gzip", filename=trace.file_name)
