"""Stacks of a live or hung job (``GET /api/v1/stacks``, ``profd stacks``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from profd.core.protocol import StackSample

if TYPE_CHECKING:
    from profd.actors.planbook import PlanBook
    from profd.actors.registry import AgentRegistry
    from profd.core.settings import CoordinatorSettings

__all__ = ["StackDesk"]

log = logging.getLogger(__name__)


class StackDesk:
    def __init__(
        self,
        registry: AgentRegistry,
        plans: PlanBook,
        runner: Any,
        settings: CoordinatorSettings,
        clock: Callable[[], float],
    ) -> None:
        self._registry = registry
        self._plans = plans
        self._runner = runner
        self._settings = settings
        self._clock = clock

    def on_sample(self, agent_id: str, sample: StackSample) -> None:
        pass
