"""Admitting a session: conflicts, reachability, ids and directories (no Ray)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from profd.actors.registry import AgentRecord, AgentRegistry
from profd.actors.sessions import Part, Session
from profd.actors.targeting import Target
from profd.core.errors import ConflictError, RequestInvalid
from profd.core.protocol import AgentInfo
from profd.core.request import SessionRequest
from profd.core.settings import CoordinatorSettings

__all__ = ["check_conflicts", "check_reachable", "new_session_id", "session_dir"]


def _is_replica(info: AgentInfo) -> bool:
    return "replica_world_size" in info.topology


def _domains(info: AgentInfo) -> set[tuple[Any, ...]]:
    """What an agent's profiler occupies while it records: the agent itself, and

    * a training agent: its process (torch allows one profiler per process; colocated roles
      share it) and its rank's device;
    * a rollout replica: its engine (the replica's own processes — not the process hosting
      the replica's agent, which may host other replicas); a *colocated* replica also
      occupies the devices of its global ranks, which the training ranks of those numbers
      use too (a hybrid engine runs inside the training workers).
    """
    out: set[tuple[Any, ...]] = {("agent", info.agent_id)}
    if not _is_replica(info):
        return out | {("process", info.hostname, info.pid), ("device", info.rank)}
    out.add(("engine", info.agent_id))
    if info.topology.get("colocated"):
        start, stop = info.topology["global_rank_start"], info.topology["global_rank_stop"]
        out.update(("device", g) for g in range(start, stop))
    return out


def _conflict(domain: tuple[Any, ...], a: AgentInfo, b: AgentInfo) -> bool:
    """Whether ``a`` and ``b`` sharing ``domain`` means two profilers at once. An agent, a
    process or an engine always; a device only with a colocated replica on one side (actor
    rank 0 and critic rank 0 are different workers, not one device)."""
    return domain[0] != "device" or _is_replica(a) or _is_replica(b)


def check_conflicts(
    live: Iterable[Session],
    registry: AgentRegistry,
    targets: Iterable[Target],
    *,
    timed: bool = False,
) -> None:
    """Refuse targets that would share a process or device with a part another live session
    holds (never two profilers on one device; reference §11). A timed session (``timed``)
    has no controller to order a colocated replica before training, so inside it the two
    clash as well."""
    # Indexed by domain: a 10,000-agent session is checked in linear time.
    held: dict[tuple[Any, ...], list[tuple[str | None, Part | Target, AgentInfo]]] = {}
    for s in live:
        for aid, part in s.targets.items():
            rec = registry.get(aid)
            if not part.state.is_terminal and rec is not None:
                for d in _domains(rec.info):
                    held.setdefault(d, []).append((s.session_id, part, rec.info))
    targets = list(targets)
    if timed:  # within the request only shared devices can clash
        for t in targets:
            for d in _domains(t.agent):
                if d[0] == "device":
                    held.setdefault(d, []).append((None, t, t.agent))
    clashes: dict[tuple[str, str], tuple[Target, str, str | None]] = {}
    for t in targets:
        for d in _domains(t.agent):
            for sid, holder, info in held.get(d, ()):
                if sid is None and info.agent_id == t.agent.agent_id:
                    continue  # itself, in this request
                if not _conflict(d, t.agent, info):
                    continue
                what = (
                    f"session {sid} ({holder.role} rank {holder.rank}, {holder.state.value})"
                    if sid is not None
                    else f"this timed request ({info.role} rank {info.rank} shares its devices)"
                )
                clashes.setdefault((t.agent.agent_id, info.agent_id), (t, what, sid))
    if clashes:
        found = clashes.values()
        desc = "; ".join(f"{t.agent.role} rank {t.agent.rank} is held by {w}" for t, w, _ in found)
        holders = sorted({sid for _, _, sid in found if sid is not None})
        raise ConflictError(f"targets busy: {desc}", holders=holders)


def check_reachable(
    steps: tuple[int, ...],
    registry: AgentRegistry,
    targets: Iterable[Target],
    job_step: Callable[[AgentRecord], int | None] = lambda rec: rec.current_step,
) -> None:
    """Refuse explicit steps that have all begun on every target (nothing could be recorded).
    ``job_step`` gives a target's step: its own, else the step its driver announced."""
    current = []
    for t in targets:
        rec = registry.get(t.agent.agent_id)
        current.append(job_step(rec) if rec else None)
    known = [c for c in current if c is not None]
    if known and len(known) == len(current) and min(known) >= steps[-1]:
        raise RequestInvalid.at(
            "steps",
            f"every requested step has already begun on every target (targets are at steps "
            f"{sorted(set(known))}); use next_steps or later steps",
        )


def waiting_note(steps: tuple[int, ...], current: list[int | None]) -> str | None:
    """The reason an armed session gives when its first steps have already begun on every
    target (at ``current``): it waits for the first step still ahead, never a past one."""
    if not current or None in current:
        return None
    now_at = min(c for c in current if c is not None)
    past = [x for x in steps if x <= now_at]
    ahead = [x for x in steps if x > now_at]
    if not (past and ahead):
        return None
    span = f"{past[0]}-{past[-1]}" if len(past) > 2 else ", ".join(map(str, past))
    return (
        f"waiting for step {ahead[0]}; step(s) {span} had already begun on every target "
        f"(at step {now_at}) and will be missed"
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
