"""What the coordinator's store keeps of a trigger, and how a restarted coordinator reads
it back into its :class:`~profd.actors.trigger_book.TriggerBook` (pure: no Ray).

A trigger is kept as its id, request and creation time, the firing that is due, those that
failed and the highest firing number given. Its fired firings are not kept here: they are
the restored sessions whose ``origin`` names the trigger.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from profd.actors.trigger_book import FiringState, Trigger, TriggerBook, saved_firing
from profd.core.trigger_request import TriggerRequest

if TYPE_CHECKING:
    from profd.actors.sessions import Session

__all__ = ["restore_triggers", "saved_trigger"]

log = logging.getLogger(__name__)


def saved_trigger(t: Trigger) -> dict[str, Any]:
    """The row the store keeps of ``t`` (:func:`restore_triggers` reads it)."""
    numbers = [int(n) for f in t.firings if (n := f.firing_id.rpartition(".")[2]).isdigit()]
    failed = [saved_firing(f) for f in t.firings if f.state is FiringState.FAILED]
    return {
        "trigger_id": t.trigger_id,
        "request": t.request.model_dump(mode="json"),
        "created_at": t.created_at,
        **({"due": saved_firing(t.due)} if t.due is not None else {}),
        **({"failed": failed} if failed else {}),  # no session brings them back
        **({"numbered_to": max(numbers)} if numbers else {}),  # never given again
    }


def restore_triggers(
    book: TriggerBook, saved: Iterable[dict[str, Any]], sessions: Iterable[Session], now: float
) -> dict[str, list[str]]:
    """Put the saved triggers back into ``book``: trigger id -> the ids of the sessions it
    started (of ``sessions``, oldest first), which are its firings again. A row this version
    cannot read is logged and skipped. A firing that was due is due again, unless its
    session was made (then it fired)."""
    saved = list(saved)
    started: dict[str, list[Session]] = {}
    for s in sessions:
        tid = (s.origin or {}).get("trigger_id")
        if isinstance(tid, str):
            started.setdefault(tid, []).append(s)
    made = {
        str(s.origin["firing_id"])
        for own in started.values()
        for s in own
        if s.origin and isinstance(s.origin.get("firing_id"), str)
    }
    # every number a firing had (a failed one's is kept only among the newest)
    due_ids = [str(d.get("firing_id")) for r in saved if isinstance(d := r.get("due"), dict)]
    seen = [f"{r.get('trigger_id')}.{r.get('numbered_to')}" for r in saved]
    book.number_after([*made, *due_ids, *seen])
    restored: dict[str, list[str]] = {}
    for row in saved:
        try:
            request = TriggerRequest.model_validate(row["request"])
            created_at = float(row.get("created_at") or now)
            t = book.add(request, trigger_id=str(row["trigger_id"]))
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("a saved trigger could not be restored (%s): %r", exc, row)
            continue
        t.created_at = created_at
        own = sorted(started.get(t.trigger_id, ()), key=lambda s: s.created_at)
        restored[t.trigger_id] = [s.session_id for s in own]
        book.recall(t.trigger_id, [(s.created_at, s.session_id, s.origin or {}) for s in own])
        failed = row.get("failed")
        failed = failed if isinstance(failed, list) else []
        failed = [f for f in failed if not (isinstance(f, dict) and f.get("firing_id") in made)]
        book.recall_failed(t.trigger_id, failed)  # (one whose session was made: it fired)
        due = row.get("due")
        waiting = isinstance(due, dict) and due.get("firing_id") not in made
        if waiting and book.recall_due(t.trigger_id, due) is not None:
            log.info("trigger %s: firing %s is due again", t.trigger_id, due["firing_id"])
    return restored
