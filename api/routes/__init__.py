"""One router per resource."""

from profd.api.routes import agents, dashboard, sessions, stacks, status, traces

__all__ = ["agents", "dashboard", "sessions", "stacks", "status", "traces"]
