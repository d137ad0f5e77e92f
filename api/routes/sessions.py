"""Profiling sessions: create, list, get, cancel."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Path, Request, status
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from profd.analysis.diff import DIFF_TOP_OPS, SessionDiff, diff_summaries
from profd.analysis.models import SessionSummary, SkippedFile
from profd.analysis.summary import summarize_files
from profd.api.client import CoordinatorClient
from profd.api.deps import (
    ClientDep,
    ConfigDep,
    CursorQuery,
    LimitQuery,
    LocatorDep,
    SummariesDep,
    TokenDep,
)
from profd.api.errors import error_responses
from profd.api.responses import json_listing, json_response
from profd.api.security import confine_save_path, confine_upload_uri
from profd.core.errors import ConflictError, NotFoundError, RequestInvalid
from profd.core.paging import DEFAULT_LIMIT
from profd.core.request import SessionRequest
from profd.core.settings import SidecarConfig
from profd.core.views import SessionView

__all__ = ["SessionList", "router"]

router = APIRouter(
    prefix="/api/v1/sessions", tags=["sessions"], responses=error_responses(401, 403, 503)
)

SessionId = Path(
    description="Session id, as returned by POST /api/v1/sessions.",
    pattern=r"^[A-Za-z0-9._\-]{1,64}$",
)
OtherSessionId = Path(
    description="Session B's id: compared against the first one (A).",
    pattern=r"^[A-Za-z0-9._\-]{1,64}$",
)


class SessionList(BaseModel):
    data: list[SessionView] = Field(
        description="This page of sessions, newest first (created_at, then session_id, descending)."
    )
    count: int = Field(description="Number of sessions in this page.")
    total: int = Field(description="Number of sessions in all pages.")
    next_cursor: str | None = Field(
        description="Pass as `cursor` to get the next page; null on the last page."
    )


def under(root: str, exc: RequestInvalid) -> RequestInvalid:
    """``exc`` with its fields named under ``root`` of the body (a trigger's ``session``)."""
    if not root:
        return exc
    return RequestInvalid.from_fields(
        [f.model_copy(update={"field": f"{root}.{f.field}"}) for f in exc.fields]
    )


def upload_prefix_first(root: str = "") -> Any:
    """A dependency: an ``upload_uri`` (under ``root`` of the body) outside every allowed
    prefix is refused before the body's model checks it, so the user hears the operator's
    rule, not that this host lacks the filesystem's package (``Install s3fs``) for a
    protocol that would be refused anyway."""

    async def check(request: Request, config: ConfigDep) -> None:
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            return  # a body FastAPI does not read as JSON: the model refuses it (422)
        try:
            body = await request.json()  # parsed once: FastAPI's own read is cached
        except (ValueError, RecursionError):
            return  # not JSON: the body's own validation says so
        if root and isinstance(body, dict):
            body = body.get(root)
        uri = body.get("upload_uri") if isinstance(body, dict) else None
        if isinstance(uri, str) and uri.strip():
            try:
                confine_upload_uri(uri, config.upload_prefixes)
            except RequestInvalid as exc:
                raise under(root, exc) from None

    return check


EXAMPLES = {
    "next_steps": {
        "summary": "The next 2 steps on every actor rank",
        "value": {"next_steps": 2, "roles": {"actor": {"all_ranks": True}}},
    },
    "explicit": {
        "summary": "Steps 120-121 of actor ranks 0 and 8, CPU and CUDA",
        "value": {
            "tool": "torch",
            "steps": [120, 121],
            "roles": {
                "actor": {"ranks": [0, 8], "tool_config": {"torch": {"contents": ["cpu", "cuda"]}}}
            },
        },
    },
    "discrete": {
        "summary": "One trace per stage of critic rank 0 at step 300",
        "value": {"steps": [300], "roles": {"critic": {"discrete": True}}},
    },
}


@router.post(
    "",
    response_model=SessionView,
    status_code=status.HTTP_201_CREATED,
    dependencies=[TokenDep, Depends(upload_prefix_first())],
    responses=error_responses(409, 413, 422),
)
async def create_session(
    body: Annotated[SessionRequest, Body(openapi_examples=EXAMPLES)],
    client: ClientDep,
    config: ConfigDep,
) -> SessionView:
    """Start a profiling session; the reply says what matched and what was ignored, and why.

    Over HTTP, ``finish_hook_cmd`` needs ``profd up --allow-hook-commands``, ``save_path``
    must resolve under an allowed save root, ``upload_uri`` must start with an allowed
    upload prefix and a window covers at most 10,000 steps (422 naming the field
    otherwise). 409 names the session holding a target.
    """
    await check_session_fields(body, client, config)
    return await client.call("create_session", body)


async def check_session_fields(
    body: SessionRequest, client: CoordinatorClient, config: SidecarConfig, root: str = ""
) -> None:
    """The HTTP rules of a session (also a trigger's template, under ``root``): hook
    commands only when allowed, a bounded window, output where the operator allowed it."""
    try:
        if body.finish_hook_cmd is not None and not config.allow_hook_commands:
            raise RequestInvalid.at(
                "finish_hook_cmd",
                "shell commands over HTTP are disabled; start the sidecar with "
                "`profd up --allow-hook-commands` to accept them",
            )
        _check_window(body, config.max_window_steps)
        await _confine(body, client, config)
    except RequestInvalid as exc:
        raise under(root, exc) from None


def _check_window(body: SessionRequest, limit: int) -> None:
    """A window is materialised step by step: keep it to what profiling can mean."""
    if body.next_steps is not None and body.next_steps > limit:
        raise RequestInvalid.at(
            "next_steps", f"at most {limit} steps per session, got {body.next_steps}"
        )
    if body.steps is not None and len(body.steps) > limit:
        raise RequestInvalid.at(
            "steps", f"at most {limit} steps per session, got {len(body.steps)}"
        )


async def _confine(body: SessionRequest, client: CoordinatorClient, config: SidecarConfig) -> None:
    """Keep the session's output where the operator allowed it."""
    if body.save_path is not None:
        roots = list(config.save_roots)
        if not roots:
            roots = [(await client.call("status")).save_root]
        confine_save_path(body.save_path, roots, config.base_dir)
    if body.upload_uri is not None:
        confine_upload_uri(body.upload_uri, config.upload_prefixes)


@router.get("", response_model=SessionList, responses=error_responses(422))
async def list_sessions(
    client: ClientDep, limit: LimitQuery = DEFAULT_LIMIT, cursor: CursorQuery = None
) -> Response:
    """Sessions, a page at a time: the newest first; follow `next_cursor` for older ones."""
    page = await client.call("read_json", "list_sessions", limit, cursor)
    return json_listing(page, total=page.total, next_cursor=page.next_cursor)


@router.get("/{session_id}", response_model=SessionView, responses=error_responses(404, 422))
async def get_session(client: ClientDep, session_id: str = SessionId) -> Response:
    """One session with per-target progress and its traces."""
    return json_response(await client.call("read_json", "get_session", session_id))


@router.get(
    "/{session_id}/summary",
    response_model=SessionSummary,
    responses=error_responses(404, 409, 422, 503),
)
async def session_summary(
    client: ClientDep,
    locator: LocatorDep,
    summaries: SummariesDep,
    session_id: str = SessionId,
) -> SessionSummary:
    """Per step x stage x rank wall time, mini-batches, idle gaps, top operators, stragglers.

    Each trace is read on the node that holds it (Ray tasks) when it is not on this node; a
    trace of an earlier Ray cluster is found by its node's address or host name, and one on
    no node of this cluster is listed in `skipped` with the reason.
    """
    return await _summary_of(session_id, client, locator, summaries)


@router.get(
    "/{session_id}/diff/{other_id}",
    response_model=SessionDiff,
    responses=error_responses(404, 409, 422, 503),
)
async def session_diff(
    client: ClientDep,
    locator: LocatorDep,
    summaries: SummariesDep,
    session_id: str = SessionId,
    other_id: str = OtherSessionId,
) -> SessionDiff:
    """Session `other_id` (B) against `session_id` (A): per stage x role and per rank the
    median wall time per step, its change and a verdict (slower / faster / same within the
    noise threshold it names), and the operators and kernels that changed most."""
    a = await _summary_of(session_id, client, locator, summaries, top=DIFF_TOP_OPS)
    b = await _summary_of(other_id, client, locator, summaries, top=DIFF_TOP_OPS)
    return diff_summaries(a, b)


async def _summary_of(
    session_id: str, client: Any, locator: Any, summaries: Any, top: int = 10
) -> SessionSummary:
    view = await client.call("get_session", session_id)
    traces = [t for t in view.traces if t.file_name.endswith((".json.gz", ".json"))]
    if not traces:
        raise ConflictError(
            f"session {session_id} has no Chrome trace to summarize yet ({view.state.value})",
            state=view.state.value,
        )
    places = await locator.place_all(traces)
    found = [(t, p) for t, p in zip(traces, places, strict=True) if p.found]
    lost = [
        SkippedFile(name=t.file_name, reason=p.reason or "")
        for t, p in zip(traces, places, strict=True)
        if not p.found
    ]
    if not found:
        raise NotFoundError(
            f"no trace of session {session_id} is on a node of this cluster: {lost[0].reason}",
            session_id=session_id,
        )
    nodes = None
    if any(not p.local for _, p in found):  # Ray tasks; local files stay on this node
        nodes = [p.node_id if not p.local else locator.here_id for _, p in found]
    paths = [t.path for t, _ in found]
    key = (session_id, top, tuple(t.trace_id for t in traces), tuple(p.node_id for p in places))
    cached = summaries.get(key)
    if cached is None:
        # One summary at a time: a burst of requests (reads are open on loopback) queues
        # instead of parsing the same gigabytes in parallel; the cache then answers them.
        async with summaries.lock:
            cached = summaries.get(key)
            if cached is None:
                # local files: in the low-priority worker; others: Ray tasks, waited for here
                run = asyncio.to_thread if nodes is not None else summaries.compute
                cached = await run(
                    summarize_files, paths, source=view.save_dir, nodes=nodes, workers=1, top=top
                )
                if lost:
                    cached = cached.model_copy(update={"skipped": [*cached.skipped, *lost]})
                if view.state.is_terminal and not lost:
                    summaries.put(key, cached)
    return cached


CANCEL_REASON = "cancelled by user"


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    reason: str = Field(
        CANCEL_REASON, min_length=1, max_length=500, description="Why (kept in the session)."
    )


@router.post(
    "/{session_id}/cancel",
    response_model=SessionView,
    dependencies=[TokenDep],
    responses=error_responses(404, 409, 422),
)
async def cancel_session(
    client: ClientDep,
    session_id: str = SessionId,
    body: Annotated[CancelRequest | None, Body()] = None,
) -> SessionView:
    """Stop a live session; what was recorded so far is kept. The optional body says why
    (kept as the session's reason)."""
    reason = body.reason if body is not None else CANCEL_REASON
    return await client.call("cancel_session", session_id, reason)
