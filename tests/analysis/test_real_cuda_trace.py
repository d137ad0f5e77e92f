"""A real CUDA trace, recorded on an NVIDIA H200 (``tests/fixtures/cuda/README.md``), against
the analysis and against the hand-made GPU traces of ``gpu_traces``.

It is in Kineto's classic layout, which every torch before 2.13 writes (the torch of most GPU
jobs): until it was recorded, such traces left profd's fast parser for the generic one
without anyone noticing, because every GPU trace the suite had was hand-made in torch 2.13's
layout. Here the figures are worked out from the file's own events, independently of profd's
code, and HTA's are compared with profd's.
"""

from __future__ import annotations

import gzip
import importlib
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest
from gpu_traces import (
    CPU_PID,
    CPU_TID,
    classic_head,
    classic_span,
    gpu_events,
    header,
    kineto_text,
)
from hta_install import EngineInstallError, run_hta

from profd.analysis import summarize_dir
from profd.analysis.digest import digest_file
from profd.analysis.gpu import GpuTimes
from profd.analysis.hta_export import export_hta

FIXTURES = Path(__file__).parent.parent / "fixtures" / "cuda"
(RECORDED,) = FIXTURES.glob("*.json.gz")
DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def recorded() -> tuple[str, dict[str, Any]]:
    text = gzip.decompress(RECORDED.read_bytes()).decode()
    return text, json.loads(text)


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def test_hand_made_classic_layout_is_the_recorded_one() -> None:
    """Every complete event's first two lines, and Kineto's span, as gpu_traces writes them
    in the classic layout, are in the recorded file verbatim."""
    text, doc = recorded()
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    spans = [e for e in events if e["cat"] == "Trace"]
    assert len(spans) == 1 and len(events) > 250
    for e in events:
        if e["cat"] != "Trace":
            assert classic_head(e) in text, e
    assert classic_span(spans[0]["ts"], spans[0]["dur"]) in text
    assert {e["cat"] for e in events} >= {*DEVICE, "cuda_runtime", "cuda_driver", "cpu_op"}


_VALUE_STR = re.compile(r'(:\s*)"(?:[^"\\]|\\.)*"')
_NUMBER = re.compile(r"-?\b\d+(?:\.\d+)?(?:e-?\d+)?\b")


def _shape(block: str) -> str:
    """An event's text with its values blanked (strings "S", numbers N), its braces and the
    spacing after commas dropped (Kineto's varies) and its line breaks kept (the fast
    parser's patterns depend on them)."""
    lines = []
    for line in block.split("\n"):
        line = _NUMBER.sub("N", _VALUE_STR.sub(r'\1"S"', line))
        line = re.sub(r",\s*", ", ", line.strip()).strip("{} ,")
        if line:
            lines.append(line)
    return "\n".join(lines)


def test_the_analysis_benchs_classic_text_has_the_recorded_shapes(monkeypatch) -> None:
    """``bench/analysis.py`` times profd and HTA on traces written by
    ``bench/gpu_trace_set.py`` (string templates, for speed), not by ``gpu_traces``: every
    event it writes in the classic layout (metadata, host ops, launches, flows, kernels,
    copies, Kineto's span) has the shape of an event of the recorded trace."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "bench"))
    bench = importlib.import_module("gpu_trace_set")
    text, _ = recorded()
    # the events alone: from the first one's brace to the last one's, then one per block
    body = text[text.index("{", text.index('"traceEvents": [')) : text.rindex("\n  }\n  ]")]
    real = {_shape(b) for b in body.split("\n  },\n  {")}
    written = {_shape(e) for e in bench._events(bench.TextClassic(), 0, 2, 6)}
    assert len(written) >= 9  # every kind of event above
    assert written <= real, sorted(written - real)


def test_recorded_trace_takes_the_fast_path_with_the_generic_figures(tmp_path: Path) -> None:
    fast, generic = digest_file(RECORDED), digest_file(RECORDED, force_generic=True)
    assert (fast.mode, fast.error, generic.mode) == ("fast", None, "generic")
    assert fast.gpu is not None and fast.gpu == generic.gpu
    assert fast.ops == generic.ops and fast.ranges == generic.ranges
    assert fast.stages == generic.stages and fast.threads == generic.threads
    # a few cuts: a run may start or end inside Kineto's span
    assert digest_file(RECORDED, segment_bytes=4096).gpu == fast.gpu
    # rewritten by another tool, compact or indented: Kineto's span keeps its own key order
    _, doc = recorded()
    (tmp_path / "compact.json").write_bytes(orjson.dumps(doc))
    (tmp_path / "indented.json").write_text(json.dumps(doc, indent=1))
    for name in ("compact.json", "indented.json"):
        d = digest_file(tmp_path / name, segment_bytes=4096)
        assert (d.mode, d.gpu, d.ops) == ("fast", fast.gpu, fast.ops), name


def test_recorded_figures_from_the_events() -> None:
    """Kernels by the stage of their launch, and compute and memory time, worked out from the
    file's events here (launches by correlation id; unions of intervals)."""
    _, doc = recorded()
    events = doc["traceEvents"]
    host = {e["name"]: e for e in events if e.get("cat") == "user_annotation"}
    step = host["step1"]
    launch_at = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e["args"]
    }
    device = [e for e in events if e.get("cat") in DEVICE]
    assert all(step["ts"] <= launch_at[e["args"]["correlation"]] for e in device)

    def stage_of(e: dict[str, Any]) -> str | None:
        at = launch_at[e["args"]["correlation"]]
        for name in ("generate", "update"):
            if host[name]["ts"] <= at <= host[name]["ts"] + host[name]["dur"]:
                return name
        return None

    d = digest_file(RECORDED)
    assert d.gpu is not None
    t = d.gpu.total
    assert t.kernels == len(device) == 49
    by_stage: dict[str | None, int] = {}
    for e in device:
        by_stage[stage_of(e)] = by_stage.get(stage_of(e), 0) + 1
    assert {s: g.kernels for s, g in d.gpu.stages.items() if g.kernels} == by_stage
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in device]
    memory = [s for s, e in zip(spans, device, strict=True) if e["cat"] != "kernel"]
    compute = [s for s, e in zip(spans, device, strict=True) if e["cat"] == "kernel"]
    window = max(b for _, b in spans) - min(a for a, _ in spans)
    assert t.window == pytest.approx(window)
    assert t.compute == pytest.approx(union(compute))
    assert t.memory == pytest.approx(union(memory))
    assert t.idle == pytest.approx(window - union(spans))
    assert t.communication == 0.0  # one GPU, no NCCL


def hta_of(session: Path, out: Path, **env: str) -> dict[str, Any]:
    export_hta(session, out, workers=1)
    try:
        return run_hta(out, **env)
    except EngineInstallError as exc:
        if exc.unavailable:
            pytest.skip(f"HTA cannot be installed here (registry unreachable?): {exc}")
        raise


def rows_of(hta: dict[str, Any]) -> tuple[float, ...]:
    (row,) = hta["temporal"]
    keys = ("kernel_time(us)", "idle_time(us)", "compute_time(us)", "non_compute_time(us)")
    return tuple(row[k] for k in keys)


def profd_of(session: Path) -> tuple[float, ...]:
    (g,) = summarize_dir(session, workers=1).gpu
    return tuple(ms * 1000 for ms in (g.window_ms, g.idle_ms, g.compute_ms, g.non_compute_ms))


def test_hta_at_kinetos_resolution_is_profd(tmp_path: Path) -> None:
    """HTA told to keep Kineto's sub-µs times (HTA_DISABLE_NS_ROUNDING) gives profd's
    temporal breakdown on the real trace, and its kernel breakdown all the device time."""
    session = tmp_path / "session"
    session.mkdir()
    shutil.copy(RECORDED, session)
    hta = hta_of(session, tmp_path / "hta", HTA_DISABLE_NS_ROUNDING="1")
    # to 10 ns: Kineto's ts (~5.5e12 µs) hold about 1 ns in a float64, and the sums differ
    assert rows_of(hta) == pytest.approx(profd_of(session), abs=0.01)
    _, doc = recorded()
    device_us = sum(e["dur"] for e in doc["traceEvents"] if e.get("cat") in DEVICE)
    assert sum(r["sum (us)"] for r in hta["kernels"]) == pytest.approx(device_us, abs=0.01)


def test_hta_by_default_rounds_each_event_inwards(tmp_path: Path) -> None:
    """By default HTA 0.5 rounds every start up and every end down to a whole µs: on this
    trace's µs-long kernels that loses about a quarter of the compute time. profd gives HTA's
    figures exactly on a copy rounded that way, and keeps the real ones on the original
    (docs/hta-export.md)."""
    _, doc = recorded()
    for e in doc["traceEvents"]:
        if e.get("ph") == "X":
            end = math.floor(e["ts"] + e["dur"])
            e["ts"] = math.ceil(e["ts"])
            e["dur"] = end - e["ts"]
    rounded, original = tmp_path / "rounded", tmp_path / "original"
    rounded.mkdir()
    original.mkdir()
    (rounded / RECORDED.name.removesuffix(".gz")).write_text(json.dumps(doc))
    shutil.copy(RECORDED, original)
    hta = rows_of(hta_of(original, tmp_path / "hta"))
    assert hta == pytest.approx(profd_of(rounded), abs=1e-6)
    window, idle, compute, _ = profd_of(original)
    assert hta[2] < 0.85 * compute and hta[1] > idle + 0.01 * window  # > 1 point of idle


def test_hand_made_gpu_step_reads_the_same_in_both_layouts(tmp_path: Path) -> None:
    """The hand-computed step of test_gpu_breakdown, written in the classic layout, takes the
    fast path and gives the 2.13 layout's figures (HTA's rule: without step rows every
    device event counts, see test_gpu_breakdown)."""
    events = gpu_events(1)
    for layout in ("2.13", "classic"):
        (tmp_path / f"{layout}.json").write_text(kineto_text(header(0, 1), events, layout))
    new, old = digest_file(tmp_path / "2.13.json"), digest_file(tmp_path / "classic.json")
    assert (new.mode, old.mode) == ("fast", "fast")
    assert old.gpu == new.gpu and old.ops == new.ops and old.ranges == new.ranges
    assert old.gpu is not None and old.gpu.total == GpuTimes(
        kernels=9, window=85e3, idle=24e3, compute=50e3, non_compute=11e3,
        communication=15e3, memory=3e3, overlap=7e3,
    )  # fmt: skip
    assert {(CPU_PID, CPU_TID), ("Spans", "PyTorch Profiler")} <= set(old.threads)


def test_odd_classic_files_never_read_differently_on_the_fast_path(tmp_path: Path) -> None:
    """What the strict patterns cannot vouch for goes to the flexible one or the generic
    parser, never read otherwise: an exponent in a duration (the flexible pattern reads it),
    a lone ``B`` event beside a span-shaped object nested in an event (generic: the B is not
    taken for that span); a file on one line (``json.dumps``) reads as the original."""
    _, doc = recorded()
    real = digest_file(RECORDED)
    (tmp_path / "one_line.json").write_text(json.dumps(doc))
    d = digest_file(tmp_path / "one_line.json")
    assert (d.mode, d.gpu, d.ops) == ("fast", real.gpu, real.ops)
    nested = '{"ph": "X", "cat": "Trace", "ts": 999, "dur": 888, "pid": 1, "tid": 1, "name": "f"}'
    files = [
        ['{\n    "ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": 1,\n'
         '    "ts": 10.000, "dur": 5e-1,\n    "args": {\n      "x": 1\n    }\n  }'],
        ['{\n    "ph": "X", "cat": "cpu_op", "name": "b", "o": ' + nested + ', "pid": 1,'
         ' "tid": 1,\n    "ts": 20.000, "dur": 2.000,\n    "args": {\n      "x": 1\n    }\n  }',
         '{\n    "ph": "B", "cat": "cpu_op", "name": "c", "pid": 1, "tid": 1, "ts": 30.000\n  }'],
    ]  # fmt: skip
    for i, events in enumerate(files):
        path = tmp_path / f"odd{i}.json"
        body = ",\n  ".join(events)
        path.write_text('{\n  "schemaVersion": 1,\n  "traceEvents": [\n  ' + body + "\n  ]\n}\n")
        fast, generic = digest_file(path), digest_file(path, force_generic=True)
        assert fast.error is None and generic.error is None, i
        assert (fast.ops, fast.ranges) == (generic.ops, generic.ranges), i
        # the exponent is read by the flexible pattern; the B event leaves the fast path
        assert fast.mode == ("fast", "generic")[i], i
