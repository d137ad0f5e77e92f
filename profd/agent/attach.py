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
_FORK_HOOK = False


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker, a helper process) inherits the parent's agent
    but none of its threads: it is not the child's agent, and exiting must not wait on it
    (``close`` at exit waited 10 s and more for a reporter that does not exist). A child
    that attaches gets an agent of its own."""
    global _PROCESS_AGENT, _LOCK
    _PROCESS_AGENT = None
    _ROLE_AGENTS.clear()
    _LOCK = threading.Lock()  # another thread may have held it at the fork


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
    global _PROCESS_AGENT, _FORK_HOOK
    if not _FORK_HOOK:  # once, at the first attach (no import-time side effects)
        os.register_at_fork(after_in_child=_forget_in_child)
        _FORK_HOOK = True
    if rank is None:
        rank = _env_int("RANK", 0)
    if world_size is None:
        world_size = _env_int("WORLD_SIZE", None)
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


def _env_int(name: str, default: int | None) -> int | None:
    """An int >= 0 from the environment; anything else is named once and ``default`` used:
    the job runs, profd says what it assumed."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw.isascii() and raw.isdigit():
        return int(raw)
    log.warning("profd: %s=%r is not an int >= 0; profd uses %s", name, raw, default)
    return default


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
