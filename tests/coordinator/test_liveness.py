"""Dead workers are noticed from what the nodes know, not only by a silent heartbeat."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from profd.actors.liveness import ProcessProbe, exited, find_gone
from profd.actors.runner import LocalRunner, NodeAddress
from profd.core.protocol import AgentInfo
from profd.core.ray_env import process_start

from helpers import wait_until


@dataclass
class Rec:
    info: AgentInfo


def rec(aid: str, pid: int, start: int | None, node: str | None = "n1") -> Rec:
    return Rec(AgentInfo(aid, "actor", 0, 1, {}, "h", pid, node_id=node, pid_start=start))


def test_exited_compares_pid_and_start_time() -> None:
    me = os.getpid()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child_start = process_start(child.pid)
    child.wait()
    probes = [
        ProcessProbe("alive", me, process_start(me)),
        ProcessProbe("reused", me, (process_start(me) or 0) + 1),  # same pid, another process
        ProcessProbe("gone", child.pid, child_start or 1),
    ]
    assert sorted(exited(probes)) == ["gone", "reused"]


class Runner(LocalRunner):
    def __init__(self, live: list[str] | None) -> None:
        self.live = live
        self.ran: list[str | None] = []

    async def nodes(self, max_age_s: float | None = None) -> list[NodeAddress] | None:
        return None if self.live is None else [NodeAddress(n) for n in self.live]

    async def exited(self, node_id: str | None, probes: list[Any]) -> list[str]:
        self.ran.append(node_id)
        return await super().exited(node_id, probes)


def test_find_gone_by_node_and_by_process() -> None:
    me, start = os.getpid(), process_start(os.getpid())
    agents = [
        rec("ok", me, start),
        rec("dead", 2**22 + 12345, 7),
        rec("away", me, start, node="n2"),
        rec("simulated", 999_999, None),  # no start time: never checked
    ]
    runner = Runner(live=["n1"])
    gone = asyncio.run(find_gone(agents, runner))
    reasons = {g.agent_id: g.reason for g in gone}
    assert set(reasons) == {"dead", "away"}
    assert "exited" in reasons["dead"] and "left the Ray cluster" in reasons["away"]
    assert runner.ran == ["n1"]  # one check per node that is still there


def test_a_node_that_cannot_answer_says_nothing() -> None:
    class Broken(Runner):
        async def exited(self, node_id: str | None, probes: list[Any]) -> list[str]:
            raise TimeoutError("busy")

    agents = [rec("a", 2**22 + 1, 5)]
    assert asyncio.run(find_gone(agents, Broken(live=None))) == []


def test_a_dead_agent_stays_lost_when_a_relay_still_polls_for_it(tmp_path) -> None:
    """A worker killed behind its node's relay: the liveness check loses it, and a relay's
    poll still carrying it (sent before the relay saw its socket close) does not bring it
    back, so a session for its role is refused. An agent lost by the heartbeat timeout only
    is brought back by such a poll, and a dead one by registering again."""
    import pytest

    from profd.actors.coordinator import ProfileCoordinator
    from profd.core.errors import RequestInvalid
    from profd.core.request import ToolKind

    from helpers import coordinator_settings

    async def run() -> tuple[dict[str, str], dict[str, str]]:
        c = ProfileCoordinator(coordinator_settings(tmp_path, tick_s=3600.0))
        await c.start()
        try:
            caps = {t.value: None for t in ToolKind}
            infos = [
                AgentInfo(aid, role, 0, 1, {}, "h", os.getpid(), node_id="n0", capabilities=caps)
                for aid, role in (("critic-0", "critic"), ("actor-0", "actor"))
            ]
            for info in infos:
                await c.register(info, 3)
            assert c._registry.lose("critic-0") is not None  # as the liveness check does
            c._registry.expire(c._clock() + 3600, 60)  # actor-0: the heartbeat's loss
            # the liveness check goes on asking about actor-0 only
            assert [r.info.agent_id for r in c._registry.unconfirmed()] == ["actor-0"]
            both = {"critic-0": 0, "actor-0": 0}
            replies = await c.poll_many(both, {"critic-0": 4, "actor-0": 4}, 0)
            # the relay is told to drop critic-0 (a live one would register again)
            assert not replies["critic-0"].known
            assert not (await c.poll("critic-0", 0, 4, 0)).known
            states = {a.agent_id: a.state.value for a in await c.list_agents()}
            with pytest.raises(RequestInvalid, match="critic"):
                await c.create_session({"next_steps": 1, "roles": {"critic": {}}})
            await c.register(infos[0], 5)  # a registration is the agent itself: back
            return states, {a.agent_id: a.state.value for a in await c.list_agents()}
        finally:
            c.close()

    states, after = asyncio.run(run())
    assert states == {"critic-0": "lost", "actor-0": "alive"}
    assert after == {"critic-0": "alive", "actor-0": "alive"}


def test_processes_are_checked_without_a_ray_task(ray_session: Any) -> None:
    """Every few seconds, per node: a Ray task for it started a worker process each time
    (Ray kept none idle beside the job's actors), and the job's steps felt each start. On
    the coordinator's own node the check runs in its process; on another node, in that
    node's relay; a task only where a node has no relay."""
    import ray

    from profd.actors.relay import NodeRelay, relay_name
    from profd.actors.runner import RayNodeRunner
    from profd.core.constants import NAMESPACE

    me = os.getpid()
    probes = [ProcessProbe("alive", me, process_start(me)), ProcessProbe("dead", me, 1)]

    class NoTasks(RayNodeRunner):
        def __init__(self) -> None:
            super().__init__()
            self.tasks: list[str | None] = []

        async def run(self, node_id: str | None, fn: Any, *args: Any) -> Any:
            self.tasks.append(node_id)
            return ["from-a-task"]

    relay = (
        ray.remote(NodeRelay)
        .options(name=relay_name("f" * 56), namespace=NAMESPACE, num_cpus=0)
        .remote("f" * 56)
    )
    try:
        runner = NoTasks()

        async def go() -> list[list[str]]:
            return [
                await runner.exited(ray_session.node_id, probes),  # here
                await runner.exited("f" * 56, probes),  # its relay
                await runner.exited("e" * 56, probes),  # no relay there: a task
            ]

        here, by_relay, by_task = asyncio.run(go())
        assert here == ["dead"] and by_relay == ["dead"] and by_task == ["from-a-task"]
        assert runner.tasks == ["e" * 56]  # only where no relay runs
        assert asyncio.run(runner.exited("e" * 56, probes)) == []  # and not again at once
        assert runner.tasks == ["e" * 56]
        runner.TASK_CHECK_S = 0.0  # the next relay-less check may use a task again
        ray.kill(relay)  # without its relay, that node is asked by a task again
        assert asyncio.run(runner.exited("f" * 56, probes)) == []  # this pass: unknown
        wait_until(
            lambda: asyncio.run(runner.exited("f" * 56, probes)) == ["from-a-task"], 30,
            what="a task once the relay is gone",
        )  # fmt: skip
    finally:
        ray.kill(relay)
