"""How an agent in Ray finds its link (``profd.agent.relay_link``), on the session's real Ray:
relays are on by default; an agent whose node has no relay starts one but registers with the
coordinator at once, and moves to the relay as soon as it answers; so does an agent whose
node's relay exists but is still starting (another agent of the node started it); a relay
that answers is used at once; ``PROFD_RELAY=0`` keeps every agent on the coordinator."""

from __future__ import annotations

import time
from typing import Any

import pytest

from profd.agent.channel import LinkMoved, find_ray_link
from profd.agent.relay_link import (
    RELAY_FIRST_CHECK_S,
    RELAY_READY_S,
    NodeLinkFinder,
    default_link_finder,
    relays_enabled,
)
from profd.core.protocol import PollReply

from helpers import wait_until


def _actor_classes() -> tuple[type, type]:
    """Defined here, not at module level, so Ray's workers get them by value (importing this
    module there would need the tests' ``helpers``)."""

    class Gate:
        """A Ray actor the test opens: the fake relay's ping waits for it."""

        def __init__(self) -> None:
            import asyncio

            self._open = asyncio.Event()

        async def open(self) -> None:
            self._open.set()

        async def wait(self) -> None:
            await self._open.wait()

    class SlowRelay:
        """Stands for a relay still starting: its ping answers once the gate opens, or fails."""

        def __init__(self, gate: Any, fail: bool = False) -> None:
            self._gate, self._fail = gate, fail

        async def ping(self) -> str:
            if self._fail:
                raise RuntimeError("relay broken")
            await self._gate.wait.remote()
            return "ok"

    return Gate, SlowRelay


class Coordinator:
    """The direct link: a long-poll that waits as long as it is asked to."""

    kind = "ray"

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def poll(self, agent_id: str, version: int, step: int | None, timeout: float) -> PollReply:
        self.timeouts.append(timeout)
        time.sleep(timeout)  # what a long-poll with nothing to deliver does
        return PollReply(plan=None)


def _moved(link: Any, agent_id: str) -> bool:
    """One poll of a direct link: whether it said the relay is back."""
    try:
        link.poll(agent_id, 0, None, 30.0)
    except LinkMoved:
        return True
    return False


@pytest.fixture
def relay_parts(ray_session: Any) -> Any:
    import ray

    gate_cls, relay_cls = _actor_classes()
    gate = ray.remote(gate_cls).options(num_cpus=0).remote()
    made: list[Any] = []

    def relay(fail: bool = False) -> Any:
        made.append(ray.remote(relay_cls).options(num_cpus=0).remote(gate, fail))
        return made[-1]

    yield gate, relay
    for h in [gate, *made]:
        ray.kill(h)


def test_a_node_without_a_relay_starts_one_and_moves_to_it_once_it_answers(relay_parts) -> None:
    import ray

    gate, new_relay = relay_parts
    coordinator = Coordinator()
    relay: dict[str, Any] = {}
    registered: dict[str, Any] = {}  # what Ray's names show: nothing until the test says

    def create(node: str) -> Any:
        if "handle" not in relay:
            relay["handle"] = new_relay()
        return relay["handle"]

    finder = NodeLinkFinder(
        "node-a",
        retry_s=4.0,
        find_direct=lambda: coordinator,
        get_relay=create,
        find_relay=lambda node: registered.get("handle"),
    )
    link = finder()
    assert link is not None and link.kind == "direct"  # registered at once, not waiting
    assert "handle" in relay  # the relay was started all the same
    for _ in range(3):  # the relay does not answer yet: the agent polls the coordinator
        link.poll("a", 0, None, 30.0)
    # short polls while it waits for the relay: first check after RELAY_FIRST_CHECK_S,
    # then twice as long each time
    assert coordinator.timeouts[0] <= RELAY_FIRST_CHECK_S
    assert max(coordinator.timeouts) <= 4 * RELAY_FIRST_CHECK_S

    ray.get(gate.open.remote())

    wait_until(lambda: _moved(link, "a"), 10, 0, what="the move to the relay")
    registered["handle"] = relay["handle"]
    back = finder()  # what the channel asks next: the relay, now that it answers
    assert back is not None and back.kind == "relay"


def test_a_relay_that_fails_its_ping_keeps_the_agent_direct_and_is_asked_again(
    relay_parts,
) -> None:

    _, new_relay = relay_parts
    coordinator = Coordinator()
    starts: list[Any] = []

    def create(node: str) -> Any:
        starts.append(new_relay(fail=True))
        return starts[-1]

    finder = NodeLinkFinder(
        "node-b", retry_s=1.0, find_direct=lambda: coordinator, get_relay=create,
        find_relay=lambda node: None,
    )  # fmt: skip
    link = finder()
    assert link is not None and link.kind == "direct"
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        link.poll("b", 0, None, 30.0)  # never raises LinkMoved: the relay never answers ok
    assert len(starts) >= 2  # each failed ping is followed by a new one at the next check


def test_an_existing_relay_is_used_at_once(relay_parts) -> None:
    import ray

    gate, new_relay = relay_parts
    ray.get(gate.open.remote())
    handle = new_relay()
    ray.get(handle.ping.remote(), timeout=60)  # it exists and answers (its process started)
    finder = NodeLinkFinder(
        "node-c", find_direct=lambda: Coordinator(), find_relay=lambda node: handle,
        get_relay=lambda node: pytest.fail("a relay that exists is not started again"),
    )  # fmt: skip
    link = finder()
    assert link is not None and link.kind == "relay"


def test_a_relay_another_agent_is_starting_is_not_waited_for(relay_parts) -> None:
    """The second agent of a node finds the relay the first one started, not answering yet:
    it registers directly at once (it used to wait up to 10 s, missing sessions created
    meanwhile) and moves once the relay answers, without starting another."""
    import ray

    gate, new_relay = relay_parts
    handle = new_relay()  # exists, its ping waits for the gate
    coordinator = Coordinator()
    finder = NodeLinkFinder(
        "node-d", retry_s=4.0, find_direct=lambda: coordinator, find_relay=lambda node: handle,
        get_relay=lambda node: pytest.fail("a relay that exists is not started again"),
    )  # fmt: skip
    t0 = time.monotonic()
    link = finder()
    assert link is not None and link.kind == "direct"
    assert time.monotonic() - t0 < RELAY_READY_S + 2
    link.poll("d", 0, None, 30.0)
    assert coordinator.timeouts[0] <= RELAY_FIRST_CHECK_S  # checks for the relay soon

    ray.get(gate.open.remote())

    wait_until(lambda: _moved(link, "d"), 10, 0, what="the move to the relay")
    back = finder()
    assert back is not None and back.kind == "relay"


def test_relays_are_on_unless_turned_off(monkeypatch) -> None:
    monkeypatch.delenv("PROFD_RELAY", raising=False)
    assert relays_enabled() and isinstance(default_link_finder(), NodeLinkFinder)
    for off in ("0", "false", "no", "off", " OFF "):
        monkeypatch.setenv("PROFD_RELAY", off)
        assert not relays_enabled() and default_link_finder() is find_ray_link
    monkeypatch.setenv("PROFD_RELAY", "1")
    assert relays_enabled()
