"""``profd stacks`` on a hung job, as a user meets it: a real ``profd up`` (its own local Ray)
and the user's data-parallel job (``examples/spmd_hang.py``, four Ray actors on gloo) in its
own process. At step 3 rank 2's data loader never returns and ranks 0, 1 and 3 wait for it
in ``all_reduce``: no session, no step mark any more.

``profd stacks`` puts rank 2 alone in the first group, its top frame the loader's wait, and
the other three together in ``all_reduce``; read by py-spy from the node, and read again by
the agents' own threads (``--method agent``) it gives the very same groups and frames.
(py-spy refused by the kernel falls back to the agents: ``tests/coordinator/test_stacks.py``.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from lifecycle import ROOT, Home

from helpers import wait_until

pytestmark = pytest.mark.slow

HANG = ROOT / "examples" / "spmd_hang.py"
#: Posted by `profd up --trigger`: the job's role watched for stragglers and memory errors
#: (its marks keep their ends while the straggler trigger watches; a hung job fires neither).
TRIGGERS = [
    {
        "name": "late-update",
        "when": {"kind": "straggler", "role": "trainer", "stage": "update", "min_ms": 1000},
    },
    {"name": "trainer-oom", "when": {"kind": "oom", "role": "trainer"}},
]


class HungJob:
    """The example in its own process; ``hung`` once it reported that no step moved."""

    def __init__(self, home: Home) -> None:
        self.log = (home.root / "hang.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(HANG), "--address", home.state()["ray_address"],
             "--stuck-rank", "2", "--stuck-at", "3", "--hung-after", "1.5"],
            env=home.env, cwd=home.root, stdout=subprocess.PIPE, stderr=self.log, text=True,
        )  # fmt: skip
        self.lines: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(json.loads(line))

    def hung(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the job exited ({self.proc.returncode})")
        return any(d.get("hung") for d in self.lines)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def hung(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Home]:
    home = Home(tmp_path_factory.mktemp("stacks"))
    job = None
    triggers = home.root / "triggers.json"
    triggers.write_text(json.dumps(TRIGGERS))
    try:
        home.up("--trigger", str(triggers))  # the launch-time form of `profd watch`
        job = HungJob(home)
        wait_until(job.hung, 180, 0.2, what="the job to hang")
        yield home
    finally:
        if job is not None:
            job.kill()
        home.close()


def _stacks(home: Home, *args: str) -> dict[str, Any]:
    r = home.cli("stacks", "--json", *args, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def _shape(view: dict[str, Any]) -> list[tuple[list[int], list[tuple[str, str, int]]]]:
    return [
        (
            [r["rank"] for r in g["ranks"]],
            [(f["function"], f["file"], f["line"]) for f in g["stack"]],
        )
        for g in view["groups"]
    ]


def test_the_stuck_rank_is_alone_in_its_wait_by_py_spy_and_by_the_agents(hung: Home) -> None:
    by_py_spy = _stacks(hung)
    assert by_py_spy["missing"] == [] and by_py_spy["notes"] == []
    (odd, rest) = by_py_spy["groups"]
    assert [(r["role"], r["rank"]) for r in odd["ranks"]] == [("trainer", 2)]
    assert [r["rank"] for r in rest["ranks"]] == [0, 1, 3]
    top = [f["function"] for f in odd["stack"]]
    assert top[:3] == ["Condition.wait", "Queue.get", "DataParallelRank.load_batch"], top
    assert odd["stack"][0]["file"].endswith("threading.py")
    assert rest["stack"][0]["function"] == "all_reduce"
    assert "DataParallelRank.run" in [f["function"] for f in rest["stack"]]
    for g in (odd, rest):
        for r in g["ranks"]:
            assert r["method"] == "py_spy" and r["pid"] > 0 and r["node"] and r["thread"], r

    by_agents = _stacks(hung, "--method", "agent")
    assert by_agents["missing"] == []
    assert {r["method"] for g in by_agents["groups"] for r in g["ranks"]} == {"agent"}
    assert _shape(by_agents) == _shape(by_py_spy)  # the same groups, the same frames


def test_native_frames_filters_and_bad_queries(hung: Home) -> None:
    r = hung.http("GET", "/api/v1/stacks", params={"native": "true", "ranks": "2"})
    assert r.status_code == 200, r.text
    native = r.json()
    ((group),) = native["groups"]
    assert [r["rank"] for r in group["ranks"]] == [2] and native["native"] is True
    lines = [f["line"] for f in group["stack"]]
    assert 0 in lines and any(n > 0 for n in lines)  # native frames beside Python ones
    assert "DataParallelRank.load_batch" in [f["function"] for f in group["stack"]]

    params = {"role": "trainer", "ranks": ["1", "7"]}
    one = hung.http("GET", "/api/v1/stacks", params=params).json()
    assert [[r["rank"] for r in g["ranks"]] for g in one["groups"]] == [[1]]
    assert [(m["rank"], m["reason"]) for m in one["missing"]] == [
        (7, "no live agent has this rank")
    ]
    table = hung.cli("stacks", "--depth", "3")
    assert table.returncode == 0, table.stderr
    out = table.stdout
    assert "4 process(es) in 2 group(s)" in out and "trainer rank(s) 2 " in out
    assert out.index("Queue.get") < out.index("all_reduce")  # the odd group first

    r = hung.http("GET", "/api/v1/stacks", params={"role": "nobody"})
    assert r.status_code == 404 and "role" in r.json()["message"]
    r = hung.http("GET", "/api/v1/stacks", params={"ranks": "1,x"})
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "ranks"
    r = hung.http("GET", "/api/v1/stacks", params={"native": "true", "method": "agent"})
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "native"
    r = hung.http("GET", "/api/v1/stacks", params={"timeout_s": "nan"})  # not "<= 60"
    assert r.status_code == 422 and "finite" in r.json()["fields"][0]["message"], r.text


def test_profd_up_posted_the_launch_time_triggers(hung: Home) -> None:
    r = hung.http("GET", "/api/v1/triggers")
    assert r.status_code == 200, r.text
    got = {t["name"]: t for t in r.json()["data"]}
    assert set(got) == {"late-update", "trainer-oom"}
    assert got["late-update"]["request"]["when"]["kind"] == "straggler"
    assert all(t["fired"] == 0 for t in got.values())  # nothing was slow or out of memory
