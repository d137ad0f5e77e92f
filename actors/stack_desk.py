"""Stacks of a live or hung job (``GET /api/v1/stacks``, ``profd stacks``).

:meth:`StackDesk.collect` reads every matching live agent's training-thread stack and groups
them (:func:`profd.core.stacks.group_stacks`). It needs no session and no step marks:

1. **py-spy** (method ``auto`` or ``py_spy``, unless the operator turned it off with
   ``stacks_py_spy``): one node task per node runs ``py-spy dump`` on that node's processes;
2. **the agents** (method ``agent``, or ``auto`` for what py-spy could not read, e.g. when the
   kernel refuses to let it attach): a stack request goes out in each agent's plan
   (:meth:`~profd.actors.planbook.PlanBook.request_stacks`), which wakes its long-poll; its
   poller thread answers with a ``stack`` event (:meth:`StackDesk.on_sample`).

A process that answers neither way within the timeout is listed in ``missing`` with why:
a slow peer is a typed status, never an error of the whole request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from profd.actors.targeting import NO_JOB
from profd.core.errors import ConflictError, NotFoundError
from profd.core.protocol import StackFrame, StackSample
from profd.core.stacks import (
    PY_SPY_TIMEOUT_S,
    PySpyDump,
    RankStack,
    StackMethod,
    StackQuery,
    dump_with_py_spy,
    group_stacks,
)
from profd.core.views import (
    StackFrameView,
    StackGroupView,
    StackMissingView,
    StackRankView,
    StacksView,
)

if TYPE_CHECKING:
    from profd.actors.planbook import PlanBook
    from profd.actors.registry import AgentRecord, AgentRegistry
    from profd.actors.runner import NodeRunner
    from profd.core.settings import CoordinatorSettings

__all__ = ["StackDesk"]

log = logging.getLogger(__name__)


@dataclass
class _Asked:
    """One stack request waiting for agents' answers."""

    want: set[str]
    got: dict[str, StackSample] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class StackDesk:
    """Reads stacks by py-spy or through the agents, and groups them."""

    def __init__(
        self,
        registry: AgentRegistry,
        plans: PlanBook,
        runner: NodeRunner,
        settings: CoordinatorSettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._registry = registry
        self._plans = plans
        self._runner = runner
        self._settings = settings
        self._clock = clock
        # numbers from the clock, so a restarted coordinator never repeats one an agent answered
        self._next = int(time.time() * 1000)
        self._asked: dict[int, _Asked] = {}

    # -- the agents' answers -----------------------------------------------------------
    def on_sample(self, agent_id: str, sample: StackSample) -> None:
        """An agent's ``stack`` event: it answers its request and any older one still open
        (an agent answers only the newest number it holds)."""
        for number, asked in self._asked.items():
            if number <= sample.request and agent_id in asked.want:
                asked.got[agent_id] = sample
                if asked.want <= asked.got.keys():
                    asked.done.set()

    # -- one request --------------------------------------------------------------------
    async def collect(self, query: StackQuery) -> StacksView:
        targets, missing = self._targets(query)
        py_spy = query.method is not StackMethod.AGENT and self._settings.stacks_py_spy
        if query.method is StackMethod.PY_SPY and not self._settings.stacks_py_spy:
            raise ConflictError(
                "method: py-spy is turned off for this cluster (stacks_py_spy at profd up); "
                "use method agent"
            )
        stacks: list[RankStack] = []
        notes: list[str] = []
        left = targets
        if py_spy and targets:
            read, refused = await self._by_py_spy(targets, query)
            stacks += read
            if refused:
                reasons = sorted({why for _, why in refused})
                if query.method is StackMethod.PY_SPY:
                    missing += [_missing(rec, why) for rec, why in refused]
                    left = []
                else:
                    left = [rec for rec, _ in refused]
                    notes.append(
                        f"py-spy could not read {len(refused)} process(es) ({'; '.join(reasons)})"
                        "; their agents' own threads read them"
                        + (", without native frames" if query.native else "")
                    )
            else:
                left = []
        if left:
            answered, silent = await self._by_agents(left, query.timeout_s)
            stacks += answered
            missing += silent
        if not self._registry.alive():
            notes.append("no agent is attached")
        groups = group_stacks(stacks)
        return StacksView(
            groups=[_group_view(g.frames, g.ranks) for g in groups],
            missing=missing,
            method=query.method.value,
            native=query.native,
            notes=notes,
            taken_at=self._clock(),
        )

    def _targets(self, query: StackQuery) -> tuple[list[AgentRecord], list[StackMissingView]]:
        alive = self._registry.alive()
        if query.job_id is not None:
            job = None if query.job_id == NO_JOB else query.job_id
            alive = [r for r in alive if r.info.job_id == job]
            if not alive:
                jobs = sorted({r.info.job_id or NO_JOB for r in self._registry.alive()})
                raise NotFoundError(
                    f"job_id: no live agent of Ray job {query.job_id!r} (jobs attached: "
                    f"{', '.join(jobs) or 'none'})"
                )
        if query.role is not None:
            alive = [r for r in alive if r.info.role == query.role]
            if not alive:
                roles = sorted({r.info.role for r in self._registry.alive()})
                raise NotFoundError(
                    f"role: no live agent has role {query.role!r} (roles attached: "
                    f"{', '.join(roles) or 'none'})"
                )
        missing: list[StackMissingView] = []
        if query.ranks is not None:
            wanted = set(query.ranks)
            alive = [r for r in alive if r.info.rank in wanted]
            have = {r.info.rank for r in alive}
            missing = [
                StackMissingView(
                    role=query.role or "*", rank=rank, reason="no live agent has this rank"
                )
                for rank in sorted(wanted - have)
            ]
        return alive, missing

    async def _by_py_spy(
        self, targets: Sequence[AgentRecord], query: StackQuery
    ) -> tuple[list[RankStack], list[tuple[AgentRecord, str]]]:
        """py-spy on each node: the stacks it read, and the processes it could not read."""
        by_node: dict[str | None, list[AgentRecord]] = {}
        for rec in targets:
            by_node.setdefault(rec.info.node_id, []).append(rec)

        async def one_node(node: str | None, recs: list[AgentRecord]) -> list[PySpyDump]:
            procs = sorted({(r.info.pid, r.info.thread_id) for r in recs})
            try:
                return await asyncio.wait_for(
                    self._runner.run(node, dump_with_py_spy, procs, query.native),
                    query.timeout_s + PY_SPY_TIMEOUT_S,
                )
            except Exception as exc:  # the node task failed or never ran: the agents answer
                why = f"the node task did not run ({type(exc).__name__}: {exc})"
                return [PySpyDump(pid, tid, error=why) for pid, tid in procs]

        nodes = list(by_node.items())
        dumps = await asyncio.gather(*(one_node(n, recs) for n, recs in nodes))
        read: list[RankStack] = []
        refused: list[tuple[AgentRecord, str]] = []
        for (_, recs), node_dumps in zip(nodes, dumps, strict=True):
            by_proc = {(d.pid, d.thread_id): d for d in node_dumps}
            for rec in recs:
                d = by_proc.get((rec.info.pid, rec.info.thread_id))
                if d is None or d.frames is None:
                    refused.append((rec, d.error if d and d.error else "py-spy gave nothing"))
                else:
                    read.append(_rank_stack(rec, "py_spy", d.frames, d.thread))
        return read, refused

    async def _by_agents(
        self, targets: Sequence[AgentRecord], timeout_s: float
    ) -> tuple[list[RankStack], list[StackMissingView]]:
        """Ask each agent through its plan; wait for the answers up to ``timeout_s``."""
        self._next += 1
        number = self._next
        asked = _Asked(want={r.info.agent_id for r in targets})
        self._asked[number] = asked
        try:
            for rec in targets:
                self._plans.request_stacks(rec.info.agent_id, number)
            try:
                await asyncio.wait_for(asked.done.wait(), timeout_s)
            except TimeoutError:
                pass
        finally:
            del self._asked[number]
        answered: list[RankStack] = []
        silent: list[StackMissingView] = []
        for rec in targets:
            sample = asked.got.get(rec.info.agent_id)
            if sample is None:
                silent.append(
                    _missing(
                        rec,
                        f"its agent did not answer within {timeout_s:g} s (its poller cannot "
                        "run while the training thread holds the GIL; py-spy can read it)",
                    )
                )
            elif sample.error is not None:
                silent.append(_missing(rec, sample.error))
            else:
                answered.append(_rank_stack(rec, "agent", sample.frames, sample.thread))
        return answered, silent


def _rank_stack(
    rec: AgentRecord, method: str, frames: tuple[StackFrame, ...], thread: str
) -> RankStack:
    i = rec.info
    return RankStack(i.role, i.rank, i.pid, i.hostname, method, frames, thread)


def _missing(rec: AgentRecord, reason: str) -> StackMissingView:
    i = rec.info
    return StackMissingView(role=i.role, rank=i.rank, pid=i.pid, node=i.hostname, reason=reason)


def _group_view(frames: tuple[StackFrame, ...], ranks: Sequence[RankStack]) -> StackGroupView:
    return StackGroupView(
        stack=[StackFrameView(function=f.function, file=f.file, line=f.line) for f in frames],
        ranks=[
            StackRankView(
                role=r.role, rank=r.rank, pid=r.pid, node=r.node, method=r.method, thread=r.thread
            )
            for r in ranks
        ],
    )
