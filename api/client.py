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
from profd.core.json_body import BATCHED_READS, encode_read
from profd.core.ray_env import acall_coordinator, find_coordinator

__all__ = [
    "BatchedReads",
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


async def _answer(call: Any) -> Any:
    try:
        return await call
    except Exception as exc:
        return exc


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
        if method == "read_many" and not hasattr(handle, "read_many"):
            return list(await asyncio.gather(*(_answer(self.call(m, *a)) for m, a in args[0])))
        try:
            return await acall_coordinator(handle, method, *args)
        except CoordinatorUnavailable:
            self._handle = None  # found again by name on the next call
            raise


class BatchedReads:
    """Reads (:data:`~profd.core.json_body.BATCHED_READS`) go to the coordinator at most
    ``in_flight`` calls at a time; those asked meanwhile wait and go together in the next
    call (``read_many``, up to ``max_batch``). Each call to a Ray actor costs both sides a
    millisecond or more of CPU whatever it carries: under a hundred dashboards, that was
    most of the sidecar's and the coordinator's time. One read alone goes as itself (no
    added wait); a batch's answers and errors come back read by read, and a batch that
    fails as a whole (the coordinator gone) fails each of its reads. Other calls pass
    straight through, in the order they are made."""

    def __init__(self, inner: Any, in_flight: int = 2, max_batch: int = 64) -> None:
        self.inner = inner
        self._in_flight = in_flight
        self._max_batch = max_batch
        self._sending = 0
        self._waiting: list[tuple[str, tuple[Any, ...], asyncio.Future[Any]]] = []
        self._tasks: set[asyncio.Task[None]] = set()  # held: the loop keeps weak references
        #: Batches sent and reads they carried (tests, and a look at how much was saved).
        self.batches = 0
        self.batched_reads = 0

    async def call(self, method: str, *args: Any) -> Any:
        if method not in BATCHED_READS:
            return await self.inner.call(method, *args)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.append((method, args, fut))
        self._send_some()
        return await fut

    def _send_some(self) -> None:
        while self._waiting and self._sending < self._in_flight:
            batch = self._waiting[: self._max_batch]
            del self._waiting[: self._max_batch]
            self._sending += 1
            task = asyncio.ensure_future(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[tuple[str, tuple[Any, ...], asyncio.Future[Any]]]) -> None:
        try:
            answers = await self._answers(batch)
            for (_, _, fut), answer in zip(batch, answers, strict=False):
                if fut.done():  # its request was cancelled (the client went away)
                    continue
                if isinstance(answer, BaseException):
                    fut.set_exception(answer)
                else:
                    fut.set_result(answer)
        finally:
            for _, _, fut in batch:  # never left waiting, whatever happened above
                if not fut.done():
                    fut.set_exception(CoordinatorUnavailable("the read was not answered"))
            self._sending -= 1
            self._send_some()

    async def _answers(self, batch: list[tuple[str, tuple[Any, ...], Any]]) -> list[Any]:
        """One answer or error per read of ``batch``, in order."""
        if len(batch) == 1:
            method, args, _ = batch[0]
            try:
                return [await self.inner.call(method, *args)]
            except Exception as exc:
                return [exc]
        self.batches += 1
        self.batched_reads += len(batch)
        try:
            answers = await self.inner.call("read_many", [(m, a) for m, a, _ in batch])
        except Exception as exc:
            return [exc] * len(batch)
        if not isinstance(answers, list) or len(answers) != len(batch):
            wrong = CoordinatorUnavailable(f"read_many: {len(batch)} reads, a wrong answer")
            return [wrong] * len(batch)
        return answers


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
            "ping",
        }
    )
    #: Reads shared only while in flight, never answered from a finished call: /healthz
    #: probes polling together make one ping, and a coordinator that just died is not
    #: reported up (``profd up`` asks it before starting one).
    IN_FLIGHT_ONLY = frozenset({"ping"})
    #: Calls that change what the reads return (others, like get_trace, do not).
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
            if method in self.IN_FLIGHT_ONLY:
                held[1].add_done_callback(lambda _f, k=key, h=held: self._forget(k, h))
        try:
            return await asyncio.shield(held[1])
        except Exception:
            self._forget(key, held)
            raise

    def _forget(self, key: tuple[Any, ...], held: tuple[float, asyncio.Future[Any]]) -> None:
        if self._held.get(key) is held:
            del self._held[key]
