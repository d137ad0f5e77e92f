"""The coordinator's cost of a fleet's live step times, with watch triggers and without.

Every agent of a fleet sends its marks' durations about once a second (a ``times`` event:
its step time, and its stages' times with their spans in the step). With a watch trigger on
the role, the coordinator judges them: a ``step_time`` trigger against the role's rolling
median, a ``straggler`` trigger each step's stage ends across the role's ranks.

Real :class:`~profd.actors.coordinator.ProfileCoordinator` objects in this process (no Ray:
what is measured is the coordinator's own work, on its event loop and its SQLite writer),
each with its registered agents of one role on nodes of 8, state persisted to SQLite in a
temporary directory as ``profd up`` does:

* ``unwatched``: ``--agents`` agents, no trigger (the reference);
* ``watched``: ``--agents`` agents, a ``step_time`` trigger and a ``straggler`` trigger
  (stage ``update``) on the role;
* ``watched_small``: the same triggers on a tenth of the agents: how the cost of watching
  grows with the fleet (judging each report against its whole role grows with the ranks:
  quadratic a second in all).

A round is one second of each fleet: every agent's ``times`` event for one step, sent in
relays' batches (``report_many``, one node's 8 agents a call), until the coordinator has
judged them (the watched ones' trigger pass has run). The variants run interleaved, in an
order that rotates round by round. Time is this process's CPU time (``time.process_time``:
the event loop and the writer thread), per report. Medians over the rounds and their spread
are reported; ``ratio`` is the median of the per-round watched/unwatched ratios, ``growth``
of watched/watched_small. No rank is slow, so no trigger fires: this is the steady cost of
watching.

Targets (decided here; the issue sets none): the cost of watching a report does not grow
with the fleet (``growth <= 1.5`` from 1,000 to 10,000 agents), and watching at most triples
the cost of a report (``ratio <= 3``; set after the first runs measured 2.4-2.9).

    python bench/watch_scale.py [--agents 10000] [--rounds 10]

Last line: ``RESULT agents=... rounds=... watched_us=... unwatched_us=... ratio=...
ratio_range=... small_agents=... watched_small_us=... growth=... passes_per_round=...
fired=0 targets=met|missed load_start=... load=...`` (1-minute load averages).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from typing import Any

from profd.actors.coordinator import ProfileCoordinator
from profd.core.protocol import AgentEvent, AgentInfo, EventKind, LabelDurations, MarkDurations
from profd.core.request import ToolKind
from profd.core.settings import ProfdSettings

ROLE = "actor"
PER_NODE = 8
STEP_S, UPDATE_S = 0.5, 0.2
TARGET_RATIO = 3.0
TARGET_GROWTH = 1.5
TRIGGERS = (
    {"name": "slow-step", "when": {"kind": "step_time", "role": ROLE, "factor": 2.0}},
    {"name": "late-update", "when": {"kind": "straggler", "role": ROLE, "stage": "update"}},
)


class Fleet:
    """One coordinator and its registered agents."""

    def __init__(self, state_dir: str, agents: int) -> None:
        settings = ProfdSettings(poll_timeout_s=30, heartbeat_timeout_s=600).coordinator()
        self.c = ProfileCoordinator(
            settings.model_copy(update={"state_dir": state_dir, "tick_s": 3600.0})
        )
        self.agents = agents
        self.ids: list[str] = []

    async def start(self, watched: bool) -> None:
        await self.c.start()
        caps = {t.value: None for t in ToolKind}
        for r in range(self.agents):
            node = f"node{r // PER_NODE:05d}"
            info = AgentInfo(
                f"{node}-r{r}", ROLE, r, self.agents, {"local_rank": r % PER_NODE}, node,
                os.getpid(), node_id=node, node_ip="127.0.0.1", capabilities=caps,
            )  # fmt: skip
            await self.c.register(info, 0)
            self.ids.append(info.agent_id)
        for t in TRIGGERS if watched else ():
            await self.c.add_trigger(t)

    async def second(self, step: int, t0: float) -> float:
        """Every agent's ``times`` for ``step``, in relays' batches, until judged; CPU s."""
        desk = self.c._triggers
        before = getattr(desk, "passes", None)  # None: a coordinator judging at once
        cpu = time.process_time()
        for first in range(0, self.agents, PER_NODE):
            batch = {
                self.ids[r]: [AgentEvent(EventKind.TIMES, None, step, payload=times(r, step, t0))]
                for r in range(first, min(self.agents, first + PER_NODE))
            }
            await self.c.report_many(batch)
        while before is not None and len(desk.book.all()) and desk.passes == before:
            await asyncio.sleep(0.005)  # the pass runs OBSERVE_COALESCE_S after the first
        return time.process_time() - cpu

    def fired(self) -> int:
        return sum(t.fired for t in self.c._triggers.book.all())


def times(rank: int, step: int, t0: float) -> MarkDurations:
    wall = UPDATE_S + (rank % 97) * 1e-4  # spread, no outlier
    start = t0 + step * STEP_S * 2
    return MarkDurations(
        step=LabelDurations("step", (STEP_S + (rank % 89) * 1e-4,)),
        stages=(LabelDurations("update", (wall,), spans=((step, start, start + wall),)),),
    )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = {"unwatched": args.agents, "watched": args.agents, "watched_small": args.agents // 10}
    with contextlib.ExitStack() as stack:
        fleets = {
            name: Fleet(stack.enter_context(tempfile.TemporaryDirectory()), n)
            for name, n in sizes.items()
        }
        for name, f in fleets.items():
            await f.start(name != "unwatched")
        t0 = time.time()
        per: dict[str, list[float]] = {name: [] for name in fleets}
        passes0 = getattr(fleets["watched"].c._triggers, "passes", 0)
        order = list(fleets)
        # warm-up seconds: the straggler trigger's history fills, the store's first rows
        for step in range(args.warmup + args.rounds):
            turn = order[step % len(order) :] + order[: step % len(order)]
            for name in turn:
                f = fleets[name]
                cpu = await f.second(step, t0)
                if step >= args.warmup:
                    per[name].append(cpu / f.agents * 1e6)
        passes = getattr(fleets["watched"].c._triggers, "passes", 0) - passes0
        fired = fleets["watched"].fired() + fleets["watched_small"].fired()
        for f in fleets.values():
            f.c.close()
    return {
        **per,
        "ratios": [w / u for w, u in zip(per["watched"], per["unwatched"], strict=True)],
        "growths": [w / s for w, s in zip(per["watched"], per["watched_small"], strict=True)],
        "passes": passes / (args.warmup + args.rounds),
        "fired": fired,
        "small_agents": sizes["watched_small"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    out = asyncio.run(run(args))
    w, u, r, g = out["watched"], out["unwatched"], out["ratios"], out["growths"]
    for name in ("watched", "unwatched", "watched_small"):
        values = out[name]
        print(
            f"{name:14s}: {statistics.median(values):7.1f} us a report "
            f"(rounds {min(values):.1f}-{max(values):.1f})"
        )
    ratio, growth = statistics.median(r), statistics.median(g)
    met = ratio <= TARGET_RATIO and growth <= TARGET_GROWTH and out["fired"] == 0
    fields = {
        "agents": args.agents,
        "rounds": args.rounds,
        "watched_us": f"{statistics.median(w):.1f}",
        "unwatched_us": f"{statistics.median(u):.1f}",
        "ratio": f"{ratio:.2f}",
        "ratio_range": f"{min(r):.2f}-{max(r):.2f}",
        "small_agents": out["small_agents"],
        "watched_small_us": f"{statistics.median(out['watched_small']):.1f}",
        "growth": f"{growth:.2f}",
        "growth_range": f"{min(g):.2f}-{max(g):.2f}",
        "passes_per_round": f"{out['passes']:.1f}",
        "fired": out["fired"],
        "targets": "met" if met else "missed",
        "load_start": f"{load_start:.2f}",
        "load": f"{os.getloadavg()[0]:.2f}",
    }
    print("RESULT " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


if __name__ == "__main__":
    main()
