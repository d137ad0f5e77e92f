"""The agent-to-relay hop over the relay's Unix socket (profd.core.relay_wire,
profd.actors.relay_socket, profd.agent.relay_link.SocketLink): a real NodeRelay on its own
event-loop thread serving a real socket, agents' links calling it from their threads.
(test_relay.py runs the relay's whole story over it with a real coordinator; the e2e relay
test runs it between Ray processes.)"""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from profd.actors.agent_desk import Registration
from profd.actors.relay import NodeRelay
from profd.actors.relay_socket import clear_stale_sockets
from profd.agent.channel import LinkDown
from profd.agent.relay_link import RelayLink, SocketLink, relay_link
from profd.core.protocol import (
    EMPTY_PLAN,
    AgentEvent,
    AgentInfo,
    AgentPlan,
    EventKind,
    PollReply,
)
from profd.core.relay_wire import RelayHello, WireError, decode, encode, socket_dir, socket_path

from helpers import wait_until


class Coordinator:
    """What the relay calls: registrations, syncs and event batches (recorded)."""

    def __init__(self) -> None:
        self.batches: list[dict[str, list[AgentEvent]]] = []
        self.down = False

    async def call(self, method: str, *args: Any, timeout: float, **kw: Any) -> Any:
        if self.down:
            raise ConnectionError("coordinator down")
        if method == "register":
            return Registration(EMPTY_PLAN, 5.0)
        if method in ("relay_sync", "relay_resync"):
            return {}
        if method == "report_many":
            self.batches.append(args[0])
            return dict.fromkeys(args[0], True)
        if method == "clock_ns":
            return time.time_ns()
        raise AssertionError(method)


