"""Reading traces: one real torch.profiler trace, written in the layouts other tools use, reads
the same on the fast and the generic path; self time; discrete-mode sessions."""

from __future__ import annotations

import gzip
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import torch

from profd.agent import ProfilerAgent
from profd.analysis import summarize_dir
from profd.analysis.digest import FileDigest, digest_file, self_times
from profd.backends.base import CollectionSpec
from profd.backends.torch_backend import TorchBackend, read_trace
from profd.core.naming import trace_stem

from helpers import wait_until

MODEL = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
# Cut candidates ("}, {", "}]") inside a string. (No quote: Kineto writes names unescaped.)
ODD_NAME = "odd}, {name: x}] [y"


@pytest.fixture(scope="module")
def kineto_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real trace from profd's torch backend: profd metadata, stage and mini-batch ranges."""
    out = tmp_path_factory.mktemp("kineto")
    stem = trace_stem(
        prefix="actor",
        scope="train",
        step=3,
        rank=1,
        world_size=2,
        pid=os.getpid(),
        when=datetime.now(),
    )
    meta = {
        "distributedInfo": {"rank": 1, "world_size": 2},
        "profd": {
            "role": "actor",
            "rank": 1,
            "world_size": 2,
            "step": 3,
            "scope": "train",
            "topology": {"dp": 1},
            "session_id": "s-reader",
            "pid": os.getpid(),
        },
    }
    coll = TorchBackend().open(CollectionSpec(out, stem, meta))
    with coll.annotate("step3"):
        with coll.annotate("compute_log_prob"), torch.no_grad():
            for _ in range(20):
                MODEL(torch.randn(4, 8))
        with coll.annotate("update_actor"):
            for i in range(2):
                with coll.annotate(f"mini_batch{i}"), coll.annotate(ODD_NAME):
                    MODEL(torch.randn(4, 8)).sum().backward()
    (out,) = coll.close()
    (written,) = out.write()
    return written.path


def op_key(o: Any) -> tuple[str, str, str]:
    return (o.stage or "", o.category, o.name)


def same(a: FileDigest, b: FileDigest, header: bool = True) -> None:
    assert a.error is None and b.error is None, (a.error, b.error)
    assert a.events == b.events > 100
    assert a.ranges == b.ranges
    if not header:  # no profd metadata: no stages, every operator outside them
        assert b.stages == [] and {o.stage for o in b.ops} == {None}
        assert sum(o.calls for o in a.ops) == sum(o.calls for o in b.ops)
        return
    assert a.stages == b.stages
    key = op_key
    ops_a, ops_b = sorted(a.ops, key=key), sorted(b.ops, key=key)
    assert [key(o) for o in ops_a] == [key(o) for o in ops_b]
    assert [o.calls for o in ops_a] == [o.calls for o in ops_b]
    # B/E durations are end - start on ~5e12 µs clocks: float rounding of ~0.01 µs
    assert np.allclose([o.self_us for o in ops_a], [o.self_us for o in ops_b], atol=0.05)
    assert a.header.get("profd") == b.header.get("profd")


def variants(doc: dict[str, Any], tmp: Path) -> dict[str, Path]:
    events = doc["traceEvents"]
    header = {k: v for k, v in doc.items() if k != "traceEvents"}
    paths = {}
    paths["compact"] = tmp / "compact.json"
    paths["compact"].write_bytes(orjson.dumps(doc))
    paths["events_first"] = tmp / "events_first.json.gz"
    # header keys after the events, one of them an array of objects (like deviceProperties)
    after = {"traceEvents": events, **header, "deviceProperties": [{"id": 0}, {"id": 1}]}
    paths["events_first"].write_bytes(gzip.compress(json.dumps(after, indent=1).encode()))
    paths["decoy"] = tmp / "decoy.json"
    decoy = {"notes": {"traceEvents": [{"name": "not an event"}]}, **doc}
    paths["decoy"].write_bytes(orjson.dumps(decoy))
    paths["bare_array"] = tmp / "bare.json"  # Chrome's array form, closing bracket omitted
    paths["bare_array"].write_bytes(b"[" + b",\n".join(orjson.dumps(e) for e in events) + b",\n")
    paths["begin_end"] = tmp / "begin_end.json"
    split = []
    for e in events:  # X events as B/E pairs, as some tools write them
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            b = {k: v for k, v in e.items() if k != "dur"}
            split += [
                {**b, "ph": "B"},
                {"ph": "E", "pid": e["pid"], "tid": e["tid"], "ts": e["ts"] + e["dur"]},
            ]
        else:
            split.append(e)
    paths["begin_end"].write_bytes(orjson.dumps({**header, "traceEvents": split}))
    return paths


