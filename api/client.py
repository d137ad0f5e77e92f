"""How the sidecar talks to the coordinator: one small async interface, two implementations.

:class:`RayCoordinatorClient` calls the named Ray actor; :class:`LocalCoordinatorClient`
calls a :class:`~profd.actors.coordinator.ProfileCoordinator` in the same process (tests swap
it in with ``app.dependency_overrides``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from profd.errors import ProfdError

__all__ = [
    "CoordinatorClient",
    "CoordinatorUnavailable",
    "LocalCoordinatorClient",
    "RayCoordinatorClient",
]


class CoordinatorUnavailable(ProfdError):
    status_code = 503
    code = "coordinator_unavailable"


class CoordinatorClient(Protocol):
    async def call(self, method: str, *args: Any) -> Any: ...


class LocalCoordinatorClient:
    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.coordinator, method)(*args)


class RayCoordinatorClient:
    """Finds the coordinator by name on first use and again after it went away."""

    def __init__(self, lookup: Callable[[], Any | None] | None = None) -> None:
        if lookup is None:
            from profd.actors import get_coordinator

            lookup = get_coordinator
        self._lookup = lookup
        self._handle: Any | None = None

    async def call(self, method: str, *args: Any) -> Any:
        from ray.exceptions import RayActorError, RayTaskError

        handle = self._handle or self._lookup()
        if handle is None:
            raise CoordinatorUnavailable(
                "the profd coordinator is not running; start it with `profd up`"
            )
        self._handle = handle
        try:
            return await getattr(handle, method).remote(*args)
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ProfdError):
                raise cause from None
            raise
        except RayActorError as exc:
            self._handle = None
            raise CoordinatorUnavailable(f"the profd coordinator is unreachable: {exc}") from None
