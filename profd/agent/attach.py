"""``profd.attach``: one agent per worker process, shared by the roles the process hosts.

A process that hosts several roles (verl's colocated actor / rollout / ref worker) gets one
agent and one collection per window, named by the combined role in attach order
(``actor`` then ``ref`` → ``actor_ref``). Once a process hosts several roles every stage
label is prefixed with the role that marked it — the first role's through the agent itself,
each later role's through its :class:`RoleAgent` (``ref`` + ``compute_log_prob`` →
``ref_compute_log_prob``) — so a trace says which role ran what. Attaching a single combined
role (``role="actor_rollout_ref"``) works the same way without prefixes.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

from profd.agent.agent import ProfilerAgent
from profd.core.protocol import AgentPlan

__all__ = ["RoleAgent", "attach", "attached_agents"]

log = logging.getLogger(__name__)

_PROCESS_AGENT: ProfilerAgent | None = None
_ROLE_AGENTS: dict[str, RoleAgent] = {}
_LOCK = threading.Lock()


class RoleAgent:
    """The marks of one extra role in a process whose agent is shared."""

    def __init__(self, agent: ProfilerAgent, role: str) -> None:
        self._agent = agent
        self.role = role

    def step(self, step: int) -> AbstractContextManager[None]:
        return self._agent.step(step)

    def stage(
        self, name: str, *, role: str | None = None, update_loop: bool = False
    ) -> AbstractContextManager[Any]:
        return self._agent.stage(name, role=role or self.role, update_loop=update_loop)

    def mini_batch(self, index: int) -> AbstractContextManager[Any]:
        return self._agent.mini_batch(index)

    def micro_batch(self, index: int) -> AbstractContextManager[Any]:
        return self._agent.micro_batch(index)

    def close(self, timeout: float = 60.0) -> bool:
        return self._agent.close(timeout)

    @property
    def agent_id(self) -> str:
        return self._agent.agent_id

    @property
    def current_step(self) -> int | None:
        return self._agent.current_step

    @property
    def plan(self) -> AgentPlan:
        return self._agent.plan

    @property
    def connected(self) -> bool:
        return self._agent.connected

    @property
    def recording(self) -> bool:
        return self._agent.recording


def attach(
    role: str,
    rank: int | None = None,
    world_size: int | None = None,
    topology: Mapping[str, int] | None = None,
    **kwargs: Any,
) -> ProfilerAgent | RoleAgent:
    """Attach this worker process (or one more of its roles) to profd and start the agent.

    ``rank`` / ``world_size`` default to the ``RANK`` / ``WORLD_SIZE`` environment variables
    (as set by torchrun and Ray Train), else 0 / unknown. All roles of a process share its
    rank; attaching another role with a different rank is an error.
    """
    global _PROCESS_AGENT
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if world_size is None and os.environ.get("WORLD_SIZE"):
        world_size = int(os.environ["WORLD_SIZE"])
    with _LOCK:
        agent = _PROCESS_AGENT
        if agent is None or agent._closed:
            agent = ProfilerAgent(role, rank, world_size, topology, **kwargs)
            _PROCESS_AGENT = agent
            _ROLE_AGENTS.clear()
        elif rank != agent.info.rank:
            raise ValueError(
                f"rank: this process is already attached as {agent.info.role} rank "
                f"{agent.info.rank}; the roles of one process share its rank (got {rank})"
            )
        elif role == agent.roles[0]:
            return agent
        else:
            if role not in _ROLE_AGENTS:
                agent.add_role(role)
                _ROLE_AGENTS[role] = RoleAgent(agent, role)
            return _ROLE_AGENTS[role]
    return agent.start()


def attached_agents() -> list[ProfilerAgent]:
    with _LOCK:
        return [_PROCESS_AGENT] if _PROCESS_AGENT is not None else []


@atexit.register
def _close_at_exit() -> None:
    for agent in attached_agents():
        try:
            agent.close(timeout=30.0)
        except Exception:  # never-break-training boundary: the process exits regardless
            log.warning("profd: closing agent %s at exit failed", agent.agent_id, exc_info=True)
