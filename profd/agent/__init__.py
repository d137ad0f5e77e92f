"""The in-worker agent: marks, recording and the background link to the coordinator."""

from profd.agent.agent import ProfilerAgent, attach, attached_agents

__all__ = ["ProfilerAgent", "attach", "attached_agents"]
