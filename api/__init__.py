"""The HTTP sidecar (installed as ``profd.api``)."""

from profd.api.app import create_app

__all__ = ["create_app"]
