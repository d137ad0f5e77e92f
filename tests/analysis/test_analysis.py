"""Summarise and merge real multi-rank traces: four ranks recorded by real profd agents in four
processes on one wall-clock schedule, rank 2 planted slow in step 2's update_actor, plus a
relocated rollout-engine trace and a file nothing can name."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from profd.analysis import merge_dir, summarize_dir, write_html
from profd.analysis.digest import digest_file
from profd.analysis.models import SessionSummary, StragglerRule
from profd.analysis.sources import discover
from profd.analysis.stragglers import late_outliers
from profd.analysis.summary import summarize_files

WORKLOAD = Path(__file__).resolve().parents[1] / "analysis_workload.py"
WORLD = 4
SLOW = (2, 2, "update_actor", 0.15)  # rank, step, stage, seconds
# The schedule of analysis_workload.py: stage -> (start, end) in ms after the step starts.
SCHEDULE = {
    "generate_sequences": (50, 110),
    "compute_log_prob": (130, 190),
    "update_actor": (210, 410),
}
PERIOD_MS = 600
TOL_MS = 30  # four processes share two cores


@dataclass
class Session:
    dir: Path
    t0: dict[int, float]  # rank -> wall-clock start of step 1 (s)
    host: str


@pytest.fixture(scope="module")
def rl_session(tmp_path_factory: pytest.TempPathFactory) -> Session:
    out = tmp_path_factory.mktemp("session")
    slow = ":".join(map(str, SLOW))
    procs = []
    for rank in range(WORLD):
        cmd = [sys.executable, str(WORKLOAD), str(out), str(rank), str(WORLD), "--slow", slow]
        if rank == 1:
            cmd.append("--rollout")
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=150)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    meta = [json.loads((out / ".sync" / f"worker-{r}.json").read_text()) for r in range(WORLD)]
    import socket

    return Session(out, {m["rank"]: m["t0"] for m in meta}, socket.gethostname())


@pytest.fixture(scope="module")
def summary(rl_session: Session) -> SessionSummary:
    return summarize_dir(rl_session.dir)


def rank_label(rank: int, host: str) -> str:
    return f"actor_rollout_ref rank {rank} (tp{rank % 2}-dp{rank // 2}) @{host}"


def test_tracks_are_labelled_from_metadata_and_file_names(summary, rl_session) -> None:
    labels = [t.track for t in summary.tracks]
    ranks = [rank_label(r, rl_session.host) for r in range(WORLD)]
    assert labels[:WORLD] == ranks  # role, rank, parallel coordinates, node
    assert labels[WORLD].startswith("rollout replica 0 globalrank 1")  # from the file name
    assert labels[WORLD + 1] == f"engine_dump.json @{rl_session.host}"  # by file name, kept
    by_label = {t.track: t for t in summary.tracks}
    assert by_label[ranks[3]].topology == {"tp": 1, "dp": 1} and by_label[ranks[3]].world_size == 4
    assert by_label[ranks[0]].from_metadata and not by_label[labels[WORLD]].from_metadata
    assert summary.steps == [1, 2] and not summary.skipped
    assert summary.stages[:3] == ["generate_sequences", "compute_log_prob", "update_actor"]


def test_planted_slow_rank_is_the_straggler(summary, rl_session) -> None:
    rank, step, stage, seconds = SLOW
    real = [s for s in summary.stragglers if s.late_ms > 50]
    assert [(s.rank, s.step, s.stage) for s in real] == [(rank, step, stage)], summary.stragglers
    hit = real[0]
    assert hit.track == rank_label(rank, rl_session.host)
    assert abs(hit.late_ms - seconds * 1000) < 50  # named with how late
    assert hit.threshold_ms < hit.late_ms and hit.peer_median_wall_ms == pytest.approx(
        200, abs=TOL_MS
    )
    stat = next(x for x in summary.stage_stats if (x.step, x.stage) == (step, stage))
    assert stat.slowest == hit.track and stat.ranks == WORLD


def test_stage_wall_time_per_step_stage_and_rank(summary) -> None:
    rows = {(r.step, r.stage, r.rank): r for r in summary.stage_times if r.role}
    for step in (1, 2):
        for stage, (start, end) in SCHEDULE.items():
            for rank in range(WORLD):
                row = rows[(step, stage, rank)]
                expected = end - start
                if (rank, step, stage) == SLOW[:3]:
                    expected += SLOW[3] * 1000
                assert row.wall_ms == pytest.approx(expected, abs=TOL_MS), row
                assert row.calls == 1


def test_ranks_share_the_wall_clock(summary, rl_session) -> None:
    t0_us = summary.t0_epoch_us
    for step in (1, 2):
        starts = []
        for rank in range(WORLD):
            row = next(
                r
                for r in summary.stage_times
                if (r.step, r.stage, r.rank) == (step, "generate_sequences", rank)
            )
            wall = (t0_us + row.start_ms * 1000) / 1e6  # back to epoch seconds
            planned = rl_session.t0[rank] + (step - 1) * PERIOD_MS / 1000 + 0.05
            assert wall == pytest.approx(planned, abs=TOL_MS / 1000)
            starts.append(row.start_ms)
        assert max(starts) - min(starts) < TOL_MS  # simultaneous events line up


def test_mini_batches_and_idle_gaps(summary) -> None:
    minis = [m for m in summary.mini_batches if m.stage == "update_actor"]
    assert len(minis) == WORLD * 2 * 2
    for m in minis:
        slow = (m.track.startswith("actor_rollout_ref rank 2"), m.step, m.index) == (True, 2, 1)
        assert m.wall_ms == pytest.approx(100 + (150 if slow else 0), abs=TOL_MS), m
        assert m.micro_batches == 2
    between = [
        g
        for g in summary.idle_gaps
        if (g.after, g.before) == ("generate_sequences", "compute_log_prob")
    ]
    assert len(between) == WORLD * 2
    assert all(g.gap_ms == pytest.approx(20, abs=TOL_MS) for g in between)
    steps = [s for s in summary.step_times if s.step == 2]
    assert len(steps) == WORLD
    for s in steps:
        assert s.stages_ms == pytest.approx(320 + (150 if "rank 2" in s.track else 0), abs=TOL_MS)
        assert s.idle_ms == pytest.approx(s.wall_ms - s.stages_ms, abs=0.01)


def test_top_operators_by_self_time_per_stage(summary) -> None:
    groups = {(g.stage, g.device): g for g in summary.top_ops}
    gen = {o.name: o for o in groups[("generate_sequences", "cpu")].ops}
    # one forward of two Linear layers per stage, four ranks, two steps
    assert gen["aten::addmm"].calls == 2 * WORLD * 2
    update = groups[("update_actor", "cpu")]
    names = {o.name for o in update.ops}
    assert any("Backward" in n or n == "aten::mm" for n in names), names  # the backward pass
    for g in summary.top_ops:
        assert g.ops == sorted(g.ops, key=lambda o: -o.self_ms)
        assert all(0 <= o.self_ms <= o.total_ms + 1e-6 for o in g.ops)
        assert sum(o.share for o in g.ops) <= 1 + 1e-9
    assert ("rollout", "cpu") in groups  # the engine trace's operators, under its own label


def test_fast_and_generic_parsers_agree(rl_session) -> None:
    files = discover(rl_session.dir)
    modes = set()
    for f in files:
        fast, generic = digest_file(f), digest_file(f, force_generic=True)
        modes.add(fast.mode)
        assert generic.mode == "generic" and fast.error is None is generic.error
        assert fast.events == generic.events > 0
        assert fast.ranges == generic.ranges and fast.stages == generic.stages

        def key(o: Any) -> tuple[str, str, str]:
            return (o.stage or "", o.category, o.name)

        for a, b in zip(sorted(fast.ops, key=key), sorted(generic.ops, key=key), strict=True):
            assert key(a) == key(b) and a.calls == b.calls
            assert a.self_us == pytest.approx(b.self_us) and a.total_us == pytest.approx(b.total_us)
    assert modes == {"fast"}  # every torch.profiler trace takes the fast path


def test_worker_processes_give_the_serial_result(rl_session, summary) -> None:
    pooled = summarize_dir(rl_session.dir, workers=2)
    assert pooled.processing.mode == "processes" and pooled.processing.workers == 2
    assert pooled.processing.worker_memory_mb is None or pooled.processing.worker_memory_mb > 0
    for field in ("stage_times", "mini_batches", "idle_gaps", "top_ops", "stragglers", "tracks"):
        assert getattr(pooled, field) == getattr(summary, field), field
    # fresh interpreters (what a threaded host process such as the sidecar gets) work too
    spawned = summarize_dir(rl_session.dir, workers=2, start_method="spawn")
    assert spawned.processing.start_method == "spawn"
    assert spawned.stage_times == summary.stage_times and spawned.top_ops == summary.top_ops


def test_straggler_rule_is_robust() -> None:
    rule = StragglerRule(k=3, abs_floor_ms=5, rel_floor=0.05)
    ends, walls = [100.0, 101.0, 99.5, 100.4, 140.0], [50.0] * 5
    (hit,) = late_outliers(ends, walls, rule)
    assert hit.index == 4 and hit.late == pytest.approx(140 - 100.2) and hit.threshold >= 5
    # two ranks: the other one is the reference, the floors decide
    assert [h.index for h in late_outliers([0.0, 30.0], [100.0, 100.0], rule)] == [1]
    assert late_outliers([0.0, 4.0], [100.0, 100.0], rule) == []  # under both floors
    # a noisy group: a rank as late as the noise is not singled out
    assert late_outliers([0.0, 40.0, 80.0, 20.0, 60.0], [200.0] * 5, rule) == []
    assert late_outliers([5.0], [1.0], rule) == []


def test_unreadable_and_foreign_files_are_reported(rl_session, tmp_path) -> None:
    good = next(p for p in rl_session.dir.iterdir() if p.name.startswith("actor"))
    (tmp_path / good.name).write_bytes(good.read_bytes())
    (tmp_path / "broken.json.gz").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    (tmp_path / "config.json").write_text('{"lr": 0.1}')
    (tmp_path / ".hidden.json.gz.tmp").write_text("partial")
    s = summarize_dir(tmp_path)
    assert [f.name for f in s.files] == [good.name]
    reasons = {x.name: x.reason for x in s.skipped}
    assert set(reasons) == {"broken.json.gz", "config.json"}
    assert (
        "truncated" in reasons["broken.json.gz"] and "not a Chrome trace" in reasons["config.json"]
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="path: no trace files"):
        summarize_dir(empty)


def test_ray_tasks_read_files_on_their_nodes(rl_session, summary, ray_session) -> None:
    import ray

    node = ray.get_runtime_context().get_node_id()
    files = sorted(p for p in rl_session.dir.iterdir() if p.is_file())
    remote = summarize_files(files, source="ray", nodes=[node] * len(files))
    assert remote.processing.mode == "ray"
    assert remote.stage_times == summary.stage_times and remote.top_ops == summary.top_ops


# -- merge ----------------------------------------------------------------------------------
def load(path: Path) -> dict[str, Any]:
    return json.loads(gzip.decompress(path.read_bytes()))


def tracks_of(doc: dict[str, Any]) -> dict[int, str]:
    return {
        e["pid"]: e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }


def test_merge_puts_each_rank_on_a_labelled_track_on_one_clock(rl_session, tmp_path) -> None:
    report = merge_dir(rl_session.dir, tmp_path / "merged.json.gz")
    doc = load(tmp_path / "merged.json.gz")
    tracks = tracks_of(doc)
    assert len(tracks) == WORLD + 2 and sorted(tracks) == list(range(1, WORLD + 3))
    assert [tracks[p] for p in range(1, WORLD + 1)] == [
        rank_label(r, rl_session.host) for r in range(WORLD)
    ]
    assert [t.label for t in report.tracks] == [tracks[p] for p in sorted(tracks)]
    meta = {(e["pid"], e["name"]) for e in doc["traceEvents"] if e["ph"] == "M"}
    assert all((p, "thread_name") in meta and (p, "process_sort_index") in meta for p in tracks)
    labels = {
        e["pid"]: e["args"]["labels"]
        for e in doc["traceEvents"]
        if e.get("name") == "process_labels"
    }
    assert "rank=2" in labels[3] and "tp0-dp1" in labels[3]
    base_us = doc["baseTimeNanoseconds"] / 1000
    steps = [e for e in doc["traceEvents"] if e.get("name") == "step1" and e["ph"] == "X"]
    assert sorted(e["pid"] for e in steps) == list(range(1, WORLD + 1))
    for e in steps:  # absolute wall clock: the worker entered step 1 at its t0
        assert (base_us + e["ts"]) / 1e6 == pytest.approx(
            rl_session.t0[e["pid"] - 1], abs=TOL_MS / 1000
        )
    starts = [e["ts"] for e in steps]
    assert max(starts) - min(starts) < TOL_MS * 1000
    assert doc["profdMerge"]["sources"] and report.dropped == {}
    gz_out = sum(1 for e in doc["traceEvents"] if e["ph"] != "M")
    assert gz_out == sum(
        digest_file(p).events for p in rl_session.dir.iterdir() if p.is_file()
    ) + sum(1 for e in doc["traceEvents"] if e["ph"] not in ("M", "X"))


def test_merge_filters_ranks_stages_and_window(rl_session, tmp_path) -> None:
    out = tmp_path / "r.json.gz"
    report = merge_dir(rl_session.dir, out, ranks=[0, 2])
    assert sorted(tracks_of(load(out)).values()) == [
        rank_label(0, rl_session.host),
        rank_label(2, rl_session.host),
    ]
    assert report.dropped["ranks"]["cpu_op"] > 0 and "roles" not in report.dropped
    raw = out.read_bytes()  # the gzip header names the file (gunzip -N), not its temporary
    assert raw[3] & 0x08 and raw[10:].split(b"\0", 1)[0] == b"r.json", raw[:40]
    report = merge_dir(rl_session.dir, out, roles=["rollout"])  # named by what left it out
    assert report.dropped["roles"]["cpu_op"] > 0 and "ranks" not in report.dropped

    report = merge_dir(rl_session.dir, out, stages=["update_actor"])
    doc = load(out)
    ranges = {}
    for e in doc["traceEvents"]:
        if e.get("name") == "update_actor":
            ranges.setdefault(e["pid"], []).append((e["ts"], e["ts"] + e["dur"]))
    kept = [e for e in doc["traceEvents"] if e["ph"] != "M"]
    assert kept and all(any(a <= e["ts"] <= b for a, b in ranges[e["pid"]]) for e in kept)
    assert not any(e.get("name") in ("generate_sequences", "step1") for e in kept)
    assert report.dropped["stages"]["user_annotation"] > 0
    # tracks without the stage are left out, not kept empty, and the report says why
    assert {t.pid for t in report.tracks} == set(ranges)
    emptied = {n for n, why in report.skipped.items() if why == "no event left after the filters"}
    with_stage = {f for t in report.tracks for f in t.files}
    assert emptied and not emptied & with_stage

    window = (PERIOD_MS + 200, PERIOD_MS + 300)  # inside step 2, before update_actor ends
    report = merge_dir(rl_session.dir, out, start_ms=window[0], end_ms=window[1])
    doc = load(out)
    lo = report.t0_epoch_us + window[0] * 1000 - doc["baseTimeNanoseconds"] / 1000
    hi = lo + (window[1] - window[0]) * 1000
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert xs and all(e["ts"] <= hi and e["ts"] + e["dur"] >= lo for e in xs)
    names = {e["name"] for e in xs}
    assert "step2" in names and "step1" not in names and "update_actor" in names
    with pytest.raises(ValueError, match="stages: none of"):
        merge_dir(rl_session.dir, out, stages=["no_such_stage"])
    with pytest.raises(ValueError, match="max_mb"):
        merge_dir(rl_session.dir, out, max_mb=0)


def ranges_of(doc: dict[str, Any]) -> list[str]:
    return sorted(e["name"] for e in doc["traceEvents"] if e.get("cat") == "user_annotation")


def droppable(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e["ph"] != "M" and e.get("cat") != "user_annotation"]


def test_merge_budget_drops_the_finest_events_first(rl_session, tmp_path) -> None:
    full = merge_dir(rl_session.dir, tmp_path / "full.json.gz")
    budget_mb = full.json_bytes / 2 / (1024 * 1024)
    small = merge_dir(rl_session.dir, tmp_path / "small.json.gz", max_mb=budget_mb)
    raw = gzip.decompress((tmp_path / "small.json.gz").read_bytes())
    assert len(raw) == small.json_bytes <= budget_mb * 1024 * 1024
    assert small.dropped["budget"] and "shortest" in small.budget_note
    doc, whole = json.loads(raw), load(tmp_path / "full.json.gz")
    assert doc["profdMerge"]["dropped"] == small.dropped and doc["profdMerge"]["budget_note"]
    assert ranges_of(doc) == ranges_of(whole)  # steps, stages and mini-batches always stay
    kept = [e.get("dur", 0) for e in droppable(doc)]
    gone = sorted(e.get("dur", 0) for e in droppable(whole))
    dropped_n = sum(small.dropped["budget"].values())
    assert len(gone) - len(kept) == dropped_n
    assert min(kept) >= gone[dropped_n - 1]  # nothing kept is shorter than what was dropped


# -- report ---------------------------------------------------------------------------------
class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.links += [v or "" for k, v in attrs if k in ("src", "href")]


def test_html_report_renders_plots_and_names_the_straggler(summary, tmp_path) -> None:
    path = write_html(summary, tmp_path / "report.html")
    text = path.read_text()
    parser = _Tags()
    parser.feed(text)
    assert parser.tags.count("svg") == 1 + len(summary.stages)  # timeline + one bar chart per stage
    assert "script" not in parser.tags and parser.links == []  # self-contained, nothing to fetch
    svgs = [
        text[i : text.index("</svg>", i) + 6]
        for i in range(len(text))
        if text.startswith("<svg", i)
    ]
    timeline = ET.fromstring(svgs[0])
    rects = [r for r in timeline.iter("{http://www.w3.org/2000/svg}rect")]
    late = [r for r in rects if r.get("stroke") == "#d62728"]
    # one red outline per straggler that ran long: the planted one, and on a loaded machine
    # perhaps a stage that ran long by chance (test_planted_slow_rank_is_the_straggler
    # tells them apart by size)
    ran_long = [x for x in summary.stragglers if x.cause is None or x.cause.long]
    assert len(rects) >= len(summary.stage_times) and len(late) == len(ran_long) >= 1
    texts = ["".join(r.itertext()) for r in late]
    assert any("LATE" in t and "update_actor" in t for t in texts), texts
    for svg in svgs[1:]:
        ET.fromstring(svg)  # well-formed
    hit = summary.stragglers[0]
    assert hit.track in text and f"{hit.late_ms:,.1f}" in text
    for stage in summary.stages:
        assert stage in text


def test_a_merged_trace_in_the_directory_is_not_read_as_a_rank(rl_session, tmp_path) -> None:
    for f in rl_session.dir.iterdir():
        if f.is_file():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    merge_dir(tmp_path, tmp_path / "merged.json.gz")
    s = summarize_dir(tmp_path)
    assert [x.name for x in s.skipped] == ["merged.json.gz"] and "merged" in s.skipped[0].reason
    assert len(s.tracks) == WORLD + 2
    again = merge_dir(tmp_path, tmp_path / "again.json.gz")
    assert "merged.json.gz" in again.skipped and len(again.tracks) == WORLD + 2


# A real data-parallel step with gloo (world size 1), recorded by profd's torch backend in a
# process of its own (the process group stays out of the test process).
GLOO_STEP = r"""
import sys
from pathlib import Path
import torch
import torch.distributed as dist
from profd.backends.base import CollectionSpec
from profd.backends.torch_backend import TorchBackend

