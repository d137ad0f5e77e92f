"""How an agent reaches the coordinator on a cluster: through its node's relay.

:class:`NodeLinkFinder` is the agent's default ``find_link`` inside Ray. It returns a link to
the node's relay (:mod:`profd.actors.relay`, started here when the node has none yet), or,
when the relay cannot be had, a direct link to the coordinator. A direct link checks every
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
import os
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

__all__ = ["LinkMoved", "NodeLinkFinder", "RelayLink", "default_link_finder", "relays_enabled"]

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
#: ``report_many`` waits (``profd.actors.relay.REPORT_TIMEOUT_S``), and a little more.
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
        self._retry_s = retry_s or float(os.environ.get("PROFD_RELAY_RETRY_S", RELAY_RETRY_S))
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
            return RelayLink(relay)
        self._relay_ready()  # starts the relay (and sends it a ping) without waiting
        return DirectLink(direct, self._relay_ready, self._retry_s, RELAY_FIRST_CHECK_S)

    def _node(self) -> str:
        import ray

        return self._node_id or ray.get_runtime_context().get_node_id()

    def _existing_relay(self) -> Any | None:
        """The node's relay if it exists and answers a ping within :data:`RELAY_READY_S`.
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
            ray.get(ping)  # raises if the relay failed
            return handle
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
