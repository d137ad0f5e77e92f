"""Plan pushes forwarded by relays: the coordinator's Ray calls grow with the square root of
the nodes, not with the nodes.

A push is a Ray call, about a millisecond of the caller's CPU whatever it carries: at 1,250
nodes the coordinator spent seconds of its one event loop pushing a fleet's plans, one relay
after another. With many relays to push to in one pass (:data:`TREE_MIN`, the default of the
coordinator's ``relay_forward_min``; ``PROFD_RELAY_FORWARD_MIN``), the coordinator
(:class:`~profd.actors.relay_desk.RelayDesk`) splits them into groups of about ``sqrt(n)``
and pushes to one relay of each group (``push_on``), which pushes to the others of its group
at the same time as it applies its own (:func:`push_on`), on its own node, and answers with
what each holds. A forwarded push that fails is that relay's failure alone; a head that fails
has its group pushed directly by the coordinator. A relay of an older profd has no
``push_on``: found so as a head, its group is pushed directly and it heads none again (until
it syncs with a new handle); pushed to as one of a group, it answers as it always did.

No Ray import at module level (a forward's handle arrives as its bytes).
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from profd.core.protocol import Packed, PollReply

__all__ = ["FORWARD_TIMEOUT_S", "TREE_MIN", "Forward", "push_on"]

#: With at least this many relays to push to in one pass the coordinator forwards through
#: relays (below it, a push each: one hop fewer, and few enough calls).
TREE_MIN = 64
#: How long a head waits for a forwarded push: half the coordinator's own wait for the head
#: (:data:`profd.actors.relay_desk.PUSH_TIMEOUT_S`), so the head's answer says which failed
#: even when the head itself started late.
FORWARD_TIMEOUT_S = 15.0


@dataclass(frozen=True, slots=True)
class Forward:
    """A push a head relay makes for the coordinator: to the relay ``name``, reached by its
    Ray handle's bytes and ``key`` (its ``push(key, replies, refresh)``)."""

    name: str
    handle: bytes
    key: str
    replies: dict[str, PollReply]
    refresh: bool | list[str]


async def push_on(
    own: Awaitable[Any], forwards: list[Forward], timeout_s: float = FORWARD_TIMEOUT_S
) -> tuple[Any, dict[str, Any]]:
    """Await the head's own push (``own``) and push each of ``forwards``, all at once; the
    head's answer and, by relay name, each forward's answer; each failure is a string saying
    why (the head's own too: its forwards' answers still count)."""

    async def mine() -> Any:
        try:
            return await own
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    async def one(f: Forward) -> Any:
        try:
            call = pickle.loads(f.handle).push.remote(f.key, Packed(f.replies), f.refresh)
            return await asyncio.wait_for(call, timeout_s)
        except Exception as exc:  # that relay died or does not answer: its failure alone
            return f"{type(exc).__name__}: {exc}"

    answers = await asyncio.gather(mine(), *(one(f) for f in forwards))
    return answers[0], {f.name: a for f, a in zip(forwards, answers[1:], strict=True)}
