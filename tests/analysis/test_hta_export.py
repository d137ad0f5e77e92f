"""``profd export --hta``: a session folder HTA 0.5 loads as is, checked by running HTA on it.

The session: the hand-computable GPU traces of ``test_gpu_breakdown.py`` (``gpu_traces``) for
``actor`` rank 0 (steps 1 and 2, one file each), ``actor`` rank 1 and ``critic`` rank 0
(step 1; their ranks collide with actor rank 0's), a plain torch.profiler trace with its own
``ProfilerStep#1`` row (distributedInfo rank 0 too), a memory snapshot and profd's hidden
window record. The device events are :data:`HTA_EVENTS`: ``GPU_EVENTS`` with the two events
on which HTA's rules and profd's differ by design changed (documented in
``docs/hta-export.md``): ``relu_kernel`` gets a launch, at 79 ms (in ``update``, where its own
start put it: profd's figures stay the hand-computed ones), and ``late_kernel``, launched
after the step (profd never counts it; HTA does), is left out. So every figure of profd's per
file is the hand-computed ``FILE`` of ``test_gpu_breakdown.py``: window 85, idle 24, compute
50, non-compute 11, communication 15, memory 3, overlap 7 ms (46.67 %).

HTA runs once, in a subprocess (never imported here), on the exported folder; the tests
compare what it prints with ``SessionSummary.gpu`` of the session folder.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
from gpu_traces import (
    BASE_NS,
    CPU_PID,
    CPU_TID,
    GPU_EVENTS,
    HOST,
    MS,
    T0,
    gpu_events,
    header,
    kineto_text,
    shifted,
)
from hta_install import EngineInstallError, run_hta
from typer.testing import CliRunner

from profd.analysis import hta_export
from profd.analysis.hta_export import HTA_RANKS_FILE, HtaExport, HtaRank, export_hta
from profd.analysis.models import SessionSummary
from profd.analysis.summary import summarize_dir
from profd.cli.main import app

HTA_EVENTS = [
    (*e[:6], 79) if e[0] == "relu_kernel" else e for e in GPU_EVENTS if e[0] != "late_kernel"
]
#: Between actor rank 0's two files: the step-1 file's last device event ends at 90 ms, the
#: step-2 file's first starts at 200 + 5 ms. HTA's window of the merged rank includes it.
GAP_US = 115 * MS
PLAIN = "plain_torch.pt.trace.json"
TRACKS = [  # HTA rank -> profd track, in summarize's order: roles, ranks, then other files
    f"actor rank 0 @{HOST}",
    f"actor rank 1 @{HOST}",
    f"critic rank 0 @{HOST}",
    f"{PLAIN} @{HOST}",
]
HTA_RANK = re.compile(r'"rank":\s+(\d+)')  # hta/common/trace_file.py: first match, line by line


def _plain_torch_trace() -> str:
    """torch.profiler's own trace: no profd header, ProfilerStep#1 over the step."""
    events = gpu_events(1, HTA_EVENTS)
    for e in events:
        if e["name"] == "step1":
            e["name"] = "ProfilerStep#1"
    head = {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1}}
    return kineto_text(head | {"baseTimeNanoseconds": BASE_NS, "host_name": HOST}, events)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hta-session")
    files = {
        "actor_train_step1_rank0-of-2.json": kineto_text(header(0, 1), gpu_events(1, HTA_EVENTS)),
        "actor_train_step2_rank0-of-2.json": kineto_text(
            header(0, 2), shifted(gpu_events(2, HTA_EVENTS, corr_offset=1000), 200)
        ),  # CUPTI's correlation ids keep growing in one process
        "actor_train_step1_rank1-of-2.json": kineto_text(header(1, 1), gpu_events(1, HTA_EVENTS)),
        PLAIN: _plain_torch_trace(),
    }
    for name, text in files.items():
        (root / name).write_text(text)
    critic = kineto_text(header(0, 1, role="critic", world_size=1), gpu_events(1, HTA_EVENTS))
    (root / "critic_train_step1_rank0-of-1.json.gz").write_bytes(gzip.compress(critic.encode()))
    (root / "actor_step1_rank0_pid4242.pickle").write_bytes(b"\x80\x04snapshot")
    (root / ".profd-windows.jsonl").write_text("{}\n")
    return root


