"""One router per resource."""

from profd.api.routes import agents, dashboard, sessions, status, traces

__all__ = ["agents", "dashboard", "sessions", "status", "traces"]
