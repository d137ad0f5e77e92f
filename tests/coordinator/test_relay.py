"""The node relay's logic (profd.actors.relay.NodeRelay) with real agents and a real
coordinator in this process: the relay runs on the coordinator's event-loop thread and calls
it directly, the agents reach the relay through a link with the blocking Ray-link interface.
(tests/e2e/test_relay.py runs it as a Ray actor per node, with its fallback.)"""

from __future__ import annotations

import asyncio
import pickle
import tempfile
from typing import Any

import pytest

from profd.actors.relay import NodeRelay
from profd.agent import ProfilerAgent
from profd.agent.channel import LinkDown
from profd.agent.relay_link import SocketLink
from profd.core.states import AgentLink, AgentState

from helpers import wait_terminal, wait_until


class DirectCaller:
    """The coordinator object itself, awaited on its own loop; counts calls per method."""

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator
        self.calls: dict[str, int] = {}
        self.down = False

    async def call(self, method: str, *args: Any, timeout: float, **kw: Any) -> Any:
        self.calls[method] = self.calls.get(method, 0) + 1
        if self.down:
            raise ConnectionError("coordinator down")
        return await asyncio.wait_for(getattr(self.coordinator, method)(*args, **kw), timeout)


class RelayLink:
    """What an agent's Ray link to the relay does, on the relay's loop."""

    def __init__(self, relay: NodeRelay, loop: asyncio.AbstractEventLoop) -> None:
        self._relay, self._loop = relay, loop

    def _call(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        fut = asyncio.run_coroutine_threadsafe(getattr(self._relay, method)(*args), self._loop)
        try:
            return fut.result(timeout)
        except ConnectionError as exc:
            raise LinkDown(str(exc)) from exc

    def register(self, info, step):
        return self._call("register", info, step)

    def poll(self, agent_id, version, step, timeout):
        return self._call("poll", agent_id, version, step, timeout, timeout=timeout + 30)

    def report(self, agent_id, events):
        return self._call("report", agent_id, events)

    def clock_ns(self):
        return self._call("clock_ns")


class PushHandle:
    """What the coordinator holds of a relay it pushes plans to (an actor handle's
    ``push.remote``), here the relay itself on the same loop."""

    def __init__(self) -> None:
        self.relay: NodeRelay | None = None
        self.push = self

    def remote(self, key: str, replies: Any, refresh: bool) -> Any:
        assert self.relay is not None and key == "node-a"
        key, replies, refresh = pickle.loads(pickle.dumps((key, replies, refresh)))  # Ray's way
        return self.relay.push(key, replies, refresh)


@pytest.fixture(params=["poll", "push", "socket"])
def relayed(local_coordinator: Any, request: pytest.FixtureRequest, monkeypatch) -> Any:
    """Three agents of one node behind one relay, which parks a ``poll_many`` at the
    coordinator (``poll``) or has its plans pushed (``push``, as a relay actor does); their
    calls reach it on its loop, or (``socket``, pushed, as profd's agents do) over the
    relay's real Unix socket; yields (owner, relay, caller, agents)."""
    owner = local_coordinator
    caller = DirectCaller(owner.coordinator)
    handle = PushHandle()
    target = (lambda: (handle, "node-a")) if request.param != "poll" else (lambda: None)
    over_socket = request.param == "socket"
    relay = owner.run(
        lambda: NodeRelay("node-a", caller, push_target=target, serve_socket=over_socket)
    )
    handle.relay = relay
    find: Any = lambda: RelayLink(relay, owner.loop)  # noqa: E731
    if over_socket:
        monkeypatch.setenv("PROFD_RELAY_SOCKET_DIR", tempfile.mkdtemp(prefix="profd-"))
        hello = asyncio.run_coroutine_threadsafe(relay.ping(), owner.loop).result(10)
        find = lambda: SocketLink(hello.socket_path)  # noqa: E731
    # untimed marks: the coordinator learns the agents' steps only from their polls (times
    # events carry steps too), so placing a next_steps window needs the relay's refresh
    agents = [
        ProfilerAgent("actor", r, 3, find_link=find, mark_times=False).start() for r in range(3)
    ]
    wait_until(lambda: all(a.connected for a in agents), 10, what="agents registered")
    if over_socket:  # each agent's poller and reporter: their own connections
        wait_until(lambda: stats(owner, relay).socket_connections >= 3, 10, 0.02, what="on it")
    yield owner, relay, caller, agents
    for a in agents:
        a.close(timeout=10)
    asyncio.run_coroutine_threadsafe(relay.close(), owner.loop).result(10)


def stats(owner: Any, relay: NodeRelay) -> Any:
    return asyncio.run_coroutine_threadsafe(relay.stats(), owner.loop).result(10)


def test_one_shared_poll_carries_the_nodes_agents_and_their_events(relayed) -> None:
    owner, relay, caller, agents = relayed
    wait_until(lambda: stats(owner, relay).parked_polls == 3, 10, 0.02, what="polls parked")
    links = lambda: {v.link for v in owner.call("list_agents")}  # noqa: E731
    wait_until(lambda: links() == {AgentLink.RELAY}, 10, 0.02, what="every poll via the relay")
    shared = "poll_many" if caller.calls.get("poll_many") else "relay_sync"
    polls_before = caller.calls.get(shared, 0)
    view = owner.call("create_session", {"steps": [3], "roles": {"actor": {"all_ranks": True}}})
    wait_until(
        lambda: all(any(w.session_id == view.session_id for w in a.plan.windows) for a in agents),
        10,
        0.02,
        what="every agent armed",
    )
    for step in range(1, 5):
        for a in agents:
            with a.step(step):
                pass
    final = wait_terminal(owner, view.session_id)
    assert final.state == "done", final.reason
    assert sorted(t.rank for t in final.traces) == [0, 1, 2]
    s = stats(owner, relay)
    # every agent's events went up in batches, and the coordinator never saw an agent's poll
    assert s.events_sent >= 6 and s.reports_sent < s.events_sent
    assert caller.calls.get("report", 0) == 0 and caller.calls.get("poll", 0) == 0
    assert caller.calls[shared] - polls_before < 20  # one shared poll (or sync) at a time
    if shared == "relay_sync":  # plans pushed: nothing parked at the coordinator (the
        # window's end is not pushed: the agents ended their parts themselves)
        assert s.pushes >= 1 and caller.calls.get("poll_many", 0) == 0


def test_next_steps_are_placed_from_fresh_steps_through_the_relay(relayed) -> None:
    owner, _, _, agents = relayed
    for step in range(1, 41):  # steps the coordinator has not been told of yet
        for a in agents:
            with a.step(step):
                pass
    view = owner.call("create_session", {"next_steps": 1, "roles": {"actor": {"all_ranks": True}}})
    assert view.steps[0] > 40, view.steps  # placed after the steps the agents are at now


@pytest.mark.parametrize("mode", ["poll", "push"])
def test_with_long_polls_a_next_steps_session_asks_the_relay_for_fresh_steps(
    tmp_path: Any, mode: str
) -> None:
    """Polls of 30 s (the agents' steps at the relay are old): the coordinator's wake-up
    reaches the relay (its shared poll returns, or a push asks it), the relay has its agents
    poll again and passes their current steps on before the window is placed."""
    from profd.actors.coordinator import ProfileCoordinator
    from profd.testing.coordinator import InProcessCoordinator

    from helpers import coordinator_settings

    settings = coordinator_settings(tmp_path, poll_timeout_s=30.0, align_timeout_s=5.0)
    owner = InProcessCoordinator(ProfileCoordinator(settings))
    handle = PushHandle()
    target = (lambda: (handle, "node-a")) if mode == "push" else (lambda: None)
    relay = owner.run(lambda: NodeRelay("node-a", DirectCaller(owner.coordinator), target))
    handle.relay = relay
    link = lambda: RelayLink(relay, owner.loop)  # noqa: E731
    agents = [
        ProfilerAgent("actor", r, 2, find_link=link, mark_times=False).start() for r in range(2)
    ]
    try:
        wait_until(lambda: stats(owner, relay).parked_polls == 2, 10, 0.02, what="parked")
        for step in range(1, 41):  # steps the coordinator has not been told of
            for a in agents:
                with a.step(step):
                    pass
        request = {"next_steps": 1, "roles": {"actor": {"all_ranks": True}}}
        view = owner.call("create_session", request)
        assert view.steps[0] > 40, view.steps
    finally:
        for a in agents:
            a.close(timeout=10)
        owner.close()


def test_a_lost_coordinator_makes_the_relays_agents_register_again(relayed) -> None:
    owner, relay, caller, agents = relayed
    wait_until(lambda: stats(owner, relay).parked_polls == 3, 10, 0.02, what="polls parked")
    caller.down = True
    wait_until(lambda: not any(a.connected for a in agents), 20, 0.05, what="agents told")
    caller.down = False
    wait_until(lambda: all(a.connected for a in agents), 30, 0.05, what="registered again")
    assert stats(owner, relay).coordinator_errors >= 1


def test_an_agent_that_closed_leaves_its_relay_and_is_not_seen_again(relayed) -> None:
    """A job that ended cleanly: its relay stops carrying its agents (they were kept, and
    each sync showed them "seen" a moment ago, minutes after their processes were gone)."""
    owner, relay, _, agents = relayed
    wait_until(lambda: stats(owner, relay).parked_polls == 3, 10, 0.02, what="polls parked")
    closed = agents[0]
    assert closed.close(timeout=10)
    wait_until(lambda: stats(owner, relay).agents == 2, 15, 0.05, what="the relay to drop it")

    def view() -> Any:
        return next(a for a in owner.call("list_agents") if a.agent_id == closed.agent_id)

    assert view().state is AgentState.CLOSED
    seen, syncs = view().last_seen_s, stats(owner, relay).shared_polls
    wait_until(lambda: stats(owner, relay).shared_polls >= syncs + 2, 15, 0.05, what="2 syncs")
    assert view().last_seen_s > seen + 0.5  # not heard from since it closed
    assert view().state is AgentState.CLOSED  # not registered again
    assert all(a.connected for a in agents[1:]) and stats(owner, relay).agents == 2


def test_a_stack_request_reaches_the_agents_behind_the_relay(relayed) -> None:
    """``profd stacks --method agent``: the request rides in the plans the relay hands out,
    the answers come back in its batches."""
    owner, relay, caller, _ = relayed
    wait_until(lambda: stats(owner, relay).parked_polls == 3, 10, 0.02, what="polls parked")
    view = owner.call("stacks", {"method": "agent", "timeout_s": 10})
    assert view.missing == []
    assert sorted(r.rank for g in view.groups for r in g.ranks) == [0, 1, 2]
    assert {r.method for g in view.groups for r in g.ranks} == {"agent"}
    assert caller.calls.get("report", 0) == 0 and caller.calls.get("report_many", 0) >= 1


def test_a_slow_coordinator_keeps_its_handle_and_a_failed_call_drops_it() -> None:
    """A call that times out keeps the relay's handle (finding the coordinator again is a
    blocking GCS lookup on the relay's loop, which a busy coordinator would make every relay
    do); a call that fails drops it, so the next finds the coordinator again by name."""
    from profd.actors.relay import RayCoordinatorCaller

    class Method:
        def __init__(self, answer: Any) -> None:
            self.answer = answer

        def remote(self, *args: Any, **kw: Any) -> Any:
            return self.answer()

    class Handle:
        def __init__(self) -> None:
            never = asyncio.Event()
            self.slow = Method(never.wait)
            self.gone = Method(self._fail)

        async def _fail(self) -> None:
            raise RuntimeError("ActorDiedError: the actor died")

    async def go() -> None:
        caller = RayCoordinatorCaller()
        handle = Handle()
        caller._handle = handle
        with pytest.raises(ConnectionError, match="no answer within"):
            await caller.call("slow", timeout=0.05)
        assert caller._handle is handle
        with pytest.raises(ConnectionError, match="ActorDiedError"):
            await caller.call("gone", timeout=5.0)
        assert caller._handle is None

    asyncio.run(go())


def test_a_relays_plain_data_crosses_ray_as_one_stdlib_pickle_and_arrives_plain() -> None:
    """The relay's calls wrap dicts and lists in Packed (cloudpickle's per-object hook is
    several times the C pickler on a node's event batch); the coordinator gets the plain
    value back from Ray's own unpickling, so its signature is unchanged; a handle (or any
    other argument) goes as it is."""
    from ray import cloudpickle

    from profd.actors.relay import RayCoordinatorCaller
    from profd.core.protocol import AgentEvent, EventKind, Packed

    sent: list[tuple[Any, ...]] = []

    class Handle:
        class report_many:  # a Ray actor method's shape
            @staticmethod
            async def remote(*args: Any) -> Any:
                sent.append(args)
                return pickle.loads(cloudpickle.dumps(args))  # what the coordinator is given

    batch = {"a": [AgentEvent(EventKind.ARMED, "s1", seq=1)]}

    async def go() -> Any:
        caller = RayCoordinatorCaller()
        caller._handle = Handle()
        return await caller.call("report_many", batch, "node-x", timeout=5.0)

    arrived = asyncio.run(go())
    assert isinstance(sent[0][0], Packed) and sent[0][1] == "node-x"
    assert arrived == (batch, "node-x")


def test_a_nodes_burst_of_events_goes_up_in_bounded_batches_each_agents_in_order(
    local_coordinator: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events queued while a batch is on its way leave in batches of at most
    MAX_BATCH_EVENTS (whole agents' lists), so a node's burst never becomes one call the
    coordinator cannot answer in time; every event arrives once, each agent's in order."""
    import dataclasses

    from profd.actors import relay_reports as relay_mod
    from profd.core.protocol import AgentEvent, EventKind, StepsMissed

    monkeypatch.setattr(relay_mod, "MAX_BATCH_EVENTS", 10)
    owner = local_coordinator

    class HeldCaller(DirectCaller):
        """The first report_many waits until released; records every batch's size."""

        def __init__(self, coordinator: Any) -> None:
            super().__init__(coordinator)
            self.sizes: list[int] = []
            self.release = asyncio.Event()

        async def call(self, method: str, *args: Any, timeout: float, **kw: Any) -> Any:
            if method == "report_many":
                self.sizes.append(sum(len(v) for v in args[0].values()))
                await self.release.wait()
            return await super().call(method, *args, timeout=timeout, **kw)

    caller = owner.run(lambda: HeldCaller(owner.coordinator))
    relay = owner.run(lambda: NodeRelay("node-a", caller, pushed=False))
    agent = ProfilerAgent("actor", 0, 4, find_link=lambda: None)
    infos = [dataclasses.replace(agent.info, agent_id=f"a{r}", rank=r) for r in range(4)]
    on_loop = lambda coro: asyncio.run_coroutine_threadsafe(coro, owner.loop).result(30)  # noqa: E731
    for info in infos:
        on_loop(relay.register(info, 0))
    missed = StepsMissed(steps=(1,))

    def events(aid: str, first: int, n: int) -> list[AgentEvent]:
        return [AgentEvent(EventKind.MISSED, "none", 1, "", missed, seq=s)
                for s in range(first, first + n)]  # fmt: skip

    async def burst() -> list[bool]:
        first = asyncio.ensure_future(relay.report("a0", events("a0", 1, 3)))
        await asyncio.sleep(0)  # the flush takes a0's events: that call is held
        rest = [relay.report(f"a{r}", events(f"a{r}", 1, 6)) for r in range(1, 4)]
        rest.append(relay.report("a0", events("a0", 4, 4)))  # a0's later ones
        waiting = [asyncio.ensure_future(c) for c in rest]
        await asyncio.sleep(0)
        caller.release.set()
        return [await first] + [await w for w in waiting]

    before = owner.call("metrics")["events_total"]
    assert on_loop(burst()) == [True] * 5
    assert caller.sizes[0] == 3 and all(n <= 10 for n in caller.sizes), caller.sizes
    assert sum(caller.sizes) == 3 + 18 + 4 and len(caller.sizes) >= 4, caller.sizes
    assert owner.call("metrics")["events_total"] - before == 25
    assert owner.call("metrics")["duplicate_events_total"] == 0  # a0's later ones not reordered


def _one_pushed_agent(owner: Any, caller: Any) -> tuple[PushHandle, NodeRelay, ProfilerAgent]:
    """A relay whose plans are pushed (calling the coordinator through ``caller``) and one
    agent behind it, started."""
    handle = PushHandle()
    relay = owner.run(lambda: NodeRelay("node-a", caller, push_target=lambda: (handle, "node-a")))
    handle.relay = relay
    link = lambda: RelayLink(relay, owner.loop)  # noqa: E731
    return handle, relay, ProfilerAgent("actor", 0, 1, find_link=link, mark_times=False).start()


def test_the_relays_handle_travels_once_until_the_coordinator_forgets_it(local_coordinator):
    """Every sync of a pushed relay used to carry its actor handle, which the coordinator
    deserialises; now only the first one does, and the next one after the coordinator forgot
    the relay (a failed push, a restart)."""
    owner = local_coordinator
    caller = DirectCaller(owner.coordinator)
    handle, _, agent = _one_pushed_agent(owner, caller)
    try:
        # polls of 1 s (the suite's settings): a resync about every second
        wait_until(lambda: caller.calls.get("relay_resync", 0) >= 3, 20, 0.05, what="resyncs")
        assert caller.calls["relay_sync"] <= 2  # the join (and an agent joining after it)
        desk = owner.coordinator._relays
        owner.run(lambda: desk._drop(desk._relays["profd_relay_node-a"]))  # as a failed push
        before = caller.calls["relay_sync"]
        wait_until(lambda: caller.calls["relay_sync"] > before, 20, 0.05, what="handle again")
        assert owner.run(lambda: desk.target_of("profd_relay_node-a")) == (handle, "node-a")
        view = owner.call("create_session", {"steps": [2], "roles": {"actor": {"all_ranks": True}}})
        wait_until(
            lambda: any(w.session_id == view.session_id for w in agent.plan.windows),
            10, 0.02, what="a plan pushed through the relay it knows again",
        )  # fmt: skip
    finally:
        agent.close(timeout=10)


def test_an_older_coordinator_without_resync_gets_the_handle_every_time(local_coordinator):
    owner = local_coordinator

    class OlderCaller(DirectCaller):
        async def call(self, method: str, *args: Any, timeout: float, **kw: Any) -> Any:
            if method == "relay_resync":
                self.calls[method] = self.calls.get(method, 0) + 1
                raise ConnectionError("relay_resync: AttributeError") from AttributeError(method)
            return await super().call(method, *args, timeout=timeout, **kw)

    caller = OlderCaller(owner.coordinator)
    _, relay, agent = _one_pushed_agent(owner, caller)
    try:
        wait_until(lambda: caller.calls.get("relay_sync", 0) >= 4, 20, 0.05, what="syncs")
        assert caller.calls.get("relay_resync", 0) == 1  # tried once, then never again
        assert stats(owner, relay).coordinator_errors == 0  # not taken for a lost coordinator
        assert agent.connected
    finally:
        agent.close(timeout=10)


def test_a_wake_up_sends_only_the_woken_agents_around_again(tmp_path: Any) -> None:
    """A ``next_steps`` session on one rank asks the relay for that agent's step: its poll
    is released and sent again; its neighbours stay parked (polls of 30 s here)."""
    from collections import Counter

    from profd.actors.coordinator import ProfileCoordinator
    from profd.testing.coordinator import InProcessCoordinator

    from helpers import coordinator_settings

    owner = InProcessCoordinator(
        ProfileCoordinator(coordinator_settings(tmp_path, poll_timeout_s=30.0))
    )
    handle = PushHandle()
    relay = owner.run(
        lambda: NodeRelay("node-a", DirectCaller(owner.coordinator), lambda: (handle, "node-a"))
    )
    handle.relay = relay
    polls: Counter[str] = Counter()

    class CountingLink(RelayLink):
        def poll(self, agent_id, version, step, timeout):
            polls[agent_id] += 1
            return super().poll(agent_id, version, step, timeout)

    agents = [
        ProfilerAgent(
            "actor", r, 3, find_link=lambda: CountingLink(relay, owner.loop), mark_times=False
        ).start()
        for r in range(3)
    ]
    try:
        wait_until(lambda: stats(owner, relay).parked_polls == 3, 10, 0.02, what="parked")
        ids = [a.info.agent_id for a in agents]
        before = dict(polls)
        owner.run(lambda: asyncio.ensure_future(relay.push("node-a", {}, [ids[0]])))
        wait_until(lambda: polls[ids[0]] > before[ids[0]], 10, 0.02, what="rank 0 polls again")
        wait_until(lambda: stats(owner, relay).parked_polls == 3, 10, 0.02, what="parked again")
        assert [polls[i] - before[i] for i in ids[1:]] == [0, 0]  # its neighbours stayed
        owner.run(lambda: asyncio.ensure_future(relay.push("node-a", {}, True)))  # older one
        wait_until(lambda: all(polls[i] > before[i] for i in ids), 10, 0.02, what="all again")
    finally:
        for a in agents:
            a.close(timeout=10)
        owner.close()


def test_a_driver_step_counts_as_delivered_only_once_the_agent_holds_it(local_coordinator):
    """A driver's step announcement returns once every profiled agent holds the step. A
    relay used to count as the agent: the push was acknowledged when the relay had the plan,
    before the agent did, and the step's first worker call could run unrecorded (the first
    stage missing from a traced step, under load)."""
    import threading

    owner = local_coordinator
    caller = DirectCaller(owner.coordinator)
    handle = PushHandle()
    relay = owner.run(lambda: NodeRelay("node-a", caller, push_target=lambda: (handle, "node-a")))
    handle.relay = relay
    gate = threading.Event()  # while closed, the agent gets no plan that names a step
    gate.set()

    class SlowAgentLink(RelayLink):
        def poll(self, agent_id, version, step, timeout):
            reply = super().poll(agent_id, version, step, timeout)
            if reply.plan is not None and reply.plan.controller_step is not None:
                gate.wait(30)  # the agent's process is slow to take it
            return reply

    agent = ProfilerAgent(
        "actor", 0, 1, find_link=lambda: SlowAgentLink(relay, owner.loop), mark_times=False
    ).start()
    try:
        wait_until(lambda: agent.connected, 10, what="agent registered")
        links = lambda: {v.link for v in owner.call("list_agents")}  # noqa: E731
        wait_until(lambda: links() == {AgentLink.RELAY}, 10, 0.02, what="polls via the relay")
        view = owner.call("create_session", {"steps": [3], "roles": {"actor": {"all_ranks": True}}})
        wait_until(
            lambda: any(w.session_id == view.session_id for w in agent.plan.windows),
            10, 0.02, what="the agent armed",
        )  # fmt: skip
        gate.clear()
        ack = owner.call("controller_step", 1, 1.0)
        assert ack.agents == 1 and ack.slow == (agent.agent_id,)  # the relay has it; not the agent
        assert agent.plan.controller_step is None
        gate.set()
        wait_until(lambda: agent.plan.controller_step == 1, 10, 0.02, what="step 1 taken")
        ack = owner.call("controller_step", 2, 5.0)
        assert ack.slow == ()
        assert agent.plan.controller_step == 2  # held before the driver's call returned
    finally:
        gate.set()
        agent.close(timeout=10)