out = Path(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=0, world_size=1)
meta = {"profd": {"role": "trainer", "rank": 0, "step": 1, "scope": "train"},
        "distributedInfo": {"rank": 0, "world_size": 1}}
traces = out / "traces"
coll = TorchBackend({"contents": ["cpu"]}).open(
    CollectionSpec(traces, "trainer_train_step1_rank0_pid1_20260101000000000", meta))
layer = torch.nn.Linear(64, 64)
with coll.annotate("step1"):
    with coll.annotate("forward_backward"):
        for i in range(2):
            with coll.annotate(f"mini_batch{i}"):
                layer(torch.randn(32, 64)).sum().backward()
                for p in layer.parameters():
                    dist.all_reduce(p.grad)
    with coll.annotate("optimizer_step"), torch.no_grad():
        for p in layer.parameters():
            p -= 0.01 * p.grad
coll.close()[0].write()
# a discrete trace: one stage's window, no step or mini-batch marks (its scope names it)
meta = {**meta, "profd": {**meta["profd"], "scope": "forward_backward"}}
coll = TorchBackend({"contents": ["cpu"]}).open(CollectionSpec(
    out / "discrete", "trainer_forward_backward_step1_rank0_pid1_20260101000000000", meta))
with coll.annotate("forward_backward"):
    layer(torch.randn(32, 64)).sum().backward()
    for p in layer.parameters():
        dist.all_reduce(p.grad)
