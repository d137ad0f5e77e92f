"""Plans pushed to node relays (profd.actors.relay_desk.RelayDesk), driven on one event loop
with a relay handle that records what it is sent."""

from __future__ import annotations

import asyncio
import pickle
import time
from typing import Any

from profd.actors.planbook import PlanBook
from profd.actors.relay_desk import RelayDesk
from profd.core.protocol import PollReply, WindowPlan


def window(sid: str) -> WindowPlan:
    return WindowPlan(sid, "torch", (1,), ((1,),), False, {}, f"/tmp/{sid}", "*")


class Handle:
    """An actor handle's ``push.remote``: records each push; fails when told to."""

    def __init__(self) -> None:
        self.pushes: list[tuple[str, dict[str, PollReply], bool]] = []
        self.fail = False
        self.push = self

    def remote(self, key: str, replies: dict[str, PollReply], refresh: bool) -> Any:
        key, replies, refresh = pickle.loads(pickle.dumps((key, replies, refresh)))  # Ray's way
        self.pushes.append((key, replies, refresh))

        async def answer() -> bool:
            if self.fail:
                raise RuntimeError("ActorDiedError")
            return True

        return answer()


class Remote:
    """What a forward's handle bytes unpickle into on the head relay (``push.remote``), in
    this process: records the pushes it is sent."""

    got: list[tuple[str, str, list[str]]] = []

    def __init__(self, name: str) -> None:
        self.name = name
        self.push = self

    def remote(self, key: str, replies: dict[str, PollReply], refresh: Any) -> Any:
        key, replies, refresh = pickle.loads(pickle.dumps((key, replies, refresh)))  # Ray's way
        Remote.got.append((self.name, key, sorted(replies)))

        async def answer() -> dict[str, int]:
            return {a: r.plan.version for a, r in replies.items() if r.plan is not None}

        return answer()


async def turns(until: Any = None, n: int = 50) -> None:
    """Let the loop run: ``n`` turns, or until ``until()`` holds (at most ``n``)."""
    for _ in range(n):
        await asyncio.sleep(0)
        if until is not None and until():
            return


def test_changes_of_one_turn_are_one_push_per_relay_of_what_its_agents_lack() -> None:
    async def go() -> None:
        plans = PlanBook()
        known = {"a", "b", "c"}
        desk = RelayDesk(plans, lambda aid: aid in known)
        h1, h2 = Handle(), Handle()
        for aid in ("a", "b", "c"):
            plans.ensure(aid)
        desk.sync("relay-1", h1, "n1", {"a": 0, "b": 0})
        desk.sync("relay-2", h2, "n2", {"c": 0})
        plans.set("a", (window("s1"),))
        plans.set("b", (window("s1"),))
        await turns()
        assert [(k, sorted(r), f) for k, r, f in h1.pushes] == [("n1", ["a", "b"], [])]
        assert h2.pushes == []  # its agent's plan did not change
        v = plans.plan("a").version
        assert h1.pushes[0][1]["a"].plan.version == v
        await turns(lambda: desk.pushes)  # answered: the relay holds it (what acks mean)
        assert await plans.wait_delivered({"a": v, "b": plans.plan("b").version}, 0) == []
        # acknowledged: a second change pushes only what the relay does not hold yet
        plans.set("b", (window("s1"), window("s2")))
        await turns()
        assert sorted(h1.pushes[1][1]) == ["b"]
        # a wake-up asks the relay for fresh steps of the woken agents only, instead of
        # leaving a flag for a poll (or sending every agent of the node around again)
        plans.wake("c")
        await turns()
        assert h2.pushes == [("n2", {}, ["c"])]
        plans.wake("a")
        await turns()
        assert h1.pushes[-1] == ("n1", {}, ["a"])  # not b, its neighbour
        assert plans.take_woken(["c"]) == set()
        # an agent the coordinator forgot: the relay is told it must register again
        known.discard("c")
        plans.set("c", (window("s1"),))
        await turns()
        assert h2.pushes[-1][1]["c"].known is False

    asyncio.run(go())


def test_a_failed_push_forgets_the_relay_and_its_agents_are_served_by_polls() -> None:
    async def go() -> None:
        plans = PlanBook()
        desk = RelayDesk(plans, lambda aid: True)
        h = Handle()
        plans.ensure("a")
        desk.sync("relay-1", h, "n1", {"a": 0})
        h.fail = True
        plans.set("a", (window("s1"),))
        await turns(lambda: desk.push_failures)
        assert len(h.pushes) == 1 and desk.push_failures == 1
        assert not desk.serves("a") and len(desk) == 0
        plans.set("a", ())
        plans.wake("a")  # nobody pushes: the next poll returns at once
        await turns()
        assert len(h.pushes) == 1 and plans.take_woken(["a"]) == {"a"}
        # the relay's next incarnation syncs under the same name: pushed to again
        h2 = Handle()
        desk.sync("relay-1", h2, "n1", {"a": plans.plan("a").version})
        plans.set("a", (window("s2"),))
        await turns(lambda: desk.pushes)
        assert len(h2.pushes) == 1 and desk.pushes == 1

    asyncio.run(go())


def test_real_relay_handles_wait_as_bytes_and_every_relay_is_pushed_to(
    ray_session: Any, monkeypatch
) -> None:
    """Ray actor handles are kept as their bytes (a live one holds ~22 KB of per-method
    metadata; 1,250 relays held 28 MB), made live for a push; with fewer kept live than
    there are relays, every relay still gets its pushes, twice over."""
    import ray

    from profd.actors import relay_desk

    class Relay:
        def __init__(self) -> None:
            self.got: list[list[str]] = []

        async def push(self, key: str, replies: dict[str, PollReply], refresh: Any) -> bool:
            self.got.append(sorted(replies))
            return True

        async def received(self) -> list[list[str]]:
            return self.got

    monkeypatch.setattr(relay_desk, "LIVE_HANDLES", 1)
    actors = [ray.remote(Relay).options(num_cpus=0).remote() for _ in range(3)]
    ray.get([h.received.remote() for h in actors], timeout=120)  # their processes started

    async def pushed(n: int) -> None:
        for _ in range(600):  # the pushes are Ray calls to other processes: up to 60 s
            if desk.pushes >= n or desk.push_failures:
                return
            await asyncio.sleep(0.1)

    plans = PlanBook()
    desk = RelayDesk(plans, lambda aid: True)

    async def go() -> None:
        for i, h in enumerate(actors):
            plans.ensure(f"a{i}")
            desk.sync(f"relay-{i}", h, f"n{i}", {f"a{i}": 0})
        stored = [desk._relays[f"relay-{i}"].target for i in range(3)]
        assert all(isinstance(t, relay_desk._Stored) and len(t.blob) < 2000 for t in stored)
        for want, sid in ((3, "s1"), (6, "s2")):
            for i in range(3):
                plans.set(f"a{i}", (window(sid),))
            await pushed(want)
        assert desk.pushes == 6 and desk.push_failures == 0
        assert len(desk._live) == 1

    asyncio.run(go())
    got = ray.get([h.received.remote() for h in actors], timeout=60)
    assert got == [[["a0"], ["a0"]], [["a1"], ["a1"]], [["a2"], ["a2"]]]
    for h in actors:
        ray.kill(h)


