"""The coordinator's index of the trace files agents wrote (what downloads may serve).

A trace enters the index once, from the agent's ``trace`` event, and only when its file lies
inside its session's directory; the index is persisted with the store, so a restarted
coordinator still serves the traces of earlier sessions.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from profd.core.errors import NotFoundError
from profd.core.json_body import JsonItems
from profd.core.paging import Listing, Page, page_of
from profd.core.protocol import AgentEvent, AgentInfo, TraceWritten
from profd.core.views import TraceView

if TYPE_CHECKING:
    from profd.actors.sessions import Session
    from profd.actors.store import Store

__all__ = ["StallStats", "TraceIndex", "TraceRefused"]

log = logging.getLogger(__name__)


class TraceRefused(Exception):
    """A reported trace the index does not take (the message says why)."""


@dataclass
class StallStats:
    """Training-thread stalls of one tool's exports (since this incarnation started)."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0

    def add(self, stall_s: float) -> None:
        self.count += 1
        self.total_s += stall_s
        self.max_s = max(self.max_s, stall_s)

    def as_list(self) -> list[float]:
        """``[count, sum, max]``: the shape the sidecar's /metrics reads."""
        return [self.count, self.total_s, self.max_s]


class TraceIndex:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._traces: dict[str, TraceView] = {}
        #: The same views by session (a session's view and its trace pages read only its
        #: own: with thousands of past sessions, scanning every trace per view dominated)
        self._by_session: dict[str, dict[str, TraceView]] = {}
        #: Newest-first listings by (role, rank), either or both None for any: a page of
        #: every trace of a rank is two bisections, its totals kept. Traces join them when
        #: a listing is first read after they arrived (``_unlisted``): a fleet's window end
        #: indexes tens of thousands of traces at once, and sorting them in one go then
        #: costs a fraction of four inserts each on the coordinator's event path.
        self._listings: dict[tuple[str | None, int | None], Listing[TraceView]] = {}
        self._unlisted: list[TraceView] = []
        self._bytes = 0
        self._by_tool: dict[str, list[int]] = {}  # tool -> [files, bytes]
        self._stalls: dict[str, StallStats] = {}  # tool -> its export stalls
        self._encoded: dict[str, bytes] = {}  # trace id -> its view's JSON, once read
        #: Rows to persist at the end of the open :meth:`batch` (None: none is open).
        self._unsaved: list[tuple[str, str, bytes]] | None = None

    def restore(self, rows: Iterable[dict[str, Any]]) -> int:
        """Take the traces a previous incarnation persisted; return how many."""
        n = 0
        for d in rows:
            self._put(TraceView.model_validate(d))
            n += 1
        return n

    def index(self, info: AgentInfo, ev: AgentEvent, session: Session | None) -> TraceView | None:
        """Index the trace of ``ev`` (a ``trace`` event of agent ``info``); the new view, or
        ``None`` for a re-sent event. Raises :class:`TraceRefused` for a file outside the
        session's directory (noted in the session's warnings)."""
        p = cast(TraceWritten, ev.payload)  # a trace event always carries its file
        path = os.path.normpath(p.path)  # served as checked
        if not _inside_session_dir(path, session, ev.session_id or ""):
            # Downloads serve indexed paths only: an agent cannot make the sidecar serve
            # a file outside its session's directory.
            msg = (
                f"{info.role} rank {info.rank}: trace outside the session directory refused: {path}"
            )
            log.warning("session %s: %s", ev.session_id, msg)
            if session is not None:
                session.warnings.append(msg)
            raise TraceRefused(msg)
        if p.trace_id in self._traces:
            return None  # a re-sent event (agent retried after an outage): indexed once
        view = TraceView(
            trace_id=p.trace_id,
            session_id=ev.session_id or "",
            agent_id=info.agent_id,
            role=info.role,
            rank=info.rank,
            tool=p.tool,
            scope=p.scope,
            steps=[int(s) for s in p.steps],
            path=path,
            file_name=path.rsplit("/", 1)[-1],
            bytes=int(p.bytes),
            node_id=info.node_id,
            node_ip=info.node_ip,
            hostname=info.hostname,
            created_at=ev.time,
        )
        self._put(view)
        self._stalls.setdefault(view.tool, StallStats()).add(float(p.stall_s or 0.0))
        row = (view.trace_id, view.session_id, view.__pydantic_serializer__.to_json(view))
        if self._unsaved is not None:
            self._unsaved.append(row)
        else:
            self._store.save_traces([row])
        return view

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Traces indexed inside are handed to the store together when it ends (one
        hand-over for a relay's batch of a node's window ends, not one per trace)."""
        outer = self._unsaved is not None
        if not outer:
            self._unsaved = []
        try:
            yield
        finally:
            if not outer:
                rows, self._unsaved = self._unsaved or [], None
                self._store.save_traces(rows)

    def _put(self, view: TraceView) -> None:
        if view.trace_id in self._traces:
            return  # indexed once
        self._traces[view.trace_id] = view
        self._by_session.setdefault(view.session_id, {})[view.trace_id] = view
        self._unlisted.append(view)
        self._bytes += view.bytes
        written = self._by_tool.setdefault(view.tool, [0, 0])
        written[0] += 1
        written[1] += view.bytes

    def _listing(self, key: tuple[str | None, int | None]) -> Listing[TraceView]:
        """The listing of ``key`` with every trace indexed so far."""
        if self._unlisted:
            self._list_unlisted()
        return self._listings.get(key) or Listing(_newest_key, _size)

    def _list_unlisted(self) -> None:
        views, self._unlisted = self._unlisted, []
        groups: dict[tuple[str | None, int | None], list[TraceView]] = {}
        for v in views:
            for k in ((None, None), (v.role, None), (None, v.rank), (v.role, v.rank)):
                group = groups.get(k)
                if group is None:
                    groups[k] = [v]
                else:
                    group.append(v)
        for k, group in groups.items():
            listing = self._listings.get(k)
            if listing is None:
                listing = self._listings[k] = Listing(_newest_key, _size)
            listing.extend(group)

    def get(self, trace_id: str) -> TraceView:
        trace = self._traces.get(trace_id)
        if trace is None:
            raise NotFoundError(f"no trace {trace_id!r}", trace_id=trace_id)
        return trace

    def all(self) -> Iterable[TraceView]:
        return self._traces.values()

    def of_session(self, session_id: str) -> list[TraceView]:
        return list(self._by_session.get(session_id, {}).values())

    def count_of(self, session_id: str) -> int:
        return len(self._by_session.get(session_id, ()))

    def find(
        self,
        session_id: str | None = None,
        role: str | None = None,
        rank: int | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> list[TraceView] | Page:
        """See :meth:`ProfileCoordinator.list_traces`."""
        if session_id is None and (limit is not None or cursor is not None):
            listing = self._listing((role, rank))
            chosen, next_cursor, total = listing.page("traces", limit, cursor)
            return Page(chosen, next_cursor, total, listing.bytes)
        # a session's traces are few: filtered and paged as they come
        pool = self._traces if session_id is None else self._by_session.get(session_id, {})
        out = [
            t
            for t in pool.values()
            if (role is None or t.role == role) and (rank is None or t.rank == rank)
        ]
        if limit is None and cursor is None:
            return sorted(out, key=lambda t: (t.session_id, t.role, t.rank, t.steps, t.file_name))
        chosen, next_cursor, total = page_of(out, _newest_key, "traces", limit, cursor)
        return Page(chosen, next_cursor, total, sum(t.bytes for t in out))

    def find_json(self, *query: Any) -> JsonItems:
        """:meth:`find` (its arguments) as :class:`~profd.core.json_body.JsonItems`; each
        trace's JSON is encoded once (a view never changes), when first read."""
        found = self.find(*query)
        if not isinstance(found, Page):
            return JsonItems(self._encode(found), len(found), len(found))
        encoded = self._encode(found.items)
        return JsonItems(encoded, len(found.items), found.total, found.next_cursor, found.bytes)

    def _encode(self, views: list[TraceView]) -> bytes:
        return b"[" + b",".join(self._json_of(t) for t in views) + b"]"

    def _json_of(self, view: TraceView) -> bytes:
        data = self._encoded.get(view.trace_id)
        if data is None:
            data = self._encoded[view.trace_id] = view.__pydantic_serializer__.to_json(view)
        return data

    def __len__(self) -> int:
        return len(self._traces)

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def written(self) -> dict[str, list[int]]:
        """Files and bytes by tool: ``{tool: [files, bytes]}``."""
        return {tool: list(v) for tool, v in self._by_tool.items()}

    def stalls(self) -> dict[str, list[float]]:
        """Export stalls by tool, as ``[count, sum, max]``."""
        return {tool: s.as_list() for tool, s in self._stalls.items()}


def _newest_key(t: TraceView) -> tuple[float, str]:
    """Trace listings' order (newest first): created_at, then trace id."""
    return (t.created_at, t.trace_id)


def _size(t: TraceView) -> int:
    return t.bytes


def _inside_session_dir(path: str, session: Session | None, session_id: str) -> bool:
    """Whether ``path`` (normalised; on the agent's node, so compared as text, not resolved
    here) lies inside the session's directory — or, for a session this coordinator does not
    know, inside a directory named by the session id. Plain string checks: this runs for
    every trace a fleet writes."""
    if not path.startswith("/"):
        return False
    if session is not None:
        prefix = _dir_prefix(session.save_dir)
        return prefix is not None and len(path) > len(prefix) and path.startswith(prefix)
    return bool(session_id) and session_id in path.split("/")[:-1]


@functools.lru_cache(maxsize=256)
def _dir_prefix(save_dir: str) -> str | None:
    """A session directory as the prefix its files' paths start with (``None``: not absolute);
    kept, since every trace of a session asks for it."""
    root = os.path.normpath(save_dir)
    if not root.startswith("/"):
        return None
    return root if root.endswith("/") else root + "/"
