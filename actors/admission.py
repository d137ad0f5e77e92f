"""Admitting a session: conflicts, reachability, ids and directories (no Ray), and
:class:`Admission`, which runs them for a new session or a late agent."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from profd.actors.registry import AgentRecord, AgentRegistry
from profd.actors.selection import WILDCARD
from profd.actors.sessions import Part, Session
from profd.actors.targeting import Target, resolve_targets
from profd.core.errors import ConflictError, RequestInvalid
from profd.core.heap import collection_deferred
from profd.core.protocol import AgentInfo
from profd.core.request import SessionRequest, field_errors

if TYPE_CHECKING:
    from profd.actors.alignment import Alignment
    from profd.actors.drivers import DriverTable
    from profd.actors.session_book import SessionBook

__all__ = [
    "Admission",
    "check_conflicts",
    "check_reachable",
]

log = logging.getLogger(__name__)


def _colocated_devices(info: AgentInfo) -> range:
    """The global device ranks a colocated replica shares with training (else none)."""
    r = info.replica
    return range(r.global_rank_start, r.global_rank_stop) if r and r.colocated else range(0)


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
    # Rank numbers name a job's devices: rank 0 of two Ray jobs are two devices.
    if info.replica is None:
        return out | {("process", info.hostname, info.pid), ("device", info.job_id, info.rank)}
    out.add(("engine", info.agent_id))
    out.update(("device", info.job_id, g) for g in _colocated_devices(info))
    return out


def _conflict(domain: tuple[Any, ...], a: AgentInfo, b: AgentInfo) -> bool:
    """Whether ``a`` and ``b`` sharing ``domain`` means two profilers at once. An agent, a
    process or an engine always; a device only with a colocated replica on one side (actor
    rank 0 and critic rank 0 are different workers, not one device)."""
    return domain[0] != "device" or a.replica is not None or b.replica is not None


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


class Admission:
    """Admits new sessions (validate, target, refuse conflicts, place the window) and late
    agents into launch-time sessions; owns no state of its own."""

    def __init__(
        self,
        registry: AgentRegistry,
        book: SessionBook,
        alignment: Alignment,
        drivers: DriverTable,
    ) -> None:
        self._registry = registry
        self._book = book
        self._alignment = alignment
        self._drivers = drivers

    async def admit(
        self, request: dict | SessionRequest, origin: dict[str, Any] | None = None
    ) -> Session:
        """A new session, its window placed and its plans published (``origin``: the trigger
        that started it, and why)."""
        # No cyclic collection from the request until its plans have gone out: at 10,000
        # agents one takes 60-150 ms, and one to three fell there (profd.core.heap,
        # bench/create_latency.py). Not across a next_steps session's wait for fresh steps
        # (up to align_timeout_s): the collection deferred so far may run there.
        with collection_deferred():
            req, session, targets = self._new_session(request, origin)
            waits = req.steps is None and req.duration_s is None  # (see Alignment.place)
            if not waits:
                await self._alignment.place(session, req, targets)
                await self._publish(session)
        if waits:
            await self._alignment.place(session, req, targets)
            with collection_deferred():
                await self._publish(session)
        # Encoding 10,000 parts for the store and building the reply come after the plans
        # (the writer thread commits the rows in the background).
        self._book.persist(session)
        log.info(
            "session %s created: tool %s steps %s, %d target(s), %d ignored",
            session.session_id,
            req.tool.value,
            session.steps,
            len(session.targets),
            len(session.ignored),
        )
        return session

    def _new_session(
        self, request: dict | SessionRequest, origin: dict[str, Any] | None
    ) -> tuple[SessionRequest, Session, list[Target]]:
        """The request validated, targeted and checked, as a new session (window not placed)."""
        try:
            req = (
                request
                if isinstance(request, SessionRequest)
                else SessionRequest.model_validate(request)
            )
        except ValidationError as exc:
            raise RequestInvalid.from_fields(field_errors(exc)) from None
        targeting = resolve_targets(req, [r.info for r in self._registry.alive()])
        # A role in several jobs (a named role; the wildcard entry is a job with no agents
        # yet, which a launch-time session waits for): profiling one job's ranks and not
        # the other's would be a guess.
        several = [i for i in targeting.ignored if i.field == "job_id" and i.role != WILDCARD]
        if several:
            raise RequestInvalid.at("job_id", "; ".join(i.reason for i in several))
        if not targeting.targets and not req.wait_for_agents:
            detail = "; ".join(
                f"{i.role}{'' if i.rank is None else f' rank {i.rank}'}: {i.reason}"
                for i in targeting.ignored
            )
            # The field every reason is about (`roles.*.ranks` for a rank no agent has), else
            # the request's roles as a whole.
            about = {i.field for i in targeting.ignored}
            raise RequestInvalid.at(
                about.pop() if len(about) == 1 else "roles",
                f"no registered agent matches the request ({detail or 'no agents'})",
            )
        check_conflicts(
            self._book.live(), self._registry, targeting.targets, timed=req.duration_s is not None
        )
        if req.steps is not None:
            check_reachable(req.steps, self._registry, targeting.targets, self._drivers.job_step)
        session = self._book.new(req, targeting, origin)
        if req.duration_s is not None:  # said, not refused: a config made for steps still runs
            session.warnings.extend(
                f"roles.{key}.discrete: not used by a timed window (duration_s): one "
                "collection per target"
                for key, block in req.roles.items()
                if block.discrete
            )
        return req, session, targeting.targets

    async def _publish(self, session: Session) -> None:
        """The placed session's plans out: parked long-polls answer and relays' pushes leave
        before anything else. Two turns: in the first the woken polls return and the pushes
        are sent; under Ray the polls' results are handed over by their tasks'
        done-callbacks, which run in the second."""
        self._book.advance(session, persist=False)
        self._alignment.say_what_is_past(session)
        self._book.publish([*session.targets])
        for _ in range(2):
            await asyncio.sleep(0)

    def adopt(self, info: AgentInfo) -> None:
        """Add a newly registered agent to launch-time sessions whose window has not begun."""
        for s in self._book.live():
            if not s.open_targeting or info.agent_id in s.targets:
                continue
            t = resolve_targets(s.request, [info])
            if not t.targets:
                continue
            others = [o for o in self._book.live() if o is not s]  # not against itself
            try:
                check_conflicts(others, self._registry, t.targets)
            except ConflictError as exc:
                s.warnings.append(f"{info.role} rank {info.rank} not adopted: {exc.message}")
                continue
            self._book.adopt(s, t.targets[0])
            log.info("session %s adopted %s rank %s", s.session_id, info.role, info.rank)
