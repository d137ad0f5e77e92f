"""The backend interface: open a collection on the training thread, write files elsewhere.

A backend turns one window into files. :meth:`Backend.open` starts recording and must be
cheap; :meth:`Collection.close` stops recording on the training thread and returns a
:class:`PendingOutput` whose :meth:`~PendingOutput.write` does the slow part (export,
compression) on the agent's exporter thread.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from profd.core.request import ToolKind

__all__ = [
    "NULL_RANGE",
    "Backend",
    "Collection",
    "CollectionSpec",
    "NoopBackend",
    "PendingOutput",
    "WrittenFile",
]

#: Reused for every mark while nothing records: no allocation on the training thread.
NULL_RANGE: AbstractContextManager[None] = contextlib.nullcontext()


@dataclass(frozen=True, slots=True)
class CollectionSpec:
    """Everything a backend needs to open one collection."""

    save_dir: Path
    #: File stem without suffix or extension (see :mod:`profd.core.naming`).
    stem: str
    #: Written inside the trace: ``distributedInfo`` and profd's own keys.
    metadata: Mapping[str, Any]
    #: Mini-batch schedule (already resolved for the mode), or ``None`` for whole windows.
    schedule: Mapping[str, int] | None = None
    #: Name saved windows by their mini-batches (discrete update stages).
    name_mini_batches: bool = False
    #: Native id of the job's training thread (the one that attached), when known: a
    #: sampling tool says when that thread got no sample.
    thread_id: int | None = None


@dataclass(frozen=True, slots=True)
class WrittenFile:
    path: Path
    bytes: int
    #: Suffix used in the name (``""``, ``_mb3-4``, ``_part1``).
    suffix: str = ""
    #: Things the user should know about this file (reported in the session).
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class HeldSteps:
    """What a window's file holds of the loop's steps, known only once the window ended. A
    backend whose files carry profd's header writes it there."""

    #: The steps it holds whole (``profd.steps``): not one the window ended inside.
    whole: tuple[int, ...] = ()
    #: The step the window began inside, whose rest it holds (``profd.began_in_step``).
    began_in: int | None = None


class PendingOutput(ABC):
    """A stopped collection whose files are not yet written."""

    @abstractmethod
    def write(self, held: HeldSteps | None = None) -> list[WrittenFile]:
        """Write the files (runs off the training thread); raise on failure. ``held``: what
        they hold of the loop's steps (``None``: not counted, as in a timed window of a
        worker without a recorder's steps)."""


class Collection(ABC):
    """An open recording. Methods run on the training thread and must stay cheap."""

    #: Seconds :meth:`Backend.open` waited for an earlier window's export to finish first
    #: (torch: Kineto's export must not overlap a profiler start); part of the export stall.
    export_wait_s: float = 0.0

    def annotate(self, label: str) -> AbstractContextManager[Any]:
        """A named range inside the recording."""
        return NULL_RANGE

    def step(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Advance the mini-batch schedule (no-op for backends without one)."""

    def take_ready(self) -> list[PendingOutput]:
        """Windows the backend finished while the collection stays open (schedules)."""
        return []

    @abstractmethod
    def close(self) -> list[PendingOutput]:
        """Stop recording and hand over what is left to write."""


class Backend(ABC):
    kind: ClassVar[ToolKind]
    #: Can be started and stopped from any thread (timed windows then run without waiting
    #: for the training thread, so even a stalled loop can be profiled).
    thread_free: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def unavailable_reason(cls) -> str | None:
        """``None`` when this backend can run in this process, else why it cannot."""

    @property
    def schedule(self) -> Mapping[str, int] | None:
        """The configured mini-batch schedule, if the backend has one."""
        return None

    @abstractmethod
    def open(self, spec: CollectionSpec) -> Collection:
        """Start recording."""


class _NoopOutput(PendingOutput):
    def write(self, held: HeldSteps | None = None) -> list[WrittenFile]:
        return []


class _NoopCollection(Collection):
    def close(self) -> list[PendingOutput]:
        return [_NoopOutput()]


class NoopBackend(Backend):
    """Records nothing and writes nothing. Used where the agent logic is tested without a
    profiler; never chosen for a user's session (tools are a validated enum)."""

    kind = ToolKind.TORCH

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    def open(self, spec: CollectionSpec) -> Collection:
        return _NoopCollection()