def test_every_layout_reads_like_the_original(kineto_trace: Path, tmp_path: Path) -> None:
    doc = read_trace(kineto_trace)
    names = {e.get("name") for e in doc["traceEvents"]}
    assert ODD_NAME in names and "update_actor" in names  # the recorded trace itself
    original = digest_file(kineto_trace)
    assert original.mode == "fast"
    assert [s.name for s in original.stages] == ["compute_log_prob", "update_actor"]
    assert ODD_NAME in {r.name for r in original.ranges}  # nested: a range, not a stage
    same(original, digest_file(kineto_trace, force_generic=True))
    # small runs: many cuts, some of them tried inside the odd name and rejected
    same(original, digest_file(kineto_trace, force_generic=True, segment_bytes=4096))
    same(original, digest_file(kineto_trace, segment_bytes=4096))
    expected_mode = {
        "compact": "fast",
        "events_first": "generic",
        "decoy": "fast",
        "bare_array": "generic",
        "begin_end": "generic",
    }
    for label, path in variants(doc, tmp_path).items():
        d = digest_file(path, segment_bytes=4096)
        assert d.mode == expected_mode[label], label
        same(original, d, header=label != "bare_array")
        if label != "bare_array":
            assert d.header["distributedInfo"] == {"rank": 1, "world_size": 2}, label


def test_truncated_and_non_trace_files_fail_with_a_reason(
    kineto_trace: Path, tmp_path: Path
) -> None:
    raw = gzip.decompress(kineto_trace.read_bytes())
    cut = tmp_path / "cut.json"
    cut.write_bytes(raw[: len(raw) // 2])
    assert "truncated" in digest_file(cut).error
    other = tmp_path / "list.json"
    other.write_text('"just a string"')
    assert "not JSON" in digest_file(other).error


def test_self_time_subtracts_direct_children_per_thread() -> None:
    # thread 0: A[0,10] > B[2,5] > D[3,4]; A > C[5,8] > Z[6,6]; thread 1: E[0,10] alone
    thread = np.array([0, 0, 0, 0, 0, 1])
    ts = np.array([0.0, 2.0, 5.0, 3.0, 6.0, 0.0])
    dur = np.array([10.0, 3.0, 3.0, 1.0, 0.0, 10.0])
    assert self_times(thread, ts, dur).tolist() == [4.0, 2.0, 3.0, 1.0, 0.0, 10.0]


def test_discrete_mode_takes_the_step_from_the_trace_metadata(local_coordinator) -> None:
    owner = local_coordinator
    agent = ProfilerAgent("actor_rollout_ref", 0, 1, find_link=owner.link).start()
    wait_until(lambda: agent.connected, 10, what="registration")

    def step(n: int) -> None:
        with agent.step(n):
            with agent.stage("compute_log_prob"), torch.no_grad():
                MODEL(torch.randn(4, 8))
            with agent.stage("update", role="actor", update_loop=True):
                for i in range(2):
                    with agent.mini_batch(i):
                        MODEL(torch.randn(4, 8)).sum().backward()

    step(0)
    view = owner.call("create_session", {"steps": [2], "roles": {"actor": {"discrete": True}}})
    wait_until(lambda: agent.plan.windows, 10, what="plan")
    for n in range(1, 4):
        step(n)
    agent.close()
    view = wait_until(
        lambda: (v := owner.call("get_session", view.session_id)).state.is_terminal and v, 20
    )
    assert view.state.value == "done" and len(view.traces) == 2
    s = summarize_dir(view.save_dir)
    assert [(r.step, r.stage) for r in s.stage_times] == [
        (2, "compute_log_prob"),
        (2, "actor_update"),
    ]
    assert s.session_ids == [view.session_id] and len(s.tracks) == 1 and s.tracks[0].files == 2
    assert [(m.stage, m.index) for m in s.mini_batches] == [
        ("actor_update", 0),
        ("actor_update", 1),
    ]
