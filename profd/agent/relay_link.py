"""How an agent reaches the coordinator on a cluster: through its node's relay.

:class:`NodeLinkFinder` is the agent's default ``find_link`` inside Ray. It returns a link to
the node's relay (:mod:`profd.actors.relay`, started here when the node has none yet), or,
when the relay cannot be had, a direct link to the coordinator. The relay link is
:class:`SocketLink`, the relay's Unix socket (a Ray call costs each side about a millisecond
of CPU, and a node's agents call their relay all the time), or :class:`RelayLink`, Ray calls
to the relay, where the socket cannot be reached (a relay of an older profd, a socket
directory not shared with the relay). A direct link checks every
``retry_s`` whether the relay is back (starting it again if it is gone for good) and then
raises :class:`LinkMoved`, so the channel re-registers through the relay. A relay failing in
the middle of a call is a :class:`~profd.agent.channel.LinkDown`: the channel asks the finder
again, which falls back to the coordinator. All of it runs on the agent's background threads.

Relays are on by default; ``PROFD_RELAY=0`` in the job's environment turns them off (every
agent then long-polls the coordinator itself). ``PROFD_RELAY_RETRY_S`` sets ``retry_s``
(default 10 s).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from profd.agent.channel import (
    CoordinatorLink,
    LinkDown,
    LinkMoved,
    RayLink,
    Registration,
    find_ray_link,
)
from profd.core.protocol import AgentEvent, AgentInfo, PollReply
from profd.core.relay_wire import RelayHello, WireError, encode, recv_frame

__all__ = [
    "LinkMoved",
    "NodeLinkFinder",
    "RelayLink",
    "SocketLink",
    "default_link_finder",
    "relays_enabled",
]

log = logging.getLogger(__name__)

#: While on a direct link, how often an agent checks whether its relay is back.
RELAY_RETRY_S = 10.0
#: How long an agent waits for a relay that exists to answer before it registers with the
#: coordinator directly (the relay may be starting for another agent of the node, or being
#: restarted by Ray); it moves to the relay once the relay answers.
RELAY_READY_S = 1.0
#: When an agent that started its node's relay first checks whether it answers (then
#: twice as long each time, up to ``retry_s``); it polls the coordinator meanwhile.
RELAY_FIRST_CHECK_S = 0.5
#: The shortest long-poll a direct link sends while it waits for the relay.
MIN_POLL_S = 0.05
#: How long an agent waits for the relay to answer a report: two of the relay's own
#: ``report_many`` waits (``profd.actors.relay_reports.REPORT_TIMEOUT_S``), and a little more.
RELAY_REPORT_WAIT_S = 65.0


def relays_enabled() -> bool:
    """Relays are on unless ``PROFD_RELAY`` is set to a false value (0, false, no, off)."""
    return os.environ.get("PROFD_RELAY", "1").strip().lower() not in ("0", "false", "no", "off")


class RelayLink(RayLink):
    """:class:`~profd.agent.channel.CoordinatorLink` over the node's relay actor (the calls
    of :class:`~profd.agent.channel.RayLink`); any failure of the relay is
    :class:`LinkDown`."""

    kind = "relay"

    def report(self, agent_id: str, events: list[AgentEvent]) -> bool:
        # The relay answers once the coordinator took the node's batch, or with its own
        # failure after RELAY_REPORT_WAIT_S; a batch may wait behind another, so the agent
        # waits for two before sending again (a copy would only be dropped, after a trip).
        return self._call("report", agent_id, events, timeout=RELAY_REPORT_WAIT_S)

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        import ray

        try:
            ref = getattr(self._handle, method).remote(*args)
            return ray.get(ref, timeout=timeout or self._timeout)
        except Exception as exc:  # the relay died, restarts, or lost the coordinator
            raise LinkDown(f"relay {method}: {type(exc).__name__}") from exc


class SocketLink:
    """:class:`~profd.agent.channel.CoordinatorLink` over the relay's Unix socket
    (:mod:`profd.core.relay_wire`). Each calling thread (the channel's poller and reporter)
    holds its own connection, one call at a time; any failure of the socket, or of the relay
    behind it, is :class:`LinkDown` (a connection that failed mid-call is closed, so no late
    answer is read as the next call's)."""

    kind = "relay"

    def __init__(self, path: str, call_timeout_s: float = 30.0) -> None:
        self.path = path
        self._timeout = call_timeout_s
        self._lock = threading.Lock()
        self._socks: dict[int, tuple[threading.Thread, socket.socket]] = {}  # by thread id
        self._busy: set[int] = set()
        self._closed = False

    def register(self, info: AgentInfo, step: int | None) -> Any:
        return self._call("register", info, step)

    def poll(self, agent_id: str, version: int, step: int | None, timeout: float) -> PollReply:
        return self._call("poll", agent_id, version, step, timeout, timeout=timeout + self._timeout)

    def report(self, agent_id: str, events: list[AgentEvent]) -> bool:
        return self._call("report", agent_id, events, timeout=RELAY_REPORT_WAIT_S)

    def clock_ns(self) -> int:
        return self._call("clock_ns", timeout=5.0)

    def ping(self, timeout: float = RELAY_READY_S) -> Any:
        return self._call("ping", timeout=timeout)

    def close(self) -> None:
        """Close the connections; one in a call closes when its call returns."""
        with self._lock:
            self._closed = True
            idle = [t for t in self._socks if t not in self._busy]
            socks = [self._socks.pop(t)[1] for t in idle]
        for sock in socks:
            sock.close()

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        tid = threading.get_ident()
        try:
            sock = self._connection(tid)
            sock.settimeout(timeout or self._timeout)
            sock.sendall(encode((method, args)))
            ok, value = recv_frame(sock)
        except (OSError, WireError, ValueError) as exc:  # the relay went away, or timed out
            self._drop(tid)
            raise LinkDown(f"relay socket {method}: {type(exc).__name__}: {exc}") from exc
        finally:
            self._release(tid)
        if not ok:
            raise LinkDown(f"relay {method}: {value}")
        return value

    def _connection(self, tid: int) -> socket.socket:
        with self._lock:
            if self._closed:
                raise ConnectionAbortedError("link closed")
            self._busy.add(tid)
            held = self._socks.get(tid)
        if held is not None:
            return held[1]
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(RELAY_READY_S)
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        with self._lock:  # a thread that ended leaves its connection: closed now
            ended = [t for t, (thread, _) in self._socks.items() if not thread.is_alive()]
            old = [self._socks.pop(t)[1] for t in ended]
            self._socks[tid] = (threading.current_thread(), sock)
        for s in old:
            s.close()
        return sock

    def _drop(self, tid: int) -> None:
        with self._lock:
            held = self._socks.pop(tid, None)
        if held is not None:
            held[1].close()

    def _release(self, tid: int) -> None:
        with self._lock:
            self._busy.discard(tid)
            closing = self._closed
        if closing:
            self._drop(tid)


def relay_link(handle: Any, hello: Any) -> CoordinatorLink:
    """The link to a relay that answered ``ping`` with ``hello``: its socket when it serves
    one this process can reach (checked with a ping over it), else Ray calls to it."""
    path = hello.socket_path if isinstance(hello, RelayHello) else None
    if path:
        link = SocketLink(path)
        try:
            link.ping()
            return link
        except LinkDown as exc:
            link.close()
            log.info("profd: relay socket %s unreachable (%s); calling the relay by Ray", path, exc)
    return RelayLink(handle)


class DirectLink:
    """The coordinator itself, for as long as the relay is not there; raises
    :class:`LinkMoved` from :meth:`poll` once it is. ``relay_back`` must not block: it is
    asked between polls, first after ``first_check_s``, then twice as long each time up to
    ``retry_s`` (a relay just started is moved to within a second or two)."""

    kind = "direct"

    def __init__(
        self,
        link: CoordinatorLink,
        relay_back: Callable[[], bool],
        retry_s: float,
        first_check_s: float | None = None,
    ):
        self._link = link
        self._relay_back = relay_back
        self._retry_s = retry_s
        self._check_s = min(retry_s, first_check_s or retry_s)
        self._next_check = time.monotonic() + self._check_s

    def register(self, info: AgentInfo, step: int | None) -> Registration:
        return self._link.register(info, step)

    def poll(self, agent_id: str, version: int, step: int | None, timeout: float) -> PollReply:
        now = time.monotonic()
        if now >= self._next_check:
            if self._relay_back():
                raise LinkMoved("the node's relay is back")
            self._check_s = min(self._retry_s, self._check_s * 2)
            self._next_check = now + self._check_s
        left = max(MIN_POLL_S, self._next_check - time.monotonic())
        return self._link.poll(agent_id, version, step, min(timeout, left))

    def report(self, agent_id: str, events: list[AgentEvent]) -> bool:
        return self._link.report(agent_id, events)

    def clock_ns(self) -> int:
        return self._link.clock_ns()


def _retry_s_from_env() -> float:
    """``PROFD_RELAY_RETRY_S``; one that is not seconds > 0 is named and the default used
    (a typo in the job's environment must not stop its workers)."""
    raw = os.environ.get("PROFD_RELAY_RETRY_S")
    if raw is None:
        return RELAY_RETRY_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if value > 0 and math.isfinite(value):
        return value
    log.warning(
        "profd: PROFD_RELAY_RETRY_S=%r is not a number of seconds > 0; using %g",
        raw,
        RELAY_RETRY_S,
    )
    return RELAY_RETRY_S


class NodeLinkFinder:
    """``find_link`` for the agents of one process (see the module docstring).

    A relay already on the node is used if it answers a ping within :data:`RELAY_READY_S`.
    A node without one gets one started. Either way an agent never waits for a relay that
    is starting (for it, for another agent of the node, or after Ray restarted it): it
    registers with the coordinator directly and moves to the relay as soon as the relay
    answers the ping (checked without blocking between polls)."""

    def __init__(
        self,
        node_id: str | None = None,
        *,
        retry_s: float | None = None,
        find_direct: Callable[[], CoordinatorLink | None] = find_ray_link,
        get_relay: Callable[[str], Any] | None = None,
        find_relay: Callable[[str], Any | None] | None = None,
    ) -> None:
        self._node_id = node_id
        self._retry_s = retry_s or _retry_s_from_env()
        self._find_direct = find_direct
        self._get_relay = get_relay or _get_or_create_relay
        self._find_relay = find_relay or _find_relay
        self._ping: Any | None = None  # a ping sent to a starting relay, not answered yet
        self._warned = False

    def __call__(self) -> CoordinatorLink | None:
        direct = self._find_direct()
        if direct is None:
            return None  # no coordinator: nothing to relay to
        relay = self._existing_relay()
        if relay is not None:
            return relay_link(*relay)
        self._relay_ready()  # starts the relay (and sends it a ping) without waiting
        return DirectLink(direct, self._relay_ready, self._retry_s, RELAY_FIRST_CHECK_S)

    def _node(self) -> str:
        import ray

        return self._node_id or ray.get_runtime_context().get_node_id()

    def _existing_relay(self) -> tuple[Any, Any] | None:
        """The node's relay and its ping's answer, if it exists and answers a ping within
        :data:`RELAY_READY_S`.
        A relay that exists but does not answer in time keeps its ping pending: the direct
        link's checks watch that ping (:meth:`_relay_ready`)."""
        import ray

        try:
            handle = self._find_relay(self._node())
            if handle is None:
                return None
            ping = handle.ping.remote()
            ready, _ = ray.wait([ping], timeout=RELAY_READY_S)
            if not ready:  # starting: the coordinator directly meanwhile
                self._ping = ping
                return None
            return handle, ray.get(ping)  # raises if the relay failed
        except Exception as exc:  # gone: the coordinator directly, a new relay started
            self._ping = None
            self._warn(exc)
            return None

    def _relay_ready(self) -> bool:
        """Whether the node's relay (started when missing) answered the ping sent to it
        earlier; never waits."""
        import ray

        try:
            if self._ping is None:
                self._ping = self._get_relay(self._node()).ping.remote()
            ready, _ = ray.wait([self._ping], timeout=0)
            if not ready:
                return False
            ref, self._ping = self._ping, None
            ray.get(ref)  # raises if the relay died
            return True
        except Exception as exc:  # no relay now: asked again at the next check
            self._ping = None
            self._warn(exc)
            return False

    def _warn(self, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning("profd: node relay unavailable (%s); polling the coordinator", exc)


def default_link_finder() -> Callable[[], CoordinatorLink | None]:
    """An agent's ``find_link`` inside Ray: :class:`NodeLinkFinder`, or the coordinator
    directly with ``PROFD_RELAY=0``."""
    return NodeLinkFinder() if relays_enabled() else find_ray_link


def _get_or_create_relay(node_id: str) -> Any:
    from profd.actors import get_or_create_relay

    return get_or_create_relay(node_id)


def _find_relay(node_id: str) -> Any | None:
    from profd.actors.relay import relay_name
    from profd.core.ray_env import find_actor

    return find_actor(relay_name(node_id))
