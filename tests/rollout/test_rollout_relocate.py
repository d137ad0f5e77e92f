"""Relocation: local rank from engine file names, keep sets, no overwrite, and the wait for
complete files (size/mtime settle, finished gzip stream, timeout that reports, not drops)."""

from __future__ import annotations

import gzip
import os
import threading
import time
from pathlib import Path

import pytest

from profd.rollout.relocate import (
    FlushWait,
    collect_engine_files,
    gzip_complete,
    read_local_rank,
    relocate_files,
    rollout_trace_name,
    snapshot_dir,
    snapshot_stats,
    wait_for_files,
)
from profd.rollout.replicas import ReplicaParallelism

TP2 = ReplicaParallelism(tp=2)
TP4 = ReplicaParallelism(tp=4)
FAST = FlushWait(settle_s=0.2, poll_s=0.05, timeout_s=5, first_file_timeout_s=0.5, peer_grace_s=0.5)


@pytest.mark.parametrize(
    ("name", "par", "rank"),
    [
        ("1718000000.1-TP-1.trace.json.gz", TP2, 1),  # SGLang
        ("tp-3.trace.json.gz", TP4, 3),  # case-insensitive, at the start
        ("a1b2c-rank-1.1718000000123456789.pt.trace.json.gz", TP2, 1),  # vLLM
        ("worker_rank1.pt.trace.json.gz", TP2, 1),
        ("worker.rank_0.pt.trace.json.gz", TP2, 0),
        ("RANK-2.json", TP4, 2),
        ("17.1-TP-3-EP-1.trace.json.gz", TP4, 3),  # SGLang EP: derived from the tp rank
        ("17.1-TP-2-memory.pickle", TP4, 2),  # SGLang's memory snapshot
        ("rank1.1796140106433406576.pt.trace.json.gz", TP2, 1),  # vLLM 0.32, dense model
        ("w3pre_rank1.17.pt.trace.json.gz", TP2, 1),  # with a profile_prefix
        # vLLM MoE names carry every group: the offset is known for any layout
        ("dp1_pp0_tp1_dcp0_ep3_rank1.17.pt.trace.json.gz", ReplicaParallelism(tp=2, dp=2), 3),
        ("pre_dp0_pp1_tp0_dcp0_ep0_rank2.17.pt.trace.json.gz", ReplicaParallelism(tp=2, pp=2), 2),
    ],
)
def test_local_rank_is_read_from_engine_names(name, par, rank) -> None:
    assert read_local_rank(name, par).rank == rank


@pytest.mark.parametrize(
    ("name", "par", "why"),
    [
        ("17.1-TP-0-DP-1.trace.json.gz", TP2, "DP/PP marker"),
        ("17.1-TP-1-PP-0.trace.json.gz", TP2, "DP/PP marker"),
        ("a1b2c-rank-1.17.pt.trace.json.gz", ReplicaParallelism(tp=2, dp=2), "dp=2, pp=1"),
        ("a1b2c-rank-1.17.pt.trace.json.gz", ReplicaParallelism(tp=2, pp=2), "dp=1, pp=2"),
        ("host_4242.17.pt.trace.json.gz", TP2, "no engine rank"),
        ("host_4242.async_llm.17.pt.trace.json.gz", TP2, "no engine rank"),
        ("profiler_out_0.txt", TP2, "no engine rank"),
        ("x-world-rank-3-rank-1.pt.trace.json.gz", TP4, "several engine ranks"),
        (
            "dp2_pp0_tp0_dcp0_ep0_rank4.17.pt.trace.json.gz",
            ReplicaParallelism(tp=2, dp=2),
            "outside",
        ),
        ("rank1.17.pt.trace.json.gz", ReplicaParallelism(tp=2, dp=2), "dp=2, pp=1"),
        ("a-rank-7.pt.trace.json.gz", TP4, "outside the replica"),
        ("franking-12.json.gz", TP4, "no engine rank"),  # 'rank' inside a word
    ],
)
def test_ambiguous_or_rankless_names_give_no_rank_with_a_reason(name, par, why) -> None:
    got = read_local_rank(name, par)
    assert got.rank is None and why in got.reason


def test_target_names() -> None:
    assert (
        rollout_trace_name(4, "x-TP-0.trace.json.gz", 8)
        == "rollout-replica4-globalrank8_x-TP-0.trace.json.gz"
    )
    assert rollout_trace_name(4, "host_1.json.gz") == "rollout-replica4_host_1.json.gz"


def _touch(d: Path, name: str, data: bytes = b"x") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_bytes(data)
    return p