def hashes(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


@pytest.fixture(scope="module")
def exported(session: Path, tmp_path_factory: pytest.TempPathFactory) -> HtaExport:
    before = hashes(session)
    report = export_hta(session, tmp_path_factory.mktemp("out") / "hta", workers=1)
    assert hashes(session) == before  # the originals, byte for byte (and nothing added)
    return report


@pytest.fixture(scope="module")
def summary(session: Path) -> SessionSummary:
    return summarize_dir(session, workers=1)


def load(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def events_of(path: Path) -> list[dict[str, Any]]:
    return load(path)["traceEvents"]


def source_events(path: Path) -> list[dict[str, Any]]:
    if path.name.endswith(".gz"):
        return load(path)["traceEvents"]
    return json.loads(path.read_text())["traceEvents"]


# -- the folder ---------------------------------------------------------------------------------
def test_one_file_per_role_and_rank_with_a_unique_rank(exported: HtaExport) -> None:
    out = Path(exported.output)
    assert [r.track for r in exported.ranks] == TRACKS
    assert [r.hta_rank for r in exported.ranks] == [0, 1, 2, 3] and exported.world_size == 4
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [HTA_RANKS_FILE, *(r.file for r in exported.ranks)]
    )
    assert not [p for p in out.parent.iterdir() if p != out]  # no temporary left beside it
    for r in exported.ranks:
        path = out / r.file
        doc = load(path)
        assert doc["distributedInfo"] == {"rank": r.hta_rank, "backend": "nccl", "world_size": 4}
        with gzip.open(path, "rt") as f:  # what HTA reads the rank from
            first = next(m for line in f if (m := HTA_RANK.search(line)))
        assert int(first.group(1)) == r.hta_rank
    assert [r.sources for r in exported.ranks] == [
        ["actor_train_step1_rank0-of-2.json", "actor_train_step2_rank0-of-2.json"],
        ["actor_train_step1_rank1-of-2.json"],
        ["critic_train_step1_rank0-of-1.json.gz"],
        [PLAIN],
    ]
    assert [(r.role, r.rank) for r in exported.ranks] == [
        ("actor", 0), ("actor", 1), ("critic", 0), (None, 0),
    ]  # fmt: skip
    assert [s.name for s in exported.skipped] == ["actor_step1_rank0_pid4242.pickle"]
    assert "memory snapshot" in exported.skipped[0].reason


def test_profiler_steps_cover_profds_steps_exactly(exported: HtaExport) -> None:
    out = Path(exported.output)
    rows = {
        r.hta_rank: [
            (e["name"], e["cat"], e["pid"], e["tid"], e["ts"], e["dur"])
            for e in events_of(out / r.file)
            if e["name"].startswith("ProfilerStep#")
        ]
        for r in exported.ranks
    }
    step = ("user_annotation", CPU_PID, CPU_TID)
    assert rows[0] == [
        ("ProfilerStep#1", *step, T0, 100 * MS),
        ("ProfilerStep#2", *step, T0 + 200 * MS, 100 * MS),
    ]
    assert rows[1] == rows[2] == [("ProfilerStep#1", *step, T0, 100 * MS)]
    assert rows[3] == [("ProfilerStep#1", *step, T0, 100 * MS)]  # torch's own, not a second
    assert [r.added_profiler_steps for r in exported.ranks] == [[1, 2], [1], [1], []]
    assert [r.steps for r in exported.ranks] == [[1, 2], [1], [1], [1]]


def test_events_and_header_are_the_sources(session: Path, exported: HtaExport) -> None:
    out = Path(exported.output)
    for r in exported.ranks:
        got = [e for e in events_of(out / r.file) if "added by profd" not in str(e.get("args"))]
        assert got == [e for name in r.sources for e in source_events(session / name)]
    doc = load(out / exported.ranks[0].file)
    first = json.loads((session / "actor_train_step1_rank0-of-2.json").read_text())
    assert doc["profd"] == first["profd"] and doc["baseTimeNanoseconds"] == BASE_NS
    assert doc["profdHta"]["sources"] == exported.ranks[0].sources
    lines = (out / HTA_RANKS_FILE).read_text().splitlines()
    assert [HtaRank.model_validate_json(line) for line in lines] == exported.ranks
    notes = " ".join(exported.notes)
    assert "include_last_profiler_step=True" in notes
    assert "HTA rank 0 (actor rank 0 @h<1>): 2 files in one rank" in notes


def test_steps_filter_restarts_and_refusals(session: Path, tmp_path: Path) -> None:
    one = export_hta(session, tmp_path / "step2", steps=[2], workers=1)
    assert [(r.track, r.sources) for r in one.ranks] == [
        (TRACKS[0], ["actor_train_step2_rank0-of-2.json"])
    ]
    assert "2 files" not in " ".join(one.notes)
    # the same rank recorded by two processes (a restarted worker) stays two HTA ranks
    restarted = tmp_path / "restarted"
    restarted.mkdir()
    for pid, step in ((4242, 1), (5151, 2)):
        head = header(1, step)
        head["profd"]["pid"] = pid
        (restarted / f"actor_step{step}_rank1.json").write_text(
            kineto_text(head, gpu_events(step, HTA_EVENTS))
        )
    two = export_hta(restarted, tmp_path / "restarted-hta", workers=1)
    assert [r.file for r in two.ranks] == [
        "rank0_actor-rank1.json.gz",
        "rank1_actor-rank1_proc2.json.gz",
    ]
    with pytest.raises(ValueError, match=r"out_dir: .* not empty"):
        export_hta(session, tmp_path / "step2", workers=1)
    with pytest.raises(ValueError, match=r"session: .* is not a directory"):
        export_hta(tmp_path / "none", tmp_path / "x", workers=1)
    with pytest.raises(ValueError, match="session: no readable trace file with step 9"):
        export_hta(session, tmp_path / "x", steps=[9], workers=1)
    assert not (tmp_path / "x").exists()


def test_a_failed_export_leaves_nothing(session: Path, tmp_path: Path, monkeypatch) -> None:
    calls = []

    def failing(*args: Any) -> HtaRank:
        calls.append(args)
        if len(calls) == 2:
            raise OSError("disk full")
        return write(*args)

    write = hta_export._write_rank
    monkeypatch.setattr(hta_export, "_write_rank", failing)
    with pytest.raises(OSError, match="disk full"):
        export_hta(session, tmp_path / "hta", workers=1)
    assert list(tmp_path.iterdir()) == []


# -- HTA on it ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hta(exported: HtaExport) -> dict[str, Any]:
    """What HTA 0.5 makes of the exported folder (one subprocess for the module)."""
    try:
        return run_hta(exported.output)
    except EngineInstallError as exc:
        if exc.unavailable:
            pytest.skip(f"HTA cannot be installed here (registry unreachable?): {exc}")
        raise


def test_hta_loads_every_rank_and_step(hta: dict[str, Any]) -> None:
    assert hta["ranks"] == [0, 1, 2, 3]
    assert hta["iterations"] == {"0": [1, 2], "1": [1], "2": [1], "3": [1]}


def test_hta_temporal_breakdown_is_profds(
    exported: HtaExport, summary: SessionSummary, hta: dict[str, Any]
) -> None:
    gpu = {g.track: g for g in summary.gpu}
    rows = {row["rank"]: row for row in hta["temporal"]}
    assert rows[1]["kernel_time(us)"] == 85 * MS and rows[1]["idle_time(us)"] == 24 * MS
    for r in exported.ranks:
        g, h = gpu[r.track], rows[r.hta_rank]
        # one rank of several files: HTA's window also spans the time between them
        gap = GAP_US if len(r.sources) > 1 else 0.0
        assert h["compute_time(us)"] == g.compute_ms * MS
        assert h["non_compute_time(us)"] == g.non_compute_ms * MS
        assert h["idle_time(us)"] == g.idle_ms * MS + gap
        assert h["kernel_time(us)"] == g.window_ms * MS + gap
        if gap:
            continue
        for key, ms in (("idle", g.idle_ms), ("compute", g.compute_ms)):
            assert abs(h[f"{key}_time_pctg"] - 100 * ms / g.window_ms) <= 1.0
        assert abs(h["non_compute_time_pctg"] - 100 * g.non_compute_ms / g.window_ms) <= 1.0


def test_hta_overlap_and_kernel_breakdown_are_profds(
    exported: HtaExport, summary: SessionSummary, hta: dict[str, Any]
) -> None:
    gpu = {g.track: g for g in summary.gpu}
    overlap = {row["rank"]: row["comp_comm_overlap_pctg"] for row in hta["overlap"]}
    for r in exported.ranks:
        pct = gpu[r.track].comm_comp_overlap_pct
        assert pct is not None and abs(overlap[r.hta_rank] - pct) <= 1.0
    # kernel types: HTA's time per running combination, over every rank
    types = {row["kernel_type"]: row["sum"] for row in hta["kernel_types"]}

    def hta_us(*kinds: str) -> float:
        return sum(us for label, us in types.items() if all(k in label for k in kinds))

    tracks = [gpu[t] for t in TRACKS]
    assert hta_us("COMPUTATION") == sum(g.compute_ms for g in tracks) * MS
    assert hta_us("COMMUNICATION") == sum(g.communication_ms for g in tracks) * MS
    assert hta_us("MEMORY") == sum(g.memory_ms for g in tracks) * MS
    both = sum(g.communication_ms * (g.comm_comp_overlap_pct or 0) / 100 for g in tracks)
    assert hta_us("COMPUTATION", "COMMUNICATION") == pytest.approx(both * MS)
    # per kernel: calls and time over the session
    hta_ops: dict[str, list[float]] = {}
    for row in hta["kernels"]:
        acc = hta_ops.setdefault(row["name"], [0, 0.0])
        acc[0] += round(row["sum (us)"] / row["mean (us)"])
        acc[1] += row["sum (us)"]
    profd_ops: dict[str, list[float]] = {}
    for stage in summary.top_ops:
        for o in stage.ops if stage.device == "gpu" else []:
            acc = profd_ops.setdefault(o.name, [0, 0.0])
            acc[0] += o.calls
            acc[1] += o.total_ms * MS
    assert len(hta_ops) == len(HTA_EVENTS)
    assert {k: (n, round(us, 3)) for k, (n, us) in hta_ops.items()} == {
        k: (n, round(us, 3)) for k, (n, us) in profd_ops.items()
    }


# -- the command --------------------------------------------------------------------------------
def run(*args: str) -> Any:
    return CliRunner().invoke(app, ["export", *args])


def test_cli_writes_what_the_library_writes(
    session: Path, exported: HtaExport, tmp_path: Path
) -> None:
    out = tmp_path / "cli"
    r = run("--hta", str(session), str(out), "--workers", "1")
    assert r.exit_code == 0, r.output
    assert "HTA ranks written" in r.stdout and "include_last_profiler_step=True" in r.stdout
    for t in ("actor rank 0", "critic rank 0", PLAIN):
        assert t in r.stdout
    assert "skipped" in r.stderr and "memory snapshot" in r.stderr
    ours = Path(exported.output)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {
        p.name: p.read_bytes() for p in ours.iterdir()
    }  # byte for byte (gzip without a time stamp)
    r = run("--hta", str(session), str(tmp_path / "json"), "--workers", "1", "--json")
    assert r.exit_code == 0, r.output
    assert HtaExport.model_validate_json(r.stdout).ranks == exported.ranks


def test_cli_refuses_bad_arguments_naming_them(session: Path, tmp_path: Path) -> None:
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = session / "actor_train_step1_rank1-of-2.json"
    out = str(tmp_path / "out")
    cases = [
        (["--hta", str(session), str(full)], "DIR"),
        (["--hta", str(session), str(a_file)], "DIR"),
        (["--hta", str(tmp_path / "no-such"), out], "SESSION"),
        (["--hta", str(a_file), out], "SESSION"),
        (["--hta", str(empty), out], "session: no trace files"),
        ([str(session), out], "--hta"),
        (["--hta", str(session), out, "--steps", "x"], "--steps"),
    ]
    for args, named in cases:
        r = run(*args)
        assert r.exit_code == 2, (args, r.output)
        assert named in r.output and "Traceback" not in r.output, (args, r.output)
    assert (full / "keep.txt").read_text() == "mine" and [p.name for p in full.iterdir()] == [
        "keep.txt"
    ]
    assert not (tmp_path / "out").exists()
