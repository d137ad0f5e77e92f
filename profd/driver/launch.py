"""Launch-time profiling: a session declared when the job starts, from the driver.

A verl user passes their config unchanged (``global_profiler`` + ``<role>.profiler``, as a
dict, an OmegaConf container or a YAML path); profd's own request layout works too::

    ray.init(...)
    profd.start_session(OmegaConf.to_container(config, resolve=True))
    # ... create workers (they call profd.attach) and train

The session waits for agents: each worker that registers and matches a role block joins it,
until the window's first step begins. When no coordinator runs yet (no ``profd up``), one is
started for this job and lives as long as the driver.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from profd.core.errors import RequestInvalid
from profd.core.ray_env import call_coordinator, find_coordinator, ray_context, ray_up
from profd.core.request import SessionRequest, field_errors
from profd.core.views import SessionView

__all__ = ["load_request", "resolve_interpolations", "start_session", "wait_session"]

_OWNED: list[Any] = []


def load_request(config: Mapping[str, Any] | SessionRequest | str | Path) -> SessionRequest:
    """A :class:`SessionRequest` from a verl or profd config (mapping, model or YAML path).

    Bad input raises :class:`~profd.core.errors.RequestInvalid` naming the field, before any
    session or coordinator exists."""
    from profd.driver.verl import looks_like_verl, request_from_verl

    if isinstance(config, SessionRequest):
        return config
    if isinstance(config, str | Path):
        path = Path(config)
        try:
            config = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:  # named by its file, not "<unicode string>"
            where = getattr(exc, "problem_mark", None)
            at = f" line {where.line + 1}, column {where.column + 1}" if where else ""
            problem = getattr(exc, "problem", None) or exc
            raise RequestInvalid.at("config", f"{path}{at}: {problem}") from None
    config = resolve_interpolations(config)
    if not isinstance(config, Mapping):
        raise RequestInvalid.at(
            "config", f"expected a mapping or a YAML path, got {type(config).__name__}"
        )
    if looks_like_verl(config):
        return request_from_verl(config)
    try:
        return SessionRequest.model_validate(dict(config))
    except ValidationError as exc:  # the same error type (and field paths) as the verl layout
        raise RequestInvalid.from_fields(field_errors(exc)) from None


def resolve_interpolations(config: Any) -> Any:
    """Resolve OmegaConf / Hydra interpolations (``${...}``) as verl does, when omegaconf is
    installed (it is wherever verl is); otherwise an unresolved one is an error naming it."""
    if not isinstance(config, Mapping) and not hasattr(config, "_get_node"):
        return config
    try:
        from omegaconf import OmegaConf
    except ImportError:
        found = _first_interpolation(config, "")
        if found:
            raise RequestInvalid.at(
                found,
                "holds an unresolved interpolation; resolve the config first "
                "(OmegaConf.to_container(cfg, resolve=True)) or install omegaconf",
            ) from None
        return config
    return OmegaConf.to_container(OmegaConf.create(config), resolve=True)


def _first_interpolation(node: Any, path: str) -> str | None:
    if isinstance(node, str) and "${" in node:
        return path or "config"
    if isinstance(node, Mapping):
        for k, v in node.items():
            hit = _first_interpolation(v, f"{path}.{k}" if path else str(k))
            if hit:
                return hit
    if isinstance(node, list):
        for i, v in enumerate(node):
            hit = _first_interpolation(v, f"{path}.{i}")
            if hit:
                return hit
    return None


def start_session(
    config: Mapping[str, Any] | SessionRequest | str | Path, *, timeout: float = 60.0
) -> SessionView:
    """Create a launch-time session (``wait_for_agents``) on this job's coordinator."""
    from profd.actors import get_or_create_coordinator
    from profd.core.settings import ProfdSettings

    request = load_request(config).model_copy(update={"wait_for_agents": True})
    SessionRequest.model_validate(request.model_dump())  # the copy must still be valid
    if not ray_up():
        raise RuntimeError("profd.start_session() needs Ray: call it after ray.init()")
    if request.job_id is None:  # this job's workers, never another job's on the cluster
        request = request.model_copy(update={"job_id": ray_context().job_id})
    handle = find_coordinator()
    if handle is None:
        # A coordinator owned by this job: it ends with the driver and persists nothing.
        settings = ProfdSettings().coordinator().model_copy(update={"state_dir": None})
        handle, _ = get_or_create_coordinator(settings, detached=False)
        _OWNED.append(handle)  # a non-detached actor lives only while referenced
    return call_coordinator(handle, "create_session", request, timeout=timeout)


def wait_session(session_id: str, timeout: float = 120.0, poll_s: float = 0.5) -> SessionView:
    """The session's view once it has ended (state, reason, traces), or as it stands when
    ``timeout`` runs out — for a driver that declared a session with :func:`start_session`."""
    import time

    handle = find_coordinator()
    if handle is None:
        raise RuntimeError("profd.wait_session(): no profd coordinator in this Ray cluster")
    deadline = time.monotonic() + timeout
    while True:
        view = call_coordinator(handle, "get_session", session_id, timeout=60)
        if view.state.is_terminal or time.monotonic() > deadline:
            return view
        time.sleep(poll_s)
