"""The in-worker agent: marks, recording and the background link to the coordinator."""

from profd.agent.agent import ProfilerAgent
from profd.agent.attach import RoleAgent, attach, attached_agents

__all__ = ["ProfilerAgent", "RoleAgent", "attach", "attached_agents"]
