"""Cursor paging of the newest-first listings (sessions, traces). Pure: no Ray, no FastAPI.

A listing is ordered by a sort key ``(created_at, id)``, descending. A cursor is the key of
the last item a page held, wrapped in an opaque string; the next page holds the items whose
key sorts after it. Items created meanwhile are newer, so they sort before the cursor and
never shift or repeat the pages that follow (an offset would).
"""

from __future__ import annotations

import base64
import binascii
import bisect
import heapq
import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from sortedcontainers import SortedKeyList

from profd.core.errors import RequestInvalid

__all__ = [
    "DEFAULT_LIMIT",
    "MAX_LIMIT",
    "Listing",
    "Page",
    "SortKey",
    "decode_cursor",
    "encode_cursor",
    "page_of",
]

T = TypeVar("T")
SortKey = tuple[float, str]

#: Items per page when the caller names none, and the most one HTTP page holds.
DEFAULT_LIMIT = 50
MAX_LIMIT = 500
#: A cursor is short; anything much longer is not one of ours.
MAX_CURSOR_CHARS = 512


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a listing: its items, the cursor of the next page (None on the last) and
    how many items match in all pages; ``bytes`` is the size of every matching trace (trace
    listings only, 0 otherwise)."""

    items: list[T]
    next_cursor: str | None
    total: int
    bytes: int = field(default=0)


def encode_cursor(kind: str, key: SortKey) -> str:
    """An opaque, URL-safe cursor for the item with sort key ``key`` of listing ``kind``."""
    raw = json.dumps([kind, key[0], key[1]], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(kind: str, cursor: str) -> SortKey:
    """The sort key in ``cursor``; :class:`RequestInvalid` naming ``cursor`` if it is not a
    cursor of listing ``kind``."""
    bad = RequestInvalid.at(
        "cursor", f"not a cursor of the {kind} listing: pass the next_cursor of a previous page"
    )
    if not isinstance(cursor, str) or not cursor or len(cursor) > MAX_CURSOR_CHARS:
        raise bad
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        value = json.loads(raw)
    except (binascii.Error, ValueError):
        raise bad from None
    if not (isinstance(value, list) and len(value) == 3 and value[0] == kind):
        raise bad
    _, created, ident = value
    if isinstance(created, bool) or not isinstance(created, int | float):
        raise bad
    if not math.isfinite(created) or not isinstance(ident, str):
        raise bad
    return float(created), ident


def check_limit(limit: object) -> int:
    """``limit`` as a positive int; :class:`RequestInvalid` naming ``limit`` otherwise."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise RequestInvalid.at("limit", f"must be an integer >= 1, got {limit!r}")
    return limit


def page_of(
    items: Iterable[T],
    key: Callable[[T], SortKey],
    kind: str,
    limit: int | None = None,
    cursor: str | None = None,
) -> tuple[list[T], str | None, int]:
    """The page of ``items`` (newest first by ``key``) after ``cursor``: the page's items,
    the next page's cursor (None when nothing follows) and how many items there are in all.

    Costs one pass plus a heap of ``limit`` items, not a sort of everything."""
    size = DEFAULT_LIMIT if limit is None else check_limit(limit)
    after = decode_cursor(kind, cursor) if cursor is not None else None
    pool = list(items)
    total = len(pool)
    if after is not None:
        pool = [x for x in pool if key(x) < after]
    chosen = heapq.nlargest(size + 1, pool, key=key)
    more = len(chosen) > size
    chosen = chosen[:size]
    next_cursor = encode_cursor(kind, key(chosen[-1])) if more else None
    return chosen, next_cursor, total


#: A listing holds its items in one flat list up to this many (see :class:`Listing`).
FLAT_MAX = 1000


class Listing(Generic[T]):
    """Items kept in key order as they are added, with their count and summed ``size``: the
    pages :func:`page_of` gives, found by bisection instead of a pass over every item (a
    store of thousands of past sessions and their traces is paged by every dashboard).
    Keys must be unique; items are added, never changed or removed.

    Up to ``flat_max`` items live in one flat list; past it, in a sorted list of sublists
    (``sortedcontainers``): a fleet's window end indexes tens of thousands of traces whose
    creation times interleave, and an insert into one flat list moves every newer item,
    while a small listing (one rank's traces) is cheaper flat, in time and memory."""

    def __init__(
        self,
        key: Callable[[T], SortKey],
        size: Callable[[T], int] | None = None,
        flat_max: int = FLAT_MAX,
    ):
        self._key = key
        self._size = size
        self._flat_max = flat_max
        self._keys: list[SortKey] = []  # while flat
        self._items: list[T] = []
        self._sorted: SortedKeyList | None = None  # once past flat_max
        self.bytes = 0  # the sum of every item's ``size``

    def add(self, item: T) -> None:
        if self._size is not None:
            self.bytes += self._size(item)
        if self._sorted is not None:
            self._sorted.add(item)
            return
        k = self._key(item)
        if not self._keys or k > self._keys[-1]:  # the usual case: the newest
            self._keys.append(k)
            self._items.append(item)
        else:
            i = bisect.bisect_left(self._keys, k)
            self._keys.insert(i, k)
            self._items.insert(i, item)
        if len(self._items) > self._flat_max:
            self._sorted = SortedKeyList(self._items, key=self._key)
            self._keys, self._items = [], []

    def extend(self, items: list[T]) -> None:
        """Add many items at once (any order): one sort and one merge instead of an insert
        each, for callers that take items in bursts and list them when first read."""
        if self._size is not None:
            self.bytes += sum(map(self._size, items))
        if self._sorted is not None:
            self._sorted.update(items)
            return
        keyed = sorted(zip(map(self._key, items), items, strict=True), key=_first)
        if self._keys and keyed and keyed[0][0] <= self._keys[-1]:
            keyed = list(heapq.merge(zip(self._keys, self._items, strict=True), keyed, key=_first))
            self._keys, self._items = [], []
        self._keys += [k for k, _ in keyed]
        self._items += [item for _, item in keyed]
        if len(self._items) > self._flat_max:
            self._sorted = SortedKeyList(self._items, key=self._key)
            self._keys, self._items = [], []

    def __len__(self) -> int:
        return len(self._sorted) if self._sorted is not None else len(self._items)

    def __iter__(self) -> Iterator[T]:
        """Oldest first."""
        return iter(self._sorted if self._sorted is not None else self._items)

    def page(
        self, kind: str, limit: int | None = None, cursor: str | None = None
    ) -> tuple[list[T], str | None, int]:
        """What :func:`page_of` returns for these items."""
        size = DEFAULT_LIMIT if limit is None else check_limit(limit)
        after = decode_cursor(kind, cursor) if cursor is not None else None
        total = len(self)
        if self._sorted is not None:
            end = total if after is None else self._sorted.bisect_key_left(after)
            start = max(0, end - size)
            chosen = list(self._sorted.islice(start, end, reverse=True))
            first = self._key(self._sorted[start]) if start > 0 else None
        else:
            end = total if after is None else bisect.bisect_left(self._keys, after)
            start = max(0, end - size)
            chosen = self._items[start:end][::-1]
            first = self._keys[start] if start > 0 else None
        next_cursor = encode_cursor(kind, first) if first is not None else None
        return chosen, next_cursor, total


def _first(pair: tuple[Any, Any]) -> Any:
    return pair[0]
