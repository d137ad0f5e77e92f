"""A straggler trigger on real agents and an in-process coordinator: three ranks, each on its
own thread, start every step together (a barrier, as a collective would) and mark two
stages; from step ``SLOW_FROM`` rank 1's ``update`` ends late. Rank 0's wall clock is an
hour off: its offset to the coordinator's clock must be applied, or rank 0 would be the
straggler. The trigger fires once, on rank 1 and the peer it chose, with its evidence, then
is quiet during its cooldown (counted as suppressed)."""

from __future__ import annotations

import threading
import time
from typing import Any

from profd.agent import ProfilerAgent
from profd.backends.base import NoopBackend

from helpers import wait_until

WORLD, SLOW_RANK, SLOW_FROM = 3, 1, 8
FWD_S, UPDATE_S, LATE_S = 0.01, 0.02, 0.12
SKEW_NS = 3600 * 10**9  # rank 0's wall clock


def agents(owner: Any) -> list[ProfilerAgent]:
    out = []
    for r in range(WORLD):
        clock = (lambda: time.time_ns() + SKEW_NS) if r == 0 else time.time_ns
        out.append(
            ProfilerAgent(
                "actor", r, WORLD, find_link=owner.link, now_ns=clock,
                backend_factory=lambda kind, options: NoopBackend(),
            ).start()
        )  # fmt: skip
    wait_until(lambda: all(a.connected for a in out), 10, what="agents registered")
    wait_until(lambda: all(a._clock_estimate() for a in out), 10, what="clock offsets")
    return out


def stages(agent: ProfilerAgent, rank: int, step: int) -> None:
    """One rank's stages in one step; from ``SLOW_FROM`` rank ``SLOW_RANK``'s update is late."""
    with agent.stage("fwd"):
        time.sleep(FWD_S)
    with agent.stage("update"):
        late = rank == SLOW_RANK and step >= SLOW_FROM
        time.sleep(UPDATE_S + (LATE_S if late else 0.0))


#: The trigger both jobs are watched by.
REQUEST = {
    "name": "late-update",
    "when": {"kind": "straggler", "role": "actor", "stage": "update", "for_steps": 2,
             "min_ms": 60},
    "session": {"next_steps": 2}, "cooldown_s": 600,
}  # fmt: skip


class Job:
    """The ranks' loops, each on its thread; every step starts at a barrier."""

    def __init__(self, ranks: list[ProfilerAgent]) -> None:
        self.ranks = ranks
        self.stop = threading.Event()
        self.barrier = threading.Barrier(len(ranks))
        self.steps = [0] * len(ranks)
        self.threads = [
            threading.Thread(target=self.loop, args=(r,), daemon=True) for r in range(len(ranks))
        ]

    def loop(self, rank: int) -> None:
        agent = self.ranks[rank]
        step = 0
        while not self.stop.is_set() and step < 2000:
            try:
                self.barrier.wait(10)
            except threading.BrokenBarrierError:
                return
            with agent.step(step):
                stages(agent, rank, step)
            step += 1
            self.steps[rank] = step

    def __enter__(self) -> Job:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.barrier.abort()
        for t in self.threads:
            t.join(10)


def test_a_late_rank_fires_one_straggler_session_on_it_and_its_peer(local_coordinator) -> None:
    owner = local_coordinator
    ranks = agents(owner)
    tid = owner.call("add_trigger", REQUEST).trigger_id
    try:
        with Job(ranks) as job:

            def fired() -> Any:
                v = owner.call("get_trigger", tid)
                return v if v.fired == 1 else None

            view = wait_until(fired, 60, 0.05, what="the straggler trigger fired")
            quiet = wait_until(
                lambda: owner.call("get_trigger", tid).suppressed.get("cooldown", 0) >= 1,
                60, 0.05, what="the condition held again, in the cooldown",
            )  # fmt: skip
            assert quiet and min(job.steps) > SLOW_FROM
    finally:
        for a in ranks:
            a.close(timeout=5)
    (firing,) = view.firings
    ev = firing.evidence
    assert ev["kind"] == "straggler" and ev["rank"] == SLOW_RANK and ev["mark"] == "update"
    assert ev["agent_id"] == ranks[SLOW_RANK].agent_id
    assert SLOW_FROM + 1 <= ev["step"] <= SLOW_FROM + 5, ev  # two late steps, then judged
    # late by about LATE_S against the peers' median end (their ends a few ms apart)
    assert 0.06 <= ev["late_s"] < LATE_S + 0.1 and ev["late_s"] > ev["threshold_s"] >= 0.005
    assert abs(ev["end_s"] - ev["peer_median_end_s"] - ev["late_s"]) < 1e-5
    assert abs(ev["end_s"] - time.time()) < 600  # the coordinator's clock, not rank 0's
    # judged against the peers listed then: all of them, but a clean-clone CI run on a
    # loaded machine once judged with one (a rank missing from the role's live ranks for
    # those steps, perhaps past the tests' 6 s heartbeat; not confirmed)
    assert ev["cause"] == "long duration" and 1 <= ev["baseline_samples"] <= WORLD - 1
    session = owner.call("get_session", firing.session_id)
    assert session.trigger_id == tid and session.evidence == ev
    ranks_hit = sorted(t.rank for t in session.targets)
    assert ranks_hit == sorted({SLOW_RANK, ev["peer_rank"]}) and len(ranks_hit) == 2
    listed = owner.call("list_triggers")
    assert [t.fired for t in listed] == [1]