def test_keep_set_brings_up_requested_ranks_and_keeps_peers_in_the_replica_subdir(tmp_path) -> None:
    engine = tmp_path / "engine"
    files = [_touch(engine, f"id-rank-{k}.17.pt.trace.json.gz", bytes([k]) * 10) for k in range(4)]
    files.append(_touch(engine, "host_99.async_llm.17.pt.trace.json.gz"))
    session = tmp_path / "session"
    res = relocate_files(
        files, replica=2, parallelism=TP4, session_dir=session, keep_global_ranks={9, 0, 100}
    )
    up = sorted(p.name for p in session.iterdir() if p.is_file())
    assert up == [
        "rollout-replica2-globalrank9_id-rank-1.17.pt.trace.json.gz",
        "rollout-replica2_host_99.async_llm.17.pt.trace.json.gz",  # unknown rank: kept, by replica
    ]
    peers = sorted(p.name for p in (session / "rollout-replica2").iterdir())
    assert peers == [f"id-rank-{k}.17.pt.trace.json.gz" for k in (0, 2, 3)]
    assert {f.global_rank for f in res.kept_in_subdir} == {8, 10, 11}
    assert not any(engine.iterdir())  # everything moved, nothing deleted
    moved = {f.global_rank: f for f in res.moved}
    assert moved[9].bytes == 10 and Path(moved[9].path).read_bytes() == bytes([1]) * 10
    assert moved[None].rank_note == "no engine rank in the name"


def test_without_keep_set_every_file_comes_up(tmp_path) -> None:
    files = [_touch(tmp_path / "e", f"17.5-TP-{k}.trace.json.gz") for k in range(2)]
    res = relocate_files(files, replica=0, parallelism=TP2, session_dir=tmp_path / "s")
    assert [f.global_rank for f in res.moved] == [0, 1] and res.kept_in_subdir == ()


def test_an_existing_name_is_never_overwritten(tmp_path) -> None:
    session = tmp_path / "s"
    taken = _touch(session, "rollout-replica0-globalrank0_a-rank-0.pt.trace.json.gz", b"old")
    _touch(session, "rollout-replica0-globalrank0_a-rank-0_part1.pt.trace.json.gz", b"old1")
    src = _touch(tmp_path / "e", "a-rank-0.pt.trace.json.gz", b"new")
    res = relocate_files([src], replica=0, parallelism=TP2, session_dir=session)
    (f,) = res.moved
    assert f.path.endswith("rollout-replica0-globalrank0_a-rank-0_part2.pt.trace.json.gz")
    assert taken.read_bytes() == b"old" and Path(f.path).read_bytes() == b"new"
    assert not src.exists()


def test_move_false_classifies_in_place(tmp_path) -> None:
    src = _touch(tmp_path / "e", "x-TP-1.trace.json.gz")
    res = relocate_files([src], replica=1, parallelism=TP2, session_dir=tmp_path / "s", move=False)
    assert res.moved[0].path == str(src) and res.moved[0].global_rank == 3 and src.exists()


def test_a_failed_move_is_reported_and_the_file_stays(tmp_path) -> None:
    src = _touch(tmp_path / "e", "x-TP-0.trace.json.gz")
    blocker = tmp_path / "s"
    blocker.write_text("not a directory")
    res = relocate_files([src], replica=0, parallelism=TP2, session_dir=blocker)
    assert src.exists() and res.moved[0].path == str(src)
    assert "relocating x-TP-0.trace.json.gz failed" in res.warnings[0]


def test_gzip_complete_detects_truncated_streams(tmp_path) -> None:
    data = gzip.compress(os.urandom(3000) * 3)
    whole = _touch(tmp_path, "a.json.gz", data)
    cut = _touch(tmp_path, "b.json.gz", data[:-20])
    junk = _touch(tmp_path, "c.json.gz", b"not gzip at all")
    assert gzip_complete(whole) and not gzip_complete(cut) and not gzip_complete(junk)
    assert not gzip_complete(tmp_path / "missing.gz")