def test_many_relays_are_pushed_to_through_relays_and_each_failure_stays_its_own(
    ray_session: Any,
) -> None:
    """With many relays in one pass the desk pushes to one relay of each group of about
    sqrt(n) (by name), which pushes to the others (relay_forward.push_on): every relay gets
    its push once and its agent's plan is acknowledged, with fewer Ray calls than relays.
    Relays of an older profd (no push_on; their push answers True): at a group's head, the
    group is pushed directly and that relay heads none again; inside a group, its answer
    counts. A dead relay in a group is forgotten alone; a dead head has the rest of its group
    pushed directly."""
    import ray

    from profd.actors.relay_forward import Forward, push_on

    class Relay:
        def __init__(self) -> None:
            self.got: list[str] = []

        async def push(self, key: str, replies: dict[str, PollReply], refresh: Any) -> Any:
            self.got += [r.plan.windows[0].session_id for r in replies.values() if r.plan]
            return {a: r.plan.version for a, r in replies.items() if r.plan is not None}

        async def push_on(
            self, key: str, replies: dict[str, PollReply], refresh: Any, fwd: list[Forward]
        ) -> Any:
            return await push_on(self.push(key, replies, refresh), fwd)

        async def received(self) -> list[str]:
            return self.got

    class OldRelay:  # before push_on, and before a push answered with the versions held
        def __init__(self) -> None:
            self.got: list[str] = []

        async def push(self, key: str, replies: dict[str, PollReply], refresh: Any) -> bool:
            self.got += [r.plan.windows[0].session_id for r in replies.values() if r.plan]
            return True

        async def received(self) -> list[str]:
            return self.got

    n, old = 7, {0, 4}
    actors = [
        ray.remote(OldRelay if i in old else Relay).options(num_cpus=0).remote() for i in range(n)
    ]
    ray.get([h.received.remote() for h in actors], timeout=120)  # their processes started
    plans = PlanBook()
    desk = RelayDesk(plans, lambda aid: True, forward_min=2)
    live = set(range(n))

    def kill(i: int) -> None:
        ray.kill(actors[i])
        live.discard(i)
        # dead before the next push: ray.kill is asynchronous, so a call made just after it
        # may still be served (seen here under load); ask until the actor is gone
        deadline = time.monotonic() + 60
        while True:
            try:
                ray.get(actors[i].received.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                return
            assert time.monotonic() < deadline, f"relay-{i} still answers after ray.kill"

    async def round_(sid: str) -> tuple[int, int, int]:
        """Every live relay's agent gets a window ``sid``; (pushes, Ray calls, failures)."""
        before = (desk.pushes, desk.calls, desk.push_failures)
        for i in range(n):
            plans.set(f"a{i}", (window(sid),))
        for _ in range(600):  # Ray calls to other processes: up to 60 s
            await asyncio.sleep(0.1)
            if not desk._tasks and not desk._pending:
                break
        versions = {f"a{i}": plans.plan(f"a{i}").version for i in live}
        assert await plans.wait_delivered(versions, 1.0) == []  # every live one acknowledged
        return desk.pushes - before[0], desk.calls - before[1], desk.push_failures - before[2]

    async def go() -> None:
        for i, h in enumerate(actors):
            plans.ensure(f"a{i}")
            desk.sync(f"relay-{i}", h, f"n{i}", {f"a{i}": 0})
        # groups of 3 by name: [0 1 2] [3 4 5] [6]; old relay-0 heads the first: pushed
        # directly; old relay-4 is forwarded to by relay-3 and answers True
        assert await round_("s1") == (7, 3 + 1 + 1, 0)
        # relay-0 heads no group now: it, then [1 2 3] [4 5 6]; old relay-4 heads the second
        # (directly, 3 calls); relay-2, forwarded to by relay-1, is dead: forgotten alone
        await asyncio.to_thread(kill, 2)
        assert await round_("s2") == (6, 1 + 1 + 3, 1)
        # relay-0 and relay-4 directly; [1 3] [5 6]; relay-5 (a head) is dead: relay-6 directly
        await asyncio.to_thread(kill, 5)
        assert await round_("s3") == (5, 2 + 1 + 1 + 1, 1)

    asyncio.run(go())
    got = ray.get([actors[i].received.remote() for i in sorted(live)], timeout=60)
    assert got == [["s1", "s2", "s3"]] * len(live)
    for h in actors:
        ray.kill(h)


def test_a_node_relay_pushes_on_for_the_coordinator_each_answer_its_own() -> None:
    """NodeRelay.push_on: its own push and the forwarded ones at once; each forward's answer
    by relay name, a forward that cannot be made (its handle's bytes no good) a string."""
    from profd.actors.relay import NodeRelay
    from profd.actors.relay_forward import Forward
    from profd.core.protocol import AgentPlan

    plan = AgentPlan(version=5, windows=(window("s1"),))

    async def go() -> tuple[Any, Any]:
        relay = NodeRelay("node-a", push_target=lambda: None, serve_socket=False, confirm_s=0.05)
        fwd = [
            Forward("relay-b", pickle.dumps(Remote("b")), "kb", {"b0": PollReply(plan)}, False),
            Forward("relay-c", b"not a handle", "kc", {"c0": PollReply(plan)}, False),
        ]
        return await relay.push_on("node-a", {"a0": PollReply(plan)}, False, fwd)

    Remote.got.clear()
    own, answers = asyncio.run(go())
    assert own == {}  # a0 is not one of its agents: nobody polled with the plan
    assert answers["relay-b"] == {"b0": 5} and Remote.got == [("b", "kb", ["b0"])]
    assert isinstance(answers["relay-c"], str)


def test_a_heads_own_failure_is_its_answer_and_its_forwards_still_count() -> None:
    """relay_forward.push_on: the head's own push failing is a string in its place; the
    pushes it forwarded are answered as they went."""
    from profd.actors.relay_forward import Forward, push_on
    from profd.core.protocol import AgentPlan

    async def broken() -> dict[str, int]:
        raise RuntimeError("its loop is gone")

    plan = AgentPlan(version=9, windows=(window("s1"),))
    fwd = [Forward("relay-b", pickle.dumps(Remote("b")), "kb", {"b0": PollReply(plan)}, False)]
    Remote.got.clear()
    own, answers = asyncio.run(push_on(broken(), fwd))
    assert isinstance(own, str) and "its loop is gone" in own
    assert answers == {"relay-b": {"b0": 9}}


class Head(Remote):
    """A relay that forwards (``push_on.remote``) but whose own push fails."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.push_on = _PushOn()


class _PushOn:
    def remote(self, key: str, replies: Any, refresh: Any, fwd: Any) -> Any:
        from profd.actors.relay_forward import push_on

        key, replies, refresh, fwd = pickle.loads(pickle.dumps((key, replies, refresh, fwd)))

        async def broken() -> dict[str, int]:
            raise RuntimeError("its own push failed")

        return push_on(broken(), fwd)


def test_a_head_whose_own_push_failed_is_forgotten_and_its_forwards_are_acknowledged() -> None:
    """Groups of 2 of 3 relays: [0 1] [2]. relay-0's own push fails but it forwarded relay-1's:
    relay-0 is forgotten, relay-1's agent acknowledged; relay-2 is pushed on its own."""
    from profd.actors import relay_desk

    plans = PlanBook()
    desk = RelayDesk(plans, lambda aid: True, forward_min=2)

    async def go() -> None:
        for i in range(3):
            plans.ensure(f"a{i}")
            desk.sync(f"relay-{i}", object(), f"n{i}", {f"a{i}": 0})
            stand_in = Head("h") if i == 0 else Remote(f"r{i}")
            desk._relays[f"relay-{i}"].target = relay_desk._Stored(stand_in)  # as Ray's are
        for i in range(3):
            plans.set(f"a{i}", (window("s1"),))
        await turns(lambda: desk.pushes + desk.push_failures >= 3 and not desk._tasks)
        versions = {f"a{i}": plans.plan(f"a{i}").version for i in (1, 2)}
        assert await plans.wait_delivered(versions, 1.0) == []

    Remote.got.clear()
    asyncio.run(go())
    assert (desk.calls, desk.pushes, desk.push_failures) == (2, 2, 1)
    assert sorted(Remote.got) == [("r1", "n1", ["a1"]), ("r2", "n2", ["a2"])]
    assert sorted(desk._relays) == ["relay-1", "relay-2"]  # the head forgotten
