"""How soon a fleet-wide ``create_session`` gets its plans out: the coordinator's part of fan-out.

A real :class:`~profd.actors.coordinator.ProfileCoordinator` in this process (no Ray: what is
measured is the coordinator's event loop), persisting to SQLite in a temporary directory as
``profd up`` does, with ``--agents`` registered agents (default 10,000: 1,250 nodes of 8, one
Ray job). Each round one ``create_session`` targets them all; ``plans_out_ms`` is from the
call until the last plan left the coordinator, ``create_ms`` until the call returned (its
reply built). How plans leave (``--link``):

* ``relay`` (the default, as profd runs): each node's relay has synced with the coordinator
  (``relay_sync``) with a push target in this process, whose ``push.remote`` pickles its
  arguments as Ray does when a call is submitted, and answers at once; a plan has left when
  its relay's push was submitted (without the Ray calls, 1,250 pushes, not the ~36 a Ray
  fleet's forwarding makes: the coordinator's work per plan is the same);
* ``direct``: every agent's own long-poll is parked at the coordinator; a plan has left
  when its poll returned it.

The session is then cancelled and kept, as a coordinator keeps its past sessions (the heap
grows round by round, alike for both variants).

Variants, interleaved round by round (the order alternates):

* ``deferred``: profd as it runs: no cyclic collection until the plans have gone out
  (:func:`profd.core.heap.collection_deferred`);
* ``paced``: the reference, Python's default pacing throughout (the deferral replaced by a
  no-op for these rounds).

``full_collections``: full (oldest generation) collections that ran before the plans were
out, per round. Medians over the rounds; ``ratio`` is the median of the per-round
deferred/paced ratios of ``plans_out_ms``.

Target (decided here; issue 17 sets fan-out <= 1 s for the fleet, this is the coordinator's
share of it): the plans out within 100 ms of the call at 10,000 agents.

    python bench/create_latency.py [--agents 10000] [--rounds 15] [--link relay|direct]

Last line: ``RESULT agents=... rounds=... link=... plans_out_ms=... paced_plans_out_ms=... ratio=...
create_ms=... paced_create_ms=... full_collections=... paced_full_collections=...
targets=met|missed load=...`` (1-minute load average).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import profd.actors.admission as admission
from profd.actors.coordinator import ProfileCoordinator
from profd.core.protocol import AgentInfo
from profd.core.request import ToolKind

ROLE = "trainer"
TARGET_MS = 100.0


class FullCollections:
    """When the collector's full collections ended."""

    def __init__(self) -> None:
        self.ended: list[float] = []
        gc.callbacks.append(self._seen)

    def _seen(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "stop" and info["generation"] == 2:
            self.ended.append(time.perf_counter())

    def between(self, t0: float, t1: float) -> int:
        return sum(1 for t in self.ended if t0 <= t <= t1)


class PushTarget:
    """A node relay's handle as the coordinator holds it: ``push.remote`` pickles the call's
    arguments (as Ray does on submitting it) and answers at once with the versions held."""

    def __init__(self, sent: list[tuple[float, int]]) -> None:
        self.push = self
        self._sent = sent

    def remote(self, key: str, replies: Any, refresh: Any) -> asyncio.Future[dict[str, int]]:
        pickle.dumps((key, replies, refresh), protocol=pickle.HIGHEST_PROTOCOL)
        replies = getattr(replies, "value", replies)  # Packed
        held = {a: r.plan.version for a, r in replies.items() if r.plan is not None}
        self._sent.append((time.perf_counter(), len(held)))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(held)
        return fut


class Fleet:
    """The registered agents and how their plans leave the coordinator."""

    def __init__(self, coord: ProfileCoordinator, link: str) -> None:
        self.coord = coord
        self.link = link
        self.ids: list[str] = []
        self.versions: dict[str, int] = {}
        self.sent: list[tuple[float, int]] = []  # relay pushes: (when, plans)
        self.nodes: dict[str, list[str]] = {}

    async def register(self, agents: int) -> None:
        caps = {t.value: None for t in ToolKind}
        nodes: dict[str, list[str]] = {}
        for rank in range(agents):
            node = f"node-{rank // 8:05d}"
            info = AgentInfo(
                f"{node}-r{rank}", ROLE, rank, agents, {"local_rank": rank % 8}, node,
                10_000 + rank, node_id=node, node_ip="127.0.0.1", capabilities=caps,
                job_id="01000000",
            )  # fmt: skip
            reg = await self.coord.register(info, 10)
            self.ids.append(info.agent_id)
            self.versions[info.agent_id] = reg.plan.version
            nodes.setdefault(node, []).append(info.agent_id)
        self.nodes = nodes
        if self.link == "relay":
            for node, ids in nodes.items():
                known = {a: self.versions[a] for a in ids}
                target = PushTarget(self.sent)
                await self.coord.relay_sync(node, known, dict.fromkeys(ids, 10), target, node)

    async def alive(self) -> None:
        """Every relay syncs, as each does every poll period (its agents stay alive)."""
        if self.link == "relay":
            for node, ids in self.nodes.items():
                known = {a: self.versions[a] for a in ids}
                await self.coord.relay_resync(node, known, dict.fromkeys(ids, 10))

    async def plans_out(self, call: Any) -> tuple[float, float]:
        """Make ``call`` (which changes every agent's plan); when it returned and when the
        last plan had left."""
        if self.link == "relay":
            self.sent.clear()
            t0 = time.perf_counter()
            result = await call()
            returned = time.perf_counter()
            while sum(n for _, n in self.sent) < len(self.ids):
                await asyncio.sleep(0)
            return result, t0, returned, max(t for t, _ in self.sent)
        done: dict[str, float] = {}

        async def poll(aid: str) -> None:
            reply = await self.coord.poll(aid, self.versions[aid], 10, 60.0)
            done[aid] = time.perf_counter()
            if reply.plan is not None:
                self.versions[aid] = reply.plan.version

        tasks = [asyncio.create_task(poll(aid)) for aid in self.ids]
        while self.coord._plans.parked() < len(self.ids):  # every poll parked before the call
            await asyncio.sleep(0)
        t0 = time.perf_counter()
        result = await call()
        returned = time.perf_counter()
        await asyncio.gather(*tasks)
        return result, t0, returned, max(done.values())


async def one_round(fleet: Fleet, first_step: int, gcs: FullCollections) -> dict[str, float]:
    await fleet.alive()
    steps = list(range(first_step, first_step + 3))
    request = {"steps": steps, "roles": {ROLE: {"all_ranks": True}}}
    view, t0, returned, out = await fleet.plans_out(lambda: fleet.coord.create_session(request))
    # the cancel's plans go out too (and are taken) before the next round
    await fleet.plans_out(lambda: fleet.coord.cancel_session(view.session_id))
    return {"plans_out_ms": (out - t0) * 1000, "create_ms": (returned - t0) * 1000,
            "full": float(gcs.between(t0, out))}  # fmt: skip


async def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="profd-bench-create-") as tmp:
        settings = {"state_dir": tmp, "base_dir": tmp, "save_root": tmp, "poll_timeout_s": 30}
        coord = ProfileCoordinator(settings)
        await coord.start()
        fleet = Fleet(coord, args.link)
        await fleet.register(args.agents)
        gcs = FullCollections()
        deferral = admission.collection_deferred
        results: dict[str, list[dict[str, float]]] = {"deferred": [], "paced": []}
        step = 1000
        for r in range(args.rounds):
            order = ["deferred", "paced"] if r % 2 == 0 else ["paced", "deferred"]
            for variant in order:
                admission.collection_deferred = (
                    deferral if variant == "deferred" else contextlib.nullcontext
                )
                results[variant].append(await one_round(fleet, step, gcs))
                step += 10
        admission.collection_deferred = deferral
        coord.close()
    d, p = results["deferred"], results["paced"]

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    ratios = [a["plans_out_ms"] / b["plans_out_ms"] for a, b in zip(d, p, strict=True)]
    for name, rows in results.items():
        outs = sorted(r["plans_out_ms"] for r in rows)
        print(
            f"{name:9s}: plans out {med(rows, 'plans_out_ms'):6.1f} ms "
            f"({outs[0]:.0f}-{outs[-1]:.0f}), reply {med(rows, 'create_ms'):6.1f} ms, "
            f"full collections before the plans were out {sum(r['full'] for r in rows):.0f} "
            f"in {len(rows)} rounds"
        )
    met = med(d, "plans_out_ms") <= TARGET_MS
    print(
        f"RESULT agents={args.agents} rounds={args.rounds} link={args.link} "
        f"plans_out_ms={med(d, 'plans_out_ms'):.1f} "
        f"paced_plans_out_ms={med(p, 'plans_out_ms'):.1f} "
        f"ratio={statistics.median(ratios):.3f} create_ms={med(d, 'create_ms'):.1f} "
        f"paced_create_ms={med(p, 'create_ms'):.1f} "
        f"full_collections={statistics.mean(r['full'] for r in d):.2f} "
        f"paced_full_collections={statistics.mean(r['full'] for r in p):.2f} "
        f"targets={'met' if met else 'missed'} load={os.getloadavg()[0]:.2f}"
    )
    return 0 if met else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--link", choices=["relay", "direct"], default="relay")
    args = parser.parse_args()
    if args.agents < 1 or args.rounds < 1:
        parser.error("--agents and --rounds must be >= 1")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