def _slow_writer(path: Path, data: bytes, pieces: int, pause: float) -> threading.Thread:
    def run() -> None:
        with open(path, "wb") as f:
            step = -(-len(data) // pieces)
            for i in range(pieces):
                f.write(data[i * step : (i + 1) * step])
                f.flush()
                time.sleep(pause)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_wait_returns_only_when_a_growing_file_is_finished(tmp_path) -> None:
    d = tmp_path / "engine"
    d.mkdir()
    _touch(d, "old.trace.json.gz", gzip.compress(b"{}"))  # an earlier window's file
    baseline = snapshot_dir(d)
    data = gzip.compress(os.urandom(20000))
    # Pauses longer than the settle interval: only the gzip check can tell it is unfinished.
    t0 = time.monotonic()
    writer = _slow_writer(d / "x-TP-0.trace.json.gz", data, pieces=4, pause=0.35)
    res = wait_for_files(d, baseline, FAST, expected=1)
    elapsed = time.monotonic() - t0
    writer.join()
    assert [p.name for p in res.complete] == ["x-TP-0.trace.json.gz"]
    assert res.incomplete == () and not res.timed_out
    # The last piece lands after 3 pauses (1.05 s): the wait covered the whole write, not
    # only the first settle interval.
    assert elapsed >= 1.05
    assert res.complete[0].stat().st_size == len(data) and gzip_complete(res.complete[0])


def test_wait_without_gzip_check_settles_on_size_and_mtime(tmp_path) -> None:
    d = tmp_path / "e"
    d.mkdir()
    writer = _slow_writer(d / "x.txt", b"a" * 400, pieces=4, pause=0.1)
    res = wait_for_files(d, (), FAST.model_copy(update={"check_gzip": False}), expected=1)
    writer.join()
    assert (d / "x.txt").stat().st_size == 400 and res.complete == (d / "x.txt",)


def test_wait_timeout_reports_unfinished_files_and_keeps_complete_ones(tmp_path) -> None:
    d = tmp_path / "e"
    d.mkdir()
    _touch(d, "done-TP-0.trace.json.gz", gzip.compress(b"{}"))
    data = gzip.compress(os.urandom(20000))
    writer = _slow_writer(d / "slow-TP-1.trace.json.gz", data, pieces=6, pause=0.25)
    _touch(d, ".tmp-engine-file.json", b"partial")
    policy = FlushWait(settle_s=0.2, poll_s=0.05, timeout_s=1.0, first_file_timeout_s=0.5)
    res = wait_for_files(d, (), policy, expected=2)
    assert res.timed_out and [p.name for p in res.complete] == ["done-TP-0.trace.json.gz"]
    why = {Path(i.path).name: i.reason for i in res.incomplete}
    assert set(why) == {"slow-TP-1.trace.json.gz", ".tmp-engine-file.json"}
    assert (
        "gzip stream not finished" in why["slow-TP-1.trace.json.gz"]
        or "still changing" in why["slow-TP-1.trace.json.gz"]
    )
    assert "temporary" in why[".tmp-engine-file.json"]
    writer.join()


def test_wait_gives_up_early_when_no_file_appears(tmp_path) -> None:
    t0 = time.monotonic()
    res = wait_for_files(tmp_path / "never-created", (), FAST, expected=2)
    assert res.complete == () and "no file appeared within 0.5s" in res.note
    assert time.monotonic() - t0 < 2.0


def test_wait_stops_waiting_for_missing_peers_after_the_grace(tmp_path) -> None:
    d = tmp_path / "e"
    _touch(d, "a-TP-0.trace.json.gz", gzip.compress(b"{}"))
    res = wait_for_files(d, (), FAST, expected=4)
    assert len(res.complete) == 1 and not res.timed_out
    assert "1 of 4 expected trace file(s)" in res.note


def test_collect_leaves_incomplete_files_in_place_and_reports_them(tmp_path) -> None:
    d = tmp_path / "engine"
    _touch(d, "a-TP-0.trace.json.gz", gzip.compress(b"{}"))
    _touch(d, "a-TP-1.trace.json.gz", gzip.compress(b"{}" * 50)[:-8])  # never finished
    policy = FlushWait(settle_s=0.1, poll_s=0.05, timeout_s=0.6)
    waited, res = collect_engine_files(
        d,
        (),
        replica=0,
        parallelism=TP2,
        session_dir=tmp_path / "s",
        keep_global_ranks=None,
        policy=policy,
        expected=2,
    )
    assert waited.timed_out
    assert [f.global_rank for f in res.moved] == [0]
    assert [Path(i.path).name for i in res.incomplete] == ["a-TP-1.trace.json.gz"]
    assert (d / "a-TP-1.trace.json.gz").exists()  # reported, not moved half-written
    assert any("still incomplete" in w for w in res.warnings)


def test_flush_wait_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="poll_s"):
        FlushWait(settle_s=0.1, poll_s=0.5)
    with pytest.raises(ValueError, match="timeout_s"):
        FlushWait(settle_s=5, timeout_s=1)


