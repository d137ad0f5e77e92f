"""How an agent reaches the coordinator on a cluster: through its node's relay.

:class:`NodeLinkFinder` is the agent's default ``find_link`` inside Ray. It returns a link to
the node's relay (:mod:`profd.actors.relay`, started here when the node has none yet), or,
when the relay cannot be had, a direct link to the coordinator. A direct link checks every
``retry_s`` whether the relay is back (starting it again if it is gone for good) and then
raises :class:`LinkMoved`, so the channel re-registers through the relay. A relay failing in
the middle of a call is a :class:`~profd.agent.channel.LinkDown`: the channel asks the finder
again, which falls back to the coordinator. All of it runs on the agent's background threads.

Relays are opt-in for now: ``PROFD_RELAY=1`` in the job's environment turns them on (without
it every agent long-polls the coordinator itself); ``PROFD_RELAY_RETRY_S`` sets ``retry_s``
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
#: How long a new (or restarted) relay may take to answer its first ping.
RELAY_READY_S = 10.0
#: How long an agent waits for the relay to answer a report: two of the relay's own
#: ``report_many`` waits (``profd.actors.relay.REPORT_TIMEOUT_S``), and a little more.
RELAY_REPORT_WAIT_S = 65.0


def relays_enabled() -> bool:
    """``PROFD_RELAY`` is set to a true value (1, true, yes, on)."""
    return os.environ.get("PROFD_RELAY", "0").strip().lower() in ("1", "true", "yes", "on")


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
    :class:`LinkMoved` from :meth:`poll` once it is."""

    kind = "direct"

    def __init__(self, link: CoordinatorLink, relay_back: Callable[[], bool], retry_s: float):
        self._link = link
        self._relay_back = relay_back
        self._retry_s = retry_s
        self._next_check = time.monotonic() + retry_s

    def register(self, info: AgentInfo, step: int | None) -> Registration:
        return self._link.register(info, step)

    def poll(self, agent_id: str, version: int, step: int | None, timeout: float) -> PollReply:
        if time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + self._retry_s
            if self._relay_back():
                raise LinkMoved("the node's relay is back")
        return self._link.poll(agent_id, version, step, min(timeout, self._retry_s))

    def report(self, agent_id: str, events: list[AgentEvent]) -> bool:
        return self._link.report(agent_id, events)

    def clock_ns(self) -> int:
        return self._link.clock_ns()


class NodeLinkFinder:
    """``find_link`` for the agents of one process (see the module docstring)."""

    def __init__(
        self,
        node_id: str | None = None,
        *,
        retry_s: float | None = None,
        find_direct: Callable[[], CoordinatorLink | None] = find_ray_link,
        get_relay: Callable[[str], Any] | None = None,
    ) -> None:
        self._node_id = node_id
        self._retry_s = retry_s or float(os.environ.get("PROFD_RELAY_RETRY_S", RELAY_RETRY_S))
        self._find_direct = find_direct
        self._get_relay = get_relay
        self._warned = False

    def __call__(self) -> CoordinatorLink | None:
        direct = self._find_direct()
        if direct is None:
            return None  # no coordinator: nothing to relay to
        relay = self._relay()
        if relay is not None:
            return RelayLink(relay)
        return DirectLink(direct, lambda: self._relay() is not None, self._retry_s)

    def _relay(self) -> Any | None:
        """The node's relay answering a ping (started when missing), or None."""
        import ray

        try:
            node = self._node_id or ray.get_runtime_context().get_node_id()
            handle = (self._get_relay or _get_or_create_relay)(node)
            ray.get(handle.ping.remote(), timeout=RELAY_READY_S)
            return handle
        except Exception as exc:  # no relay now: the coordinator directly, checked again later
            if not self._warned:
                self._warned = True
                log.warning("profd: node relay unavailable (%s); polling the coordinator", exc)
            return None


def default_link_finder() -> Callable[[], CoordinatorLink | None]:
    """An agent's ``find_link`` inside Ray: :class:`NodeLinkFinder` with ``PROFD_RELAY=1``,
    else the coordinator directly."""
    return NodeLinkFinder() if relays_enabled() else find_ray_link


def _get_or_create_relay(node_id: str) -> Any:
    from profd.actors import get_or_create_relay

    return get_or_create_relay(node_id)
