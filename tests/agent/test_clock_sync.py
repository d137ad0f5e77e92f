"""One clock across nodes: agents measure their offset to the coordinator's clock, write it
into each trace, and merge / summarize put every file on the coordinator's clock. Two agents
in one process share a clock, so one of them is given a skewed clock (as a node whose clock
is 5 s ahead), and its trace is shifted the same way."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import pytest
import torch

from profd.agent.clock_sync import estimate_offset
from profd.analysis.merge import merge_files
from profd.analysis.summary import summarize_files
from profd.backends.torch_backend import read_trace

from helpers import start_agents, wait_armed, wait_terminal, wait_until

SKEW_NS = 5_000_000_000  # the skewed node's clock runs 5 s ahead


def test_the_offset_is_the_best_round_trips_midpoint() -> None:
    local = iter([100, 140, 200, 210, 300, 390])  # round trips of 40, 10, 90 ns
    remote = iter([1_000_120, 1_000_205, 1_000_345])
    est = estimate_offset(lambda: next(remote), samples=3, now_ns=lambda: next(local))
    # the 10 ns round trip wins: the answer was read near 205 local, so offset = 1_000_000
    assert (est.offset_ns, est.rtt_ns, est.samples) == (1_000_000, 10, 3)
    assert est.metadata()["offset_us"] == 1000.0 and est.metadata()["uncertainty_us"] == 0.005
    assert estimate_offset(lambda: "late", samples=2) is None  # no usable answer: no estimate
    with pytest.raises(ValueError, match="samples"):
        estimate_offset(lambda: 0, samples=0)


def _step(agent, step: int) -> None:
    with agent.step(step), agent.stage("work"):
        torch.nn.functional.linear(torch.randn(64, 64), torch.randn(64, 64))


def _shift_wall_clock(path: Path, ns: int) -> None:
    """What the skewed node's torch would have written: the same events, its clock's base."""
    doc = read_trace(path)
    doc["baseTimeNanoseconds"] += ns
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))


def test_a_skewed_node_lands_on_the_coordinators_clock(local_coordinator, tmp_path) -> None:
    owner = local_coordinator
    (plain,) = start_agents(owner, 1, role="actor")
    (ahead,) = start_agents(owner, 1, role="critic", now_ns=lambda: time.time_ns() + SKEW_NS)
    wait_until(lambda: ahead._channel.clock is not None, 10, what="clock measured")
    measured = ahead._channel.clock
    assert abs(measured.offset_ns + SKEW_NS) <= measured.rtt_ns + 1_000_000  # about -5 s
    assert abs(plain._channel.clock.offset_ns) <= plain._channel.clock.rtt_ns + 1_000_000
    _step(plain, 0), _step(ahead, 0)
    view = owner.call("create_session", {"next_steps": 1, "roles": {"actor": {}, "critic": {}}})
    for a in (plain, ahead):
        wait_armed(a, view.session_id)
    for s in (1, 2, 3):
        _step(plain, s), _step(ahead, s)  # the same moments on one real clock
    view = wait_terminal(owner, view.session_id)
    assert view.state.value == "done", view.reason
    paths = {t.role: Path(t.path) for t in view.traces}
    meta = read_trace(paths["critic"])["profd"]["clock"]
    assert meta["reference"] == "coordinator" and meta["offset_us"] == measured.offset_ns / 1000
    _shift_wall_clock(paths["critic"], SKEW_NS)

    s = summarize_files([str(p) for p in paths.values()], source="skewed")
    starts = {r.track.split()[0]: r.start_ms for r in s.step_times}
    assert abs(starts["actor"] - starts["critic"]) < 500, starts  # not 5000 ms apart
    report = merge_files(list(paths.values()), tmp_path / "m.json.gz")
    doc = json.loads(gzip.decompress((tmp_path / "m.json.gz").read_bytes()))
    pid = {t.label.split()[0]: t.pid for t in report.tracks}
    first = {
        role: min(e["ts"] for e in doc["traceEvents"] if e.get("pid") == p and e.get("ph") == "X")
        for role, p in pid.items()
    }
    assert abs(first["actor"] - first["critic"]) < 500_000, first  # µs: one clock
    for a in (plain, ahead):
        a.close()
