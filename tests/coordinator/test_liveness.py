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

    async def run(self, node_id: str | None, fn: Any, *args: Any) -> Any:
        self.ran.append(node_id)
        return await super().run(node_id, fn, *args)


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
        async def run(self, node_id: str | None, fn: Any, *args: Any) -> Any:
            raise TimeoutError("busy")

    agents = [rec("a", 2**22 + 1, 5)]
    assert asyncio.run(find_gone(agents, Broken(live=None))) == []