class DriverJob(Job):
    """A single-controller job: a driver thread announces each step to the coordinator, as
    ``profd.controller()`` does, then calls every worker (each on its thread), which marks
    stages only, and waits for them all. No session is live, so the workers never hear the
    driver's steps: the coordinator places their stage samples."""

    def __init__(self, owner: Any, ranks: list[ProfilerAgent]) -> None:
        # not Job's threads: only its start and stop (stop, barrier, threads) are shared
        self.owner, self.ranks = owner, ranks
        self.stop = threading.Event()
        self.calls = [threading.Event() for _ in ranks]
        self.barrier = threading.Barrier(len(ranks) + 1)  # the driver waits for the workers
        self.step = 0
        self.threads = [threading.Thread(target=self.drive, daemon=True)] + [
            threading.Thread(target=self.work, args=(r,), daemon=True) for r in range(len(ranks))
        ]

    def drive(self) -> None:
        while not self.stop.is_set() and self.step < 2000:
            self.owner.call("controller_step", self.step, 2.0)
            for call in self.calls:
                call.set()
            try:
                self.barrier.wait(10)
            except threading.BrokenBarrierError:
                return
            self.step += 1

    def work(self, rank: int) -> None:
        agent = self.ranks[rank]
        while not self.stop.is_set():
            if not self.calls[rank].wait(0.5):  # the driver's call for this step
                continue
            self.calls[rank].clear()
            stages(agent, rank, self.step)
            try:
                self.barrier.wait(10)
            except threading.BrokenBarrierError:
                return


def test_a_late_rank_of_a_single_controller_job_fires_too(local_coordinator) -> None:
    """verl's shape: the workers mark no step. Their stage samples travel unplaced and the
    coordinator places each in the driver's step that began before it (the workers hear no
    step while nothing is profiled): the late rank is found in the step it was late."""
    owner = local_coordinator
    ranks = agents(owner)
    tid = owner.call("add_trigger", REQUEST).trigger_id
    try:
        with DriverJob(owner, ranks) as job:
            view = wait_until(
                lambda: (v := owner.call("get_trigger", tid)).firings and v,
                60, 0.05, what="the straggler trigger fired",
            )  # fmt: skip
            assert job.step > SLOW_FROM
    finally:
        for a in ranks:
            a.close(timeout=5)
    (firing,) = view.firings
    ev = firing.evidence
    assert ev["rank"] == SLOW_RANK and ev["agent_id"] == ranks[SLOW_RANK].agent_id
    assert SLOW_FROM + 1 <= ev["step"] <= SLOW_FROM + 5, ev  # the driver's step numbers
    assert 0.06 <= ev["late_s"] < LATE_S + 0.1 and ev["cause"] == "long duration"
    assert ev["peer_rank"] in {0, 2}


def test_a_drivers_step_at_a_time_is_the_one_begun_last_before_it() -> None:
    from profd.actors.drivers import DriverTable
    from profd.actors.mark_stats import placed
    from profd.core.protocol import LabelDurations, MarkDurations

    now = [100.0]
    table = DriverTable(lambda: now[0], 30.0, None, None, list)  # type: ignore[arg-type]

    async def announce(job: str | None, step: int, at: float) -> None:
        now[0] = at
        await table.step(step, 0.0, job)

    import asyncio

    async def scenario() -> None:
        await announce("job-a", 5, 100.0)
        await announce("job-a", 5, 100.5)  # the same step again (a reconnect's probe)
        await announce("job-a", 6, 101.0)
        await announce(None, 40, 100.8)  # a driver that does not name its job

    asyncio.run(scenario())
    now[0] = 101.5
    assert table.step_at("job-a", 99.0) is None  # before the steps kept
    assert table.step_at("job-a", 100.7) == 5  # not the repeat's time: still step 5
    assert table.step_at("job-a", 100.9) == 40  # the nameless driver began later
    assert table.step_at("job-a", 101.2) == 6
    assert table.step_at("job-b", 100.9) == 40 and table.step_at(None, 100.0) is None
    assert table.step_at("job-a", 131.5) is None  # silent past heartbeat_timeout_s
    times = MarkDurations(
        step=None,
        stages=(
            LabelDurations("update", (0.1, 0.1), spans=((None, 100.6, 100.7), (None, 99.0, 99.1))),
            LabelDurations("fwd", (0.1,), spans=((3, 100.0, 100.1),)),
        ),
    )
    got = placed(times, lambda t: table.step_at("job-a", t))
    assert got.stages[0].spans == ((5, 100.6, 100.7),)  # the unplaceable one left out
    assert got.stages[1] is times.stages[1] and placed(got, lambda t: 0) is got
