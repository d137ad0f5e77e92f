"""The coordinator's registry of agents (pure bookkeeping, no Ray)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from profd.core.protocol import AgentInfo
from profd.core.states import AgentLink, AgentState
from profd.core.views import AgentView, ReplicaView, TimingView

__all__ = ["AgentRecord", "AgentRegistry"]


@dataclass(slots=True)
class AgentRecord:
    info: AgentInfo
    registered_at: float
    last_seen: float
    current_step: int | None = None
    #: When ``current_step`` was last reported (the coordinator's clock).
    step_seen: float = 0.0
    state: AgentState = AgentState.ALIVE
    link: AgentLink | None = None  # how its last poll came (None before the first)
    last_seq: int = 0  # the newest numbered event applied (AgentEvent.seq)
    #: Its process or node is known gone (Ray said so): no poll brings it back, only a
    #: registration. A relay's poll may still carry it after it died.
    gone: bool = False

    @property
    def retired(self) -> bool:
        """Known gone, or closed: polls and syncs that still carry it are answered "unknown"
        (a live one registers again), and it is not seen again."""
        return self.gone or self.state is AgentState.CLOSED

    def touch(self, now: float, step: int | None, revive: bool = True) -> None:
        """Heard from now. ``revive=False`` for the end of a long-poll parked before the
        agent was found dead: only a new call from the agent brings a lost agent back, and
        none brings back one whose process is gone (:attr:`gone`)."""
        if self.state is AgentState.LOST and (not revive or self.gone):
            return
        if self.state is AgentState.CLOSED:  # seen last at its close (a registration revives)
            return
        self.last_seen = now
        if step is not None:
            self.saw_step(step, now)
        if self.state is AgentState.LOST:
            self.state = AgentState.ALIVE

    def saw_step(self, step: int, now: float) -> None:
        """The agent reported being at ``step`` (at ``now``, the coordinator's clock)."""
        self.current_step, self.step_seen = step, now

    def step(self, driver_step: int | None) -> int | None:
        """The job's step on this agent: its own, else its driver's."""
        return self.current_step if self.current_step is not None else driver_step

    def view(
        self,
        now: float,
        driver_step: int | None = None,
        times: tuple[TimingView | None, dict[str, TimingView]] = (None, {}),
    ) -> AgentView:
        """``times``: its (step, stages) durations (:class:`~profd.actors.mark_stats.MarkStats`)."""
        i = self.info
        step_time, stage_times = times
        step = self.step(driver_step)
        source = None if step is None else ("agent" if self.current_step is not None else "driver")
        return AgentView(
            agent_id=i.agent_id,
            role=i.role,
            rank=i.rank,
            world_size=i.world_size,
            topology=dict(i.topology),
            hostname=i.hostname,
            node_id=i.node_id,
            node_ip=i.node_ip,
            pid=i.pid,
            job_id=i.job_id,
            state=self.state,
            current_step=step,
            step_source=source,
            last_seen_s=round(max(0.0, now - self.last_seen), 3),
            capabilities=dict(i.capabilities),
            labels=dict(i.labels),
            link=self.link,
            replica=ReplicaView(**dataclasses.asdict(i.replica)) if i.replica else None,
            last_step_s=step_time.last_s if step_time else None,
            median_step_s=step_time.median_s if step_time else None,
            step_time=step_time,
            stage_times=stage_times,
        )


class AgentRegistry:
    def __init__(self) -> None:
        self._agents: dict[str, AgentRecord] = {}

    def __len__(self) -> int:
        return len(self._agents)

    def get(self, agent_id: str) -> AgentRecord | None:
        return self._agents.get(agent_id)

    def upsert(self, info: AgentInfo, now: float, step: int | None) -> AgentRecord:
        rec = self._agents.get(info.agent_id)
        if rec is None:
            rec = AgentRecord(info=info, registered_at=now, last_seen=now, current_step=step)
            self._agents[info.agent_id] = rec
        else:
            rec.info = info
            rec.state = AgentState.ALIVE
            rec.gone = False
            rec.touch(now, step)
        return rec

    def alive(self) -> list[AgentRecord]:
        return [r for r in self._agents.values() if r.state is AgentState.ALIVE]

    def unconfirmed(self) -> list[AgentRecord]:
        """Alive agents, and lost ones whose death Ray has not confirmed (the heartbeat
        timeout lost them): the liveness check asks about these."""
        return [
            r
            for r in self._agents.values()
            if r.state is AgentState.ALIVE or (r.state is AgentState.LOST and not r.gone)
        ]

    def all(self) -> list[AgentRecord]:
        return list(self._agents.values())

    def by_role(self) -> dict[str, list[AgentRecord]]:
        out: dict[str, list[AgentRecord]] = {}
        for rec in self.alive():
            out.setdefault(rec.info.role, []).append(rec)
        for recs in out.values():
            recs.sort(key=lambda r: r.info.rank)
        return out

    def counts_by_role(self) -> dict[str, int]:
        return dict(Counter(r.info.role for r in self.alive()))

    def expire(self, now: float, timeout_s: float) -> list[AgentRecord]:
        """Mark agents unheard of for ``timeout_s`` as lost; return the newly lost ones."""
        lost = []
        for rec in self._agents.values():
            if rec.state is AgentState.ALIVE and now - rec.last_seen > timeout_s:
                rec.state = AgentState.LOST
                lost.append(rec)
        return lost

    def lose(self, agent_id: str) -> AgentRecord | None:
        """Mark an agent lost for good now (its process is known dead); the record if it was
        alive. Polls never revive it (:attr:`AgentRecord.gone`)."""
        rec = self._agents.get(agent_id)
        if rec is None:
            return None
        rec.gone = True  # also one the heartbeat timeout had lost already
        if rec.state is not AgentState.ALIVE:
            return None
        rec.state = AgentState.LOST
        return rec

    def close(self, agent_id: str) -> None:
        rec = self._agents.get(agent_id)
        if rec is not None:
            rec.state = AgentState.CLOSED