class Relay:
    """A NodeRelay serving its socket on a loop thread of its own."""

    def __init__(self, directory: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.coordinator = Coordinator()
        self.relay = self.run(
            self._make, NodeRelay, "node-a", self.coordinator, lambda: (object(), "node-a")
        )
        self.hello: RelayHello = self.run(self.relay.ping)
        self.directory = directory

    async def _make(self, cls: type, *args: Any) -> Any:
        return cls(*args)

    def run(self, fn: Any, *args: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(fn(*args), self.loop).result(10)

    def stats(self) -> Any:
        return self.run(self.relay.stats)

    def push(self, agent_id: str, plan: AgentPlan) -> None:
        asyncio.run_coroutine_threadsafe(
            self.relay.push("node-a", {agent_id: PollReply(plan=plan)}, False), self.loop
        )

    def close(self) -> None:
        self.run(self.relay.close)
        self.run(self._cancel_tasks)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    async def _cancel_tasks(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
def relay(monkeypatch) -> Iterator[Relay]:
    directory = tempfile.mkdtemp(prefix="profd-")  # short: a socket path has ~100 bytes
    monkeypatch.setenv("PROFD_RELAY_SOCKET_DIR", directory)
    r = Relay(directory)
    yield r
    r.close()
    shutil.rmtree(directory, ignore_errors=True)


def info(agent_id: str = "a0") -> AgentInfo:
    return AgentInfo(agent_id, "actor", 0, 1, {}, "host", os.getpid(), node_id="node-a")


def raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    return s


def closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_an_agents_calls_cross_the_socket_and_a_pushed_plan_ends_its_poll(relay) -> None:
    assert relay.hello.socket_path and relay.hello.socket_path.startswith(relay.directory)
    assert os.stat(relay.hello.socket_path).st_mode & 0o777 == 0o600
    link = SocketLink(relay.hello.socket_path)
    assert link.register(info(), 3).plan == EMPTY_PLAN
    plan = AgentPlan(version=7, controller_step=12)
    got: list[PollReply] = []
    poller = threading.Thread(target=lambda: got.append(link.poll("a0", 0, 3, 30.0)))
    poller.start()
    wait_until(lambda: relay.stats().parked_polls == 1, 10, 0.01, what="the poll parked")
    relay.push("a0", plan)
    poller.join(10)
    assert got == [PollReply(plan=plan)]  # long before the poll's 30 s
    # the reporter's thread holds a connection of its own: a report while a poll is parked
    poller = threading.Thread(target=lambda: link.poll("a0", 7, 3, 30.0), daemon=True)
    poller.start()
    wait_until(lambda: relay.stats().parked_polls == 1, 10, 0.01, what="parked again")
    ev = AgentEvent(EventKind.ARMED, "s1", None, seq=1)
    assert link.report("a0", [ev]) is True
    assert relay.coordinator.batches == [{"a0": [ev]}]
    assert abs(link.clock_ns() - time.time_ns()) < 5e9
    # two connections: this thread's, and the poller's (the first poller's, whose thread
    # ended, closed when the second connected)
    wait_until(lambda: relay.stats().socket_connections == 2, 10, 0.01, what="two")
    link.close()  # the poll in flight ends first, then its connection closes too
    relay.push("a0", AgentPlan(version=8))
    poller.join(10)
    wait_until(lambda: relay.stats().socket_connections == 0, 10, 0.01, what="closed")
    with pytest.raises(LinkDown):
        link.ping()


def test_a_relay_going_away_mid_poll_is_link_down_at_once(relay) -> None:
    link = SocketLink(relay.hello.socket_path)
    link.register(info(), 0)
    errors: list[BaseException] = []

    def poll() -> None:
        try:
            link.poll("a0", 0, 0, 60.0)
        except LinkDown as exc:
            errors.append(exc)

    poller = threading.Thread(target=poll)
    poller.start()
    wait_until(lambda: relay.stats().parked_polls == 1, 10, 0.01, what="the poll parked")
    t0 = time.monotonic()
    relay.run(relay.relay.close)  # as a relay process dying closes its end
    poller.join(10)
    assert errors and time.monotonic() - t0 < 5, errors  # not the poll's 60 s
    assert not os.path.exists(relay.hello.socket_path)
    with pytest.raises(LinkDown):
        link.register(info(), 0)  # nothing to connect to: down, so the agent goes direct


def test_the_relays_own_failure_is_link_down_and_the_connection_stays_usable(relay) -> None:
    link = SocketLink(relay.hello.socket_path)
    relay.coordinator.down = True
    with pytest.raises(LinkDown, match="coordinator down"):
        link.register(info(), 0)
    relay.coordinator.down = False
    assert link.register(info(), 0).poll_timeout_s == 5.0
    assert relay.stats().socket_connections == 1  # the same connection, still in step


def test_what_is_not_a_call_closes_only_that_connection_and_runs_nothing(relay) -> None:
    path = relay.hello.socket_path
    marker = Path(relay.directory) / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    cases = {
        "a function": encode(("ping", (Evil(),))),
        "garbage": struct.pack("!I", 8) + b"\x00garbage",
        "a frame over the limit": struct.pack("!I", 2**31),
    }
    for what, frame in cases.items():
        s = raw(path)
        s.sendall(frame)
        assert closed_by_peer(s), what
        s.close()
    assert not marker.exists()
    s = raw(path)  # an unknown method is answered, not run
    s.sendall(encode(("push", ("node-a", {}, True))))
    n = struct.unpack("!I", s.recv(4))[0]
    ok, why = decode(s.recv(n))
    assert not ok and "unknown call 'push'" in why
    s.close()
    assert SocketLink(path).ping() == relay.hello  # and it serves on


def test_frames_refuse_what_is_not_a_profd_message() -> None:
    body = pickle.dumps(("ping", (print,)))
    with pytest.raises(WireError, match="not a profd message"):
        decode(body)
    with pytest.raises(WireError, match="not a profd message"):
        decode(pickle.dumps(("ping", (threading.Thread,))))
    assert decode(encode(("register", (info(), 3)))[4:]) == ("register", (info(), 3))


def test_a_socket_directory_others_can_open_is_refused_and_agents_call_by_ray(
    monkeypatch,
) -> None:
    base = Path(tempfile.mkdtemp(prefix="profd-"))
    try:
        open_dir = base / "open"
        open_dir.mkdir(mode=0o777)
        os.chmod(open_dir, 0o777)
        monkeypatch.setenv("PROFD_RELAY_SOCKET_DIR", str(open_dir))
        with pytest.raises(PermissionError, match="open to other users"):
            socket_dir()
        (base / "link").symlink_to(base / "elsewhere")
        (base / "elsewhere").mkdir(mode=0o700)
        monkeypatch.setenv("PROFD_RELAY_SOCKET_DIR", str(base / "link"))
        with pytest.raises(PermissionError, match="not a directory"):
            socket_dir()
        loop = asyncio.new_event_loop()
        try:
            hello = loop.run_until_complete(NodeRelay("node-a", Coordinator()).ping())
        finally:
            loop.close()
        assert hello == RelayHello(None)
        assert not list(open_dir.iterdir()) and not list((base / "elsewhere").iterdir())
        assert isinstance(relay_link(object(), hello), RelayLink)
        assert isinstance(relay_link(object(), "ok"), RelayLink)  # a relay of an older profd
        gone = RelayHello(str(base / "relay-gone-1.sock"))  # a path this process cannot reach
        assert isinstance(relay_link(object(), gone), RelayLink)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_sockets_of_relays_that_are_gone_are_cleared() -> None:
    base = Path(tempfile.mkdtemp(prefix="profd-"))
    try:
        dead = subprocess_pid_that_ended()
        stale = socket_path(base, "node-x", dead)
        live = socket_path(base, "node-y", os.getppid())
        other = base / "notes.txt"
        for p in (stale, live, other):
            p.write_text("")
        assert clear_stale_sockets(base) == [stale]
        assert sorted(p.name for p in base.iterdir()) == sorted([live.name, other.name])
    finally:
        shutil.rmtree(base, ignore_errors=True)


def subprocess_pid_that_ended() -> int:
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid
