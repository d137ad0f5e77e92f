"""Traces on different clocks are kept apart, with the reason, never merged on a wrong one."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from profd.analysis.clocks import EPOCH_FLOOR_US, FAR_APART_US, ClockHint, split_clocks
from profd.analysis.merge import merge_files
from profd.analysis.summary import summarize_files
from profd.core.clock_hints import WINDOWS_FILE, read_clock_hints, record_window_files
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


# -- placed by profd's record of the window ------------------------------------------------


def test_a_relative_file_with_a_hint_is_placed_on_the_wall_clock() -> None:
    hint = ClockHint(start_us=NOW_US + 2e6, uncertainty_us=1500.0, source="window start")
    c = split_clocks({"a": NOW_US, "rel": 3100.0, "other": 10.0}, {"rel": hint})
    assert c.together == ("a", "rel") and c.placed == {"rel": hint}
    assert "no record of when it started" in c.apart["other"]


def test_a_hint_far_from_the_session_does_not_place_the_file() -> None:
    hint = ClockHint(start_us=NOW_US - 5 * FAR_APART_US, uncertainty_us=1.0, source="w")
    c = split_clocks({"a": NOW_US, "rel": 0.0}, {"rel": hint})
    assert "day(s) away" in c.apart["rel"] and not c.placed


def test_a_hint_never_moves_a_file_that_has_its_own_wall_clock() -> None:
    hint = ClockHint(start_us=NOW_US + 9e6, uncertainty_us=1.0, source="w")
    c = split_clocks({"a": NOW_US, "b": NOW_US + 1e6}, {"b": hint})
    assert c.together == ("a", "b") and not c.placed and not c.apart


def test_the_record_round_trips_and_a_bad_line_is_left_out(tmp_path, caplog) -> None:
    record_window_files(tmp_path, ["x.json.gz", "y.json.gz"], 100.0, 100.004, "replica 1 start")
    with (tmp_path / WINDOWS_FILE).open("ab") as f:
        f.write(b'{"file": "z.json.gz", "start_before_s": "soon"}\nnot json\n')
    hints = read_clock_hints(tmp_path)
    assert set(hints) == {"x.json.gz", "y.json.gz"}
    assert hints["x.json.gz"].start_us == pytest.approx(100.002e6)
    assert hints["x.json.gz"].uncertainty_us == pytest.approx(2000.0)
    assert "2 line(s) could not be read" in caplog.text
    assert read_clock_hints(tmp_path / "missing") == {}
    with pytest.raises(ValueError, match="after_s"):
        record_window_files(tmp_path, ["x"], 2.0, 1.0, "w")
    assert hints["x.json.gz"].steps == ()  # not said


def test_the_record_keeps_the_steps_of_a_window(tmp_path) -> None:
    record_window_files(tmp_path, ["a.json.gz"], 1.0, 1.5, "w", steps=(7,))
    with (tmp_path / WINDOWS_FILE).open("ab") as f:  # steps that are not ints: none
        f.write(b'{"file": "b.json.gz", "start_before_s": 1, "start_after_s": 2, "steps": ["7"]}\n')
    hints = read_clock_hints(tmp_path)
    assert (hints["a.json.gz"].steps, hints["b.json.gz"].steps) == ((7,), ())


def _first_x_us(doc: dict, pid_of: str) -> float:
    return min(e["ts"] for e in doc["traceEvents"] if e.get("ph") == "X" and e["pid"] == pid_of)


def test_merge_and_summarize_place_a_relative_file_by_the_record(mixed, tmp_path) -> None:
    wall = json.loads(gzip.decompress(mixed[0].read_bytes()))
    start_s = wall["baseTimeNanoseconds"] / 1e9 + 5.0  # 5 s after the first wall-clock file
    record_window_files(tmp_path, [mixed[2].name], start_s - 0.002, start_s + 0.002, "w start")
    report = merge_files(mixed, tmp_path / "m.json.gz")
    assert mixed[2].name not in report.skipped and "± 2.0 ms" in report.aligned[mixed[2].name]
    doc = json.loads(gzip.decompress((tmp_path / "m.json.gz").read_bytes()))
    pid = {t.files[0]: t.pid for t in report.tracks}
    gap_us = _first_x_us(doc, pid[mixed[2].name]) - _first_x_us(doc, pid[mixed[0].name])
    assert gap_us == pytest.approx(5e6, abs=1.0)  # its ts 0 sits at the recorded start
    assert doc["profdMerge"]["aligned"] == report.aligned

    s = summarize_files([str(p) for p in mixed], source="mixed")
    assert not s.skipped and [a.name for a in s.aligned] == [mixed[2].name]
    (a,) = s.aligned
    assert a.offset_ms == pytest.approx(5000.0, abs=0.01)
    assert a.uncertainty_ms == pytest.approx(2.0, abs=0.01)
    assert a.source == "w start" and 5000 <= s.span_ms < 60_000
