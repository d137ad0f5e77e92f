"""The fake SGLang against SGLang 0.5.23's source (tests/fixtures/sglang/FACTS.md; its server
does not run on these machines: no CPU build of sgl_kernel). File names, the memory snapshot,
the answers to keys, repeated and late requests, and how many forward passes num_steps
records."""

from __future__ import annotations

import re

import httpx
import pytest

from profd.testing.fake_engines import FakeSglangServer, read_trace

# profiler_manager.py:343-363 and the MEM snapshot's name (FACTS.md, 1 and 2)
TRACE = re.compile(
    r"^(?:[^-]+-)?(?P<id>\d+\.\d+)-TP-(?P<tp>\d+)(?:-DP-(?P<dp>\d+))?(?:-PP-(?P<pp>\d+))?"
    r"(?:-EP-(?P<ep>\d+))?(?:-EXTEND|-DECODE)?\.trace\.json\.gz$"
)
MEMORY = re.compile(r"^(?:[^-]+-)?\d+\.\d+-TP-(?P<tp>\d+)-memory\.pickle$")


def start(fake: FakeSglangServer, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{fake.url}/start_profile", json=body, headers=headers)


def stop(fake: FakeSglangServer, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{fake.url}/stop_profile", headers=headers)


@pytest.mark.parametrize(
    ("tp", "dp", "pp", "ep"), [(2, 1, 1, 1), (4, 1, 1, 2), (2, 2, 1, 1), (2, 1, 2, 1)]
)
def test_trace_names_follow_the_source(tmp_path, tp, dp, pp, ep) -> None:
    with FakeSglangServer(tp, dp, pp, ep=ep) as fake:
        assert start(fake, {"output_dir": str(tmp_path)}).text == "Start profiling.\n"
        fake.advance(2)
        assert stop(fake).text == "Stop profiling. This will take some time.\n"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == tp * dp * pp
    parts = [TRACE.match(n) for n in names]
    assert all(parts), names
    assert len({m["id"] for m in parts}) == 1  # one profile id per window
    for m in parts:
        # a part only when its size is above 1; EP follows the tp rank: tp // (tp / ep)
        assert (m["dp"] is not None, m["pp"] is not None, m["ep"] is not None) == (
            dp > 1,
            pp > 1,
            ep > 1,
        )
        if ep > 1:
            assert int(m["ep"]) == int(m["tp"]) // (tp // ep)


def test_mem_writes_one_snapshot_per_tp_rank_without_the_other_parts(tmp_path) -> None:
    with FakeSglangServer(2, 2, 1) as fake:
        start(fake, {"output_dir": str(tmp_path), "activities": ["CPU", "GPU", "MEM"]})
        fake.advance(1)
        stop(fake)
    snaps = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".pickle")
    assert [MEMORY.match(n)["tp"] for n in snaps] == ["0", "1"]


def test_keys_repeats_and_late_stops_are_answered_as_sglang_does(tmp_path) -> None:
    with FakeSglangServer(1, api_key="admin") as fake:
        denied = start(fake, {"output_dir": str(tmp_path)})
        assert (denied.status_code, denied.json()) == (401, {"error": "Unauthorized"})
        assert start(fake, {"output_dir": str(tmp_path)}, "admin").status_code == 200
        again = start(fake, {"output_dir": str(tmp_path)}, "admin")  # already in progress
        assert (again.status_code, again.text) == (500, "Internal Server Error")
        assert stop(fake, "admin").status_code == 200
        late = stop(fake, "admin")  # not in progress: an unhandled RuntimeError
        assert (late.status_code, late.text) == (500, "Internal Server Error")


@pytest.mark.parametrize("start_step", [None, 3])
def test_num_steps_records_exactly_that_many_forward_passes(tmp_path, start_step) -> None:
    with FakeSglangServer(1) as fake:
        fake.advance(1)  # the server has served one pass before the window
        body = {"output_dir": str(tmp_path), "num_steps": 4}
        if start_step is not None:
            body["start_step"] = start_step  # absolute: the forward counter since launch
        start(fake, body)
        fake.advance(10)  # it stops and writes by itself
        assert len(list(tmp_path.iterdir())) == 1
    (trace,) = tmp_path.iterdir()
    passes = read_trace(trace)["fake_engine"]["iterations"]
    assert passes == ([2, 3, 4, 5] if start_step is None else [3, 4, 5, 6])