coll.close()[0].write()
dist.destroy_process_group()
"""


def test_a_librarys_range_on_its_own_thread_is_no_stage(tmp_path) -> None:
    """torch's gloo:all_reduce is a user_annotation on gloo's own thread: it is not a stage,
    and the mini-batches it overlaps stay in the stage that marked them."""
    r = subprocess.run(
        [sys.executable, "-c", GLOO_STEP, str(tmp_path)], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    (trace,) = (tmp_path / "traces").iterdir()
    events = load(trace)["traceEvents"]
    ranges = [(e["name"], e["tid"]) for e in events if e.get("cat") == "user_annotation"]
    step_tid = next(tid for name, tid in ranges if name == "step1")
    assert any(n == "gloo:all_reduce" and tid != step_tid for n, tid in ranges), ranges
    summary = summarize_dir(tmp_path / "traces")
    assert {s.stage for s in summary.stage_times} == {"forward_backward", "optimizer_step"}
    minis = summary.mini_batches
    assert [(m.stage, m.index) for m in minis] == [("forward_backward", 0), ("forward_backward", 1)]
    assert all(g.stage != "gloo:all_reduce" for g in summary.top_ops)
    discrete = summarize_dir(tmp_path / "discrete")
    assert {s.stage for s in discrete.stage_times} == {"forward_backward"}, discrete.stage_times
