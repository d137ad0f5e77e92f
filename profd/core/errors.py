"""Typed errors shared by the coordinator, the HTTP API and the CLI.

Each carries the HTTP status it maps to, a machine-readable code, a message and, for bad
input, the dotted fields at fault. They subclass ``ValueError`` (bad input) or ``LookupError``
(unknown ids) so Python callers can catch them without importing profd's types.
"""

from __future__ import annotations

from typing import Any

from profd.core.request import FieldError

__all__ = [
    "ConflictError",
    "CoordinatorUnavailable",
    "NotFoundError",
    "ProfdError",
    "RequestInvalid",
]


class ProfdError(Exception):
    status_code = 400
    code = "error"

    def __init__(self, message: str, fields: list[FieldError] | None = None, **extra: Any):
        super().__init__(message)
        self.message = message
        self.fields = list(fields or [])
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {
            "error": self.code,
            "message": self.message,
            "fields": [f.model_dump() for f in self.fields],
            **({"detail": self.extra} if self.extra else {}),
        }

    def __reduce__(self):  # keep fields and extras across Ray's pickling
        return (_rebuild, (type(self), self.message, self.fields, self.extra))


def _rebuild(cls: type[ProfdError], message: str, fields: list[FieldError], extra: dict) -> Any:
    return cls(message, fields, **extra)


class RequestInvalid(ProfdError, ValueError):
    status_code = 422
    code = "invalid_request"

    @classmethod
    def from_fields(cls, fields: list[FieldError]) -> RequestInvalid:
        msg = "; ".join(f"{f.field or 'body'}: {f.message}" for f in fields) or "invalid request"
        return cls(msg, fields)

    @classmethod
    def at(cls, field: str, message: str, **extra: Any) -> RequestInvalid:
        return cls(f"{field}: {message}", [FieldError(field=field, message=message)], **extra)


class ConflictError(ProfdError, ValueError):
    status_code = 409
    code = "conflict"


class NotFoundError(ProfdError, LookupError):
    status_code = 404
    code = "not_found"


class CoordinatorUnavailable(ProfdError):
    """The coordinator is not running, or did not answer (dead, restarting, Ray gone)."""

    status_code = 503
    code = "coordinator_unavailable"
