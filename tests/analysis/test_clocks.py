"""Traces on different clocks are kept apart, with the reason, never merged on a wrong one."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from profd.analysis.clocks import EPOCH_FLOOR_US, FAR_APART_US, split_clocks
from profd.analysis.merge import merge_files
from profd.analysis.summary import summarize_files
from profd.testing.fake_engines import chrome_trace_bytes

NOW_US = 1.8e15  # 2027 on the wall clock


def test_relative_files_are_apart_from_wall_clock_ones() -> None:
    c = split_clocks({"a": NOW_US, "b": NOW_US + 5e6, "rel": 3100.0})
    assert c.together == ("a", "b") and set(c.apart) == {"rel"}
    assert "not on the wall clock" in c.apart["rel"]


def test_a_file_days_away_is_apart_and_close_ones_stay() -> None:
    c = split_clocks({"a": NOW_US, "b": NOW_US + 3600e6, "old": NOW_US - 3 * FAR_APART_US})
    assert c.together == ("a", "b") and "3 day(s) away" in c.apart["old"]


def test_all_relative_files_share_their_own_clock() -> None:
    c = split_clocks({"a": 0.0, "b": 120.0})
    assert c.together == ("a", "b") and not c.apart
    assert EPOCH_FLOOR_US > 120.0


def _relative_trace(path: Path) -> Path:
    """A trace without baseTimeNanoseconds, ``ts`` from 0 (what the old fake engines wrote)."""
    doc = json.loads(gzip.decompress(chrome_trace_bytes("vllm", 0, 1, [0, 1], {})))
    del doc["baseTimeNanoseconds"]
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path


def _wall_trace(path: Path, rank: int) -> Path:
    path.write_bytes(chrome_trace_bytes("vllm", rank, 2, [0, 1, 2], {}))
    return path


@pytest.fixture
def mixed(tmp_path: Path) -> list[Path]:
    return [
        _wall_trace(tmp_path / "rollout-replica0-globalrank0_a.pt.trace.json.gz", 0),
        _wall_trace(tmp_path / "rollout-replica0-globalrank1_b.pt.trace.json.gz", 1),
        _relative_trace(tmp_path / "rollout-replica1-globalrank2_c.pt.trace.json.gz"),
    ]


def test_merge_keeps_a_file_on_another_clock_out_and_says_why(mixed, tmp_path) -> None:
    report = merge_files(mixed, tmp_path / "m.json.gz")
    assert "not on the wall clock" in report.skipped[mixed[2].name]
    assert sorted(f for t in report.tracks for f in t.files) == sorted(p.name for p in mixed[:2])
    doc = json.loads(gzip.decompress((tmp_path / "m.json.gz").read_bytes()))
    xs = [e["ts"] for e in doc["traceEvents"] if e.get("ph") == "X"]
    assert xs and max(xs) - min(xs) < 60e6  # one clock: all within a minute, not 1e15 apart


def test_summarize_keeps_it_out_and_its_span_stays_the_sessions(mixed) -> None:
    s = summarize_files([str(p) for p in mixed], source="mixed")
    assert [x.name for x in s.skipped] == [mixed[2].name]
    assert 0 <= s.span_ms < 60_000  # not the 1.8e12 ms of a relative file against the epoch