def test_side_files_are_kept_beside_never_counted_or_named_as_traces(tmp_path) -> None:
    # vLLM 0.32 writes a profiler_out table next to each trace; the same name every window.
    engine, session = tmp_path / "engine", tmp_path / "session"
    for window in range(2):
        trace = _touch(engine, f"rank0.17{window}.pt.trace.json.gz", gzip.compress(b"{}"))
        side = _touch(engine, "rank0.profiler_out.txt", f"table {window}".encode())
        res = relocate_files([trace, side], replica=1, parallelism=TP2, session_dir=session)
        assert [f.source_name for f in res.files] == [trace.name]
        assert res.moved[0].global_rank == 2
        (kept,) = res.side_files
        assert Path(kept).parent == session / "rollout-replica1"
        assert Path(kept).read_text() == f"table {window}"
    up = sorted(p.name for p in session.iterdir() if p.is_file())
    assert all(n.endswith(".pt.trace.json.gz") for n in up) and len(up) == 2
    sides = sorted(p.name for p in (session / "rollout-replica1").iterdir())
    assert sides == ["rank0.profiler_out.txt", "rank0.profiler_out_part1.txt"]  # none replaced


def test_the_wait_counts_traces_not_side_files_against_the_expected(tmp_path) -> None:
    d = tmp_path / "e"
    _touch(d, "rank0.17.pt.trace.json.gz", gzip.compress(b"{}"))
    _touch(d, "rank0.profiler_out.txt", b"t")
    _touch(d, "h_1.async_llm.profiler_out.txt", b"t")
    res = wait_for_files(d, (), FAST, expected=2)  # 1 of 2 traces: waits out the peer grace
    assert len(res.complete) == 3 and "1 of 2 expected trace file(s)" in res.note
    _touch(d, "h_1.async_llm.17.pt.trace.json.gz", gzip.compress(b"{}"))
    res = wait_for_files(d, (), FAST, expected=2)
    assert len(res.complete) == 4 and res.note == ""


def test_a_side_file_rewritten_in_place_is_new_but_a_baseline_trace_never_is(tmp_path) -> None:
    d = tmp_path / "e"
    side = _touch(d, "rank0.profiler_out.txt", b"window 1")  # left by an earlier window
    old_trace = _touch(d, "rank0.1.pt.trace.json.gz", gzip.compress(b"{}"))
    kept = _touch(d, "h_1.async_llm.profiler_out.txt", b"untouched")
    baseline = snapshot_stats(d)
    assert set(baseline) == {side.name, old_trace.name, kept.name}
    side.write_bytes(b"window 2, a longer table")  # vLLM rewrites it under the same name
    old_trace.write_bytes(gzip.compress(b"{} "))  # a late flush of an earlier window's trace
    new = _touch(d, "rank0.2.pt.trace.json.gz", gzip.compress(b"{}"))
    res = wait_for_files(d, baseline, FAST, expected=1)
    assert sorted(p.name for p in res.complete) == sorted([side.name, new.name])
    # a plain name set (the old baseline) still ignores every file that was there
    assert [p.name for p in wait_for_files(d, frozenset(baseline), FAST, expected=1).complete] == [
        new.name
    ]


def test_memory_snapshots_do_not_stand_in_for_missing_timelines(tmp_path) -> None:
    d = tmp_path / "e"
    _touch(d, "1.5-TP-0.trace.json.gz", gzip.compress(b"{}"))
    _touch(d, "1.6-TP-0-memory.pickle", b"snap")
    _touch(d, "1.6-TP-1-memory.pickle", b"snap")
    res = wait_for_files(d, (), FAST, expected=2)  # TP-1's timeline never came
    assert "1 of 2 expected trace file(s)" in res.note and len(res.complete) == 3


def test_a_gzip_whose_stream_ended_is_complete_sooner_than_a_plain_file(tmp_path) -> None:
    """An ended gzip stream is the writer's word that it is done: ``gz_settle_s`` of quiet
    does (the driver of a session of separate step groups waits for the files before the
    next group starts: 2 s of every such step). A plain file still needs ``settle_s``, and
    a gzip cut short is never complete, however quiet."""
    policy = FlushWait(settle_s=1.5, gz_settle_s=0.1, poll_s=0.05, timeout_s=3.0)
    took = {}
    for name, data in [
        ("a-TP-0.trace.json.gz", gzip.compress(b"{}")),
        ("a-TP-0.trace.json", b"{}"),
        ("b-TP-0.trace.json.gz", gzip.compress(b"{}" * 50)[:-8]),
    ]:
        d = tmp_path / name.replace(".", "-")
        _touch(d, name, data)
        t0 = time.monotonic()
        res = wait_for_files(d, (), policy, expected=1)
        took[name] = (time.monotonic() - t0, [p.name for p in res.complete])
    assert took["a-TP-0.trace.json.gz"][0] < 1.0 and took["a-TP-0.trace.json.gz"][1]
    assert took["a-TP-0.trace.json"][0] >= 1.5 and took["a-TP-0.trace.json"][1]
    assert took["b-TP-0.trace.json.gz"][1] == []  # cut short: reported, never complete
