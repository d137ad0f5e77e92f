"""Views encoded to JSON where they are built, for the sidecar's read routes.

A read route's answer is the coordinator's view as JSON. Sent as pydantic objects, a page
of sessions is pickled by the coordinator, unpickled model by model by the sidecar and
dumped again to JSON: under a hundred polling clients that was most of the sidecar's time.
The coordinator encodes once (pydantic's serializer, in Rust) and the sidecar passes the
bytes through (:func:`profd.api.responses.json_listing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel

from profd.core.paging import Page

__all__ = ["BATCHED_READS", "JSON_READS", "JsonItems", "encode_items", "encode_read"]

#: The coordinator reads :func:`encode_read` answers (each a view, a list or a page of them).
JSON_READS = frozenset({"get_session", "list_sessions", "list_traces", "list_agents", "status"})
#: The coordinator's calls the sidecar may send several of at once (``read_many``): reads.
BATCHED_READS = frozenset({"read_json", "ping", "metrics"})


@dataclass(frozen=True, slots=True)
class JsonItems:
    """A listing: ``items`` is the JSON array of its views; a page's fields beside it."""

    items: bytes
    count: int
    total: int
    next_cursor: str | None = None
    bytes: int = 0


def encode_items(models: Sequence[BaseModel]) -> bytes:
    """A JSON array of ``models``, each dumped as its own ``model_dump_json`` would."""
    return b"[" + b",".join(m.__pydantic_serializer__.to_json(m) for m in models) + b"]"


def encode_read(answer: BaseModel | list[BaseModel] | Page) -> bytes | JsonItems:
    """One read's answer, encoded: a view as its JSON, a list or page as :class:`JsonItems`."""
    if isinstance(answer, Page):
        return JsonItems(
            encode_items(answer.items),
            len(answer.items),
            answer.total,
            answer.next_cursor,
            answer.bytes,
        )
    if isinstance(answer, list):
        return JsonItems(encode_items(answer), len(answer), len(answer))
    return answer.__pydantic_serializer__.to_json(answer)
