"""Fixed names every process on a cluster agrees on (no discovery service needed)."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = [
    "COORDINATOR_NAME",
    "DEFAULT_PORT",
    "DEFAULT_SAVE_SUBDIR",
    "NAMESPACE",
    "SIDECAR_NAME",
    "STATE_FILE",
    "TOKEN_FILE",
    "__version__",
]

#: Ray namespace holding profd's named actors.
NAMESPACE = "profd"
#: Name of the detached coordinator actor (one per cluster).
COORDINATOR_NAME = "profd_coordinator"
#: Name of the detached sidecar actor serving HTTP on the head node.
SIDECAR_NAME = "profd_sidecar"
#: Default sidecar port on 127.0.0.1.
DEFAULT_PORT = 8470
#: Default save root, relative to the directory where `profd up` / `profd demo` ran.
DEFAULT_SAVE_SUBDIR = "outputs/profile"
#: Files in the per-user state directory.
STATE_FILE = "sidecar.json"
TOKEN_FILE = "token"
