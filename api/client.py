"""How the sidecar talks to the coordinator: one small async interface, two implementations.

:class:`RayCoordinatorClient` calls the named Ray actor; :class:`LocalCoordinatorClient`
calls a :class:`~profd.actors.coordinator.ProfileCoordinator` in the same process (tests swap
it in with ``app.dependency_overrides``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

from profd.core.errors import CoordinatorUnavailable
from profd.core.json_body import encode_read
from profd.core.ray_env import acall_coordinator, find_coordinator

__all__ = [
    "CoordinatorClient",
    "LocalCoordinatorClient",
    "RayCoordinatorClient",
    "SharedReads",
]


class CoordinatorClient(Protocol):
    async def call(self, method: str, *args: Any) -> Any: ...


class LocalCoordinatorClient:
    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.coordinator, method)(*args)


class RayCoordinatorClient:
    """Finds the coordinator by name on first use and again after it went away."""

    def __init__(self, lookup: Callable[[], Any | None] = find_coordinator) -> None:
        self._lookup = lookup
        self._handle: Any | None = None

    async def call(self, method: str, *args: Any) -> Any:
        handle = self._handle or self._lookup()
        if handle is None:
            raise CoordinatorUnavailable(
                "the profd coordinator is not running; start it with `profd up`"
            )
        self._handle = handle
        if method == "read_json" and not hasattr(handle, "read_json"):
            # a coordinator of an older profd, still running after an upgrade: encode here
            return encode_read(await self.call(*args))
        try:
            return await acall_coordinator(handle, method, *args)
        except CoordinatorUnavailable:
            self._handle = None  # found again by name on the next call
            raise


class SharedReads:
    """A client whose reads are shared for ``ttl_s``: concurrent and closely following
    requests for the same read make one coordinator call (a hundred polling clients, a few
    calls a second). Any other call — a change — clears what is held, so a client that made
    a change reads it back at once. Failed reads are never kept."""

    READS = frozenset(
        {
            "status",
            "list_agents",
            "list_sessions",
            "list_traces",
            "get_session",
            "metrics",
            "read_json",
        }
    )
    #: Calls that change what the reads return (others, like ping or get_trace, do not).
    CHANGES = frozenset({"create_session", "cancel_session"})
    _MAX_ENTRIES = 256

    def __init__(
        self,
        inner: CoordinatorClient,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = inner
        self.ttl_s = ttl_s
        self._clock = clock
        self._held: dict[tuple[Any, ...], tuple[float, asyncio.Future[Any]]] = {}

    async def call(self, method: str, *args: Any) -> Any:
        if method not in self.READS or self.ttl_s <= 0:
            try:
                return await self.inner.call(method, *args)
            finally:
                if method in self.CHANGES:
                    self._held.clear()
        key = (method, *args)
        now = self._clock()
        held = self._held.get(key)
        if held is None or now - held[0] >= self.ttl_s:
            if len(self._held) >= self._MAX_ENTRIES:
                self._held = {k: v for k, v in self._held.items() if now - v[0] < self.ttl_s}
            held = (now, asyncio.ensure_future(self.inner.call(method, *args)))
            self._held[key] = held
        try:
            return await asyncio.shield(held[1])
        except Exception:
            if self._held.get(key) is held:
                del self._held[key]
            raise
