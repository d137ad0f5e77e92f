"""The sidecar's cache of session summaries (one per app, on ``app.state``)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

from profd.analysis.models import SessionSummary

__all__ = ["SummaryCache"]


class SummaryCache:
    """Summaries of finished sessions (their traces no longer change), the newest few, and
    the lock that lets one summary be computed at a time."""

    def __init__(self, size: int = 32) -> None:
        self._size = size
        self._items: OrderedDict[tuple[Any, ...], SessionSummary] = OrderedDict()
        self.lock = asyncio.Lock()  # bound to the app's loop on first use

    def get(self, key: tuple[Any, ...]) -> SessionSummary | None:
        if key in self._items:
            self._items.move_to_end(key)
        return self._items.get(key)

    def put(self, key: tuple[Any, ...], value: SessionSummary) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self._size:
            self._items.popitem(last=False)
