"""How a relay calls the coordinator: a :class:`CoordinatorCaller` (tests give their own),
and the real one over Ray, :class:`RayCoordinatorCaller`."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from profd.core.protocol import Packed

__all__ = ["CoordinatorCaller", "RayCoordinatorCaller"]


class CoordinatorCaller(Protocol):
    """Awaitable calls to the coordinator; raises ``ConnectionError`` when it is unreachable."""

    async def call(self, method: str, *args: Any, timeout: float, **kw: Any) -> Any: ...


class RayCoordinatorCaller:
    """The coordinator by its name, found again after any failure (it may have restarted)."""

    def __init__(self) -> None:
        self._handle: Any = None

    async def call(self, method: str, *args: Any, timeout: float, **kw: Any) -> Any:
        from profd.core.ray_env import find_coordinator

        if self._handle is None:
            self._handle = find_coordinator()
            if self._handle is None:
                raise ConnectionError("no coordinator")
        try:  # plain data as one C pickle (a node's event batch: Packed's docstring says why)
            packed = [Packed(a) if isinstance(a, (dict, list)) else a for a in args]
            ref = getattr(self._handle, method).remote(*packed, **kw)
            return await asyncio.wait_for(ref, timeout)
        except TimeoutError as exc:
            # Slow, not gone: keep the handle. Finding it again is a blocking GCS lookup on
            # this event loop, and a busy coordinator would make every relay do one.
            raise ConnectionError(f"{method}: no answer within {timeout:.0f} s") from exc
        except Exception as exc:  # Ray errors: the coordinator is not there now
            self._handle = None
            raise ConnectionError(f"{method}: {type(exc).__name__}: {exc}") from exc
