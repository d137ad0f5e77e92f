"""A session as the CLI shows it: its progress bar, the wait for its end, its outcome line."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from rich.table import Table

from profd.actors.selection import rank_ranges
from profd.cli.client import EXIT_UNREACHABLE, ApiClient, CliError
from profd.cli.common import (
    console,
    err_console,
)
from profd.core.states import PartState, SessionState

#: How each way a session ends looks: only ``done`` is green.
STATE_STYLE = {
    "done": "green",
    "partial": "yellow",
    "cancelled": "yellow",
    "expired": "red",
    "failed": "red",
}


def progress_of(view: dict[str, Any]) -> tuple[int, int, str]:
    """What the bar shows: (done, total, label): steps recorded of steps planned (a timed
    session: targets whose window wrote traces, of all); the session's ``progress``, or
    finished targets from a sidecar that does not report it."""
    p = view.get("progress")
    if p is None:
        n = len(view["targets"])
        done = sum(1 for t in view["targets"] if PartState(t["state"]).is_terminal)
        return done, n, f"{done}/{n} targets finished"
    if p["planned_steps"]:
        done, total = p["recorded_steps"], p["planned_steps"]
        label = f"{done}/{total} steps recorded"
        if p["missed_steps"]:
            label += f", {p['missed_steps']} missed"
        return done, total, label
    total = p["targets"]
    done = round(p["fraction"] * total)
    return done, total, f"{done}/{total} targets wrote traces"


def bar_text(done: int, total: int, width: int = 20) -> str:
    """A bar in plain characters (readable without colour); full only when done == total."""
    filled = (width * min(done, total)) // total if total > 0 else 0
    if done < total:
        filled = min(filled, width - 1)
    return "█" * filled + "░" * (width - filled)


#: How long ``--wait`` rides out a sidecar that does not answer (restarted by `profd up`,
#: or its coordinator restarting) before it gives up waiting; the session goes on anyway.
UNREACHABLE_GRACE_S = 120.0


def wait_session(
    api: ApiClient, view: dict[str, Any], timeout: float, quiet: bool
) -> dict[str, Any]:
    from rich.progress import BarColumn, Progress, TextColumn

    sid = view["session_id"]
    deadline = time.monotonic() + timeout
    if not quiet:  # the bar goes away: the session's name stays, to come back to it
        err_console.print(
            f"session {sid}: {len(view['targets'])} target(s); waiting for its end "
            "(Ctrl-C stops the wait, not the session)",
            markup=False,
            highlight=False,
        )
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=20),
        TextColumn("{task.fields[label]}"),
        TextColumn("{task.fields[state]}"),
        console=err_console,
        disable=quiet,
        transient=True,
    ) as bar:
        done, total, label = progress_of(view)
        task = bar.add_task(
            f"session {sid}", total=max(1, total), completed=done, label=label, state=""
        )
        poll = _SessionPoll(api, sid, quiet)
        stall = StallWatch(api, view)
        while not SessionState(view["state"]).is_terminal:
            if time.monotonic() > deadline:
                raise CliError(
                    f"session {sid} still {view['state']} after {timeout:.0f} s; it goes on "
                    f"(`profd cancel {sid}` ends it)"
                )
            time.sleep(0.5)  # the poll interval of a person's command, not a test's wait
            view = poll.next() or view
            if not quiet and (hint := stall.check(view)):
                bar.console.print(hint, markup=False, highlight=False)
            done, total, label = progress_of(view)
            bar.update(task, total=max(1, total), completed=done, label=label, state=view["state"])
    return view


#: Target states whose window is open or being written: a cancel flushes it into a trace.
WRITING_STATES = frozenset({"recording", "collecting"})


def writing_targets(view: dict[str, Any]) -> dict[str, int]:
    """The targets whose window is open or being written, with their traces so far."""
    targets = view["targets"]
    return {t["agent_id"]: len(t["traces"]) for t in targets if t["state"] in WRITING_STATES}


def settle_cancelled(
    api: ApiClient, view: dict[str, Any], writing: dict[str, int], timeout: float, quiet: bool
) -> tuple[dict[str, Any], list[str]]:
    """A cancelled session once each target that was writing when it was cancelled
    (``writing``: their traces then) wrote one more trace (a cancel flushes an open window;
    the agent does it at its next step or stage mark) or said it is done (``agent_done``: a
    window with nothing to flush), or ``timeout`` passed; and the targets still writing."""
    sid = view["session_id"]
    deadline = time.monotonic() + timeout
    left = _still_writing(view, writing)
    if left and not quiet and timeout > 0:
        err_console.print(
            f"waiting up to {timeout:g} s for the last traces of {len(left)} target(s) that "
            "were recording (the cancel flushes them)",
            markup=False,
            highlight=False,
        )
    while left and time.monotonic() < deadline:
        time.sleep(0.5)  # the poll interval of a person's command
        try:
            view = api.get(f"/api/v1/sessions/{quote(sid, safe='')}")
        except CliError:
            break  # the cancel stands; the outcome line says what arrived
        left = _still_writing(view, writing)
    return view, sorted(left)


def _still_writing(view: dict[str, Any], writing: dict[str, int]) -> dict[str, int]:
    now = {t["agent_id"]: t for t in view["targets"]}

    def settled(aid: str, had: int) -> bool:
        t = now.get(aid)
        return t is None or len(t["traces"]) > had or bool(t.get("agent_done"))

    return {a: n for a, n in writing.items() if not settled(a, n)}


#: While a session waits for its window, ``--wait`` reads its targets' steps this often...
STALL_CHECK_S = 15.0
#: ...and says once when none of them began a step for this long. profd does not end such a
#: session (it does not guess how long a step may take); the hint says what to look at.
STALL_WARN_S = 120.0
#: ... or for this many of the slowest target's median step, when that is longer.
STALL_STEPS = 5


class StallWatch:
    """Notices a session waiting for steps its job does not reach: no target began a step
    for :data:`STALL_WARN_S` (or :data:`STALL_STEPS` of its slowest target's median steps)
    while the window is still ahead (a hung job, a paused loop)."""

    def __init__(
        self, api: ApiClient, view: dict[str, Any], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.api, self.clock = api, clock
        self.steps: dict[str, int | None] | None = None
        self.since = self.next_check = clock()
        self.said = False

    def check(self, view: dict[str, Any]) -> str | None:
        """The hint, once, when the targets' steps stood still long enough; else ``None``."""
        now = self.clock()
        waiting = view["state"] in (SessionState.PENDING, SessionState.ARMED) and view["steps"]
        if self.said or not waiting or now < self.next_check:
            return None
        self.next_check = now + STALL_CHECK_S
        try:
            agents = self.api.get("/api/v1/agents")["data"]
        except CliError:  # the wait itself says when the sidecar is away
            return None
        targets = {t["agent_id"] for t in view["targets"]}  # a launch-time one's grow
        mine = [a for a in agents if a["agent_id"] in targets]
        steps = {a["agent_id"]: a["current_step"] for a in mine}
        if steps != self.steps:
            self.steps, self.since = steps, now
            return None
        # RL steps can take minutes: a stall is a while longer than the slowest one's steps
        medians = [a.get("median_step_s") or 0.0 for a in mine]
        if now - self.since < max(STALL_WARN_S, STALL_STEPS * max(medians, default=0.0)):
            return None
        self.said = True
        known = sorted({s for s in steps.values() if s is not None})
        at = (
            f"at step {known[-1]}"
            if len(known) == 1
            else (f"at steps {known[0]}..{known[-1]}" if known else "at no known step")
        )
        first = view["steps"][0]
        return (
            f"  no target has begun a new step for {now - self.since:.0f} s ({at}; the window "
            f"starts at step {first}): is the job stuck? `profd stacks` shows where its ranks "
            f"wait; `profd cancel {view['session_id']}` ends the session"
        )


class _SessionPoll:
    """One read of the session per call: ``None`` while the sidecar does not answer (said
    once), for up to :data:`UNREACHABLE_GRACE_S` in a row; then the failure, naming the
    session."""

    def __init__(self, api: ApiClient, sid: str, quiet: bool) -> None:
        self.api, self.sid, self.quiet = api, sid, quiet
        self.down_since: float | None = None

    def next(self) -> dict[str, Any] | None:
        try:
            view = self.api.get(f"/api/v1/sessions/{self.sid}")
        except CliError as exc:
            if exc.exit_code != EXIT_UNREACHABLE and exc.status != 503:
                raise
            now = time.monotonic()
            if self.down_since is None:
                self.down_since = now
                if not self.quiet:
                    err_console.print(
                        f"  {exc}; waiting for it (up to {UNREACHABLE_GRACE_S:.0f} s)",
                        markup=False,
                        highlight=False,
                    )
            if now - self.down_since > UNREACHABLE_GRACE_S:
                raise CliError(
                    f"{exc}; stopped waiting for session {self.sid}, which goes on "
                    f"(`profd sessions` shows it)",
                    exc.exit_code,
                    exc.status,
                ) from None
            return None
        if self.down_since is not None and not self.quiet:
            err_console.print("  profd answers again", markup=False, highlight=False)
        self.down_since = None
        return view


def print_outcome(view: dict[str, Any], details: bool = False) -> None:
    """The session's state in one line: the state word in its colour, a bar that is full
    only when everything planned was recorded, and how much was; with ``details``, why and
    where its traces are."""
    from rich.markup import escape

    state = view["state"]
    style = STATE_STYLE.get(state, "cyan")
    done, total, label = progress_of(view)
    console.print(
        f"session {escape(view['session_id'])} [bold {style}]{state.upper()}[/bold {style}] "
        f"[{style}]{bar_text(done, total)}[/{style}] {escape(label)}",
        highlight=False,
    )
    if details:
        n = len(view.get("traces") or ())
        console.print(f"  {view['reason'] or state}", markup=False, highlight=False)
        console.print(f"  {n} trace(s) in {view['save_dir']}", markup=False, highlight=False)
        _print_warnings(view)


def _print_warnings(view: dict[str, Any]) -> None:
    warnings = view.get("warnings") or []
    for w in warnings[:MAX_WARNINGS_SHOWN]:
        console.print(f"  warning: {w}", style="yellow", markup=False, highlight=False)
    if len(warnings) > MAX_WARNINGS_SHOWN:
        more = len(warnings) - MAX_WARNINGS_SHOWN
        console.print(f"  ... {more} more warning(s) (--json lists each one)", markup=False)


def print_session(view: dict[str, Any]) -> None:
    style = STATE_STYLE.get(view["state"], "cyan")
    console.print(
        f"session [bold]{view['session_id']}[/bold] [{style}]{view['state']}[/{style}]: "
        f"{view['reason']}"
    )
    duration = (view.get("request") or {}).get("duration_s")
    window = f"for {duration:g} s" if duration is not None else f"steps {view['steps']}"
    console.print(f"  tool {view['tool']}, {window}, dir {view['save_dir']}")
    targets = view["targets"]
    if len(targets) <= MAX_TARGET_ROWS:
        console.print(_target_rows(targets))
    else:
        console.print(_target_groups(targets))
        console.print(f"  {len(targets)} targets, grouped (--json lists each one)")
    for ig in view["ignored"]:
        rank = "" if ig["rank"] is None else f" rank {ig['rank']}"
        console.print(f"  ignored {ig['role']}{rank}: {ig['reason']}")
    _print_warnings(view)


#: A session's warnings shown after its outcome (a fleet's can be one per rank).
MAX_WARNINGS_SHOWN = 5

#: Up to this many targets get a row each; more (a fleet-wide session: thousands) are
#: grouped by role, block, state and reason, their ranks as ranges.
MAX_TARGET_ROWS = 32


def _target_rows(targets: list[dict[str, Any]]) -> Table:
    table = Table(title="Targets")
    for col in ("role", "rank", "block", "state", "recorded", "missed", "reason"):
        table.add_column(col, overflow="fold")
    for t in targets:
        table.add_row(
            t["role"],
            str(t["rank"]),
            t["role_block"],
            t["state"],
            str(t["recorded_steps"]),
            str(t["missed_steps"]),
            t["reason"],
        )
    return table


def _target_groups(targets: list[dict[str, Any]]) -> Table:
    groups: dict[tuple[str, str, str, str], list[int]] = {}
    for t in targets:
        key = (t["role"], t["role_block"], t["state"], t["reason"] or "")
        groups.setdefault(key, []).append(t["rank"])
    table = Table(title="Targets")
    for col in ("role", "ranks", "count", "block", "state", "reason"):
        table.add_column(col, overflow="fold")
    for (role, block, state, reason), ranks in sorted(groups.items(), key=lambda g: g[0]):
        table.add_row(role, rank_ranges(ranks), str(len(ranks)), block, state, reason)
    return table
