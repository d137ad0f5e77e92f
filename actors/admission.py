"""Admitting a session: conflicts, reachability, ids and directories (no Ray)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from profd.config import SessionRequest
from profd.errors import ConflictError, RequestInvalid
from profd.registry import AgentRegistry
from profd.sessions import Part, Session
from profd.settings import CoordinatorSettings
from profd.targeting import Target

__all__ = ["check_conflicts", "check_reachable", "new_session_id", "session_dir"]


def check_conflicts(
    live: Iterable[Session], registry: AgentRegistry, targets: Iterable[Target]
) -> None:
    """Refuse targets a live session holds — the same agent, or another agent in the same
    process (never two profilers on one device)."""
    held: dict[Any, tuple[str, Part]] = {}
    for s in live:
        for aid, part in s.targets.items():
            if part.state.is_terminal:
                continue
            held[aid] = (s.session_id, part)
            rec = registry.get(aid)
            if rec is not None:
                held[(rec.info.hostname, rec.info.pid)] = (s.session_id, part)
    clashes = []
    for t in targets:
        hit = held.get(t.agent.agent_id) or held.get((t.agent.hostname, t.agent.pid))
        if hit:
            clashes.append((t, hit))
    if clashes:
        desc = "; ".join(
            f"{t.agent.role} rank {t.agent.rank} is held by session {sid} "
            f"({p.role} rank {p.rank}, {p.state.value})"
            for t, (sid, p) in clashes
        )
        holders = sorted({sid for _, (sid, _) in clashes})
        raise ConflictError(f"targets busy: {desc}", holders=holders)


def check_reachable(
    steps: tuple[int, ...], registry: AgentRegistry, targets: Iterable[Target]
) -> None:
    """Refuse explicit steps that have all begun on every target (nothing could be recorded)."""
    current = []
    for t in targets:
        rec = registry.get(t.agent.agent_id)
        current.append(rec.current_step if rec else None)
    known = [c for c in current if c is not None]
    if known and len(known) == len(current) and min(known) >= steps[-1]:
        raise RequestInvalid.at(
            "steps",
            f"every requested step has already begun on every target (targets are at steps "
            f"{sorted(set(known))}); use next_steps or later steps",
        )


def new_session_id(now: float, taken: Iterable[str]) -> str:
    taken = set(taken)
    while True:
        sid = time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + "-" + secrets.token_hex(2)
        if sid not in taken:
            return sid


def session_dir(req: SessionRequest, settings: CoordinatorSettings, session_id: str) -> str:
    root = Path(req.save_path) if req.save_path else Path(settings.save_root)
    if not root.is_absolute():
        root = Path(settings.base_dir) / root
    return str(root / session_id)
