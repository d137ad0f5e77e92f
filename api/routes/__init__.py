"""One router per resource."""

from profd.api.routes import agents, sessions, status, traces

__all__ = ["agents", "sessions", "status", "traces"]
