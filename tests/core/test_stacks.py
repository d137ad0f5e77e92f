"""Stacks without a job: which thread stands for a process, grouping (odd groups first),
py-spy's own output read back, and the query's rules."""

from __future__ import annotations

import subprocess
import sys
import time

import orjson
import pytest

from profd.core.errors import RequestInvalid
from profd.core.protocol import StackFrame
from profd.core.stacks import (
    RankStack,
    StackQuery,
    ThreadStack,
    find_py_spy,
    group_stacks,
    pick_thread,
    threads_from_py_spy,
)

WAIT = StackFrame("Condition.wait", "/py/threading.py", 331)
LOOP = StackFrame("Worker.main_loop", "/ray/_private/worker.py", 1069)
NATIVE = StackFrame("epoll_wait", "/lib/libc.so.6", 0)


def _t(native_id: int, name: str, *functions: str) -> ThreadStack:
    return ThreadStack(native_id, name, tuple(StackFrame(f, "/job.py", 1) for f in functions))


def test_the_thread_that_attached_wins_while_it_runs_the_jobs_code() -> None:
    main = ThreadStack(1, "MainThread", (LOOP,))
    pool = _t(7, "Dummy-1", "all_reduce", "run", "executor")
    helper = _t(8, "loader", "get", "fill")
    own = _t(9, "profd-poller", "get", "poll", "loop", "run", "boot")
    assert pick_thread([main, pool, helper, own], attached=8) is helper
    # the thread that attached is a Ray pool thread between calls: the deepest job thread
    assert pick_thread([main, pool, helper, own], attached=42) is pool
    # native frames (py-spy --native) do not hide an idle Ray main thread
    idle_native = ThreadStack(1, "MainThread", (NATIVE, LOOP))
    assert pick_thread([idle_native, pool], attached=1) is pool
    # nothing runs the job's code: the one that attached, else the main thread
    gc = _t(3, "PythonGCThread", "wait")
    assert pick_thread([main, gc, own], attached=3) is gc
    assert pick_thread([main, gc, own], attached=None) is main
    assert pick_thread([gc], attached=None) is None


def _rank(rank: int, *functions: str, role: str = "actor") -> RankStack:
    frames = tuple(StackFrame(f, "/job.py", 1) for f in functions)
    return RankStack(role, rank, 100 + rank, "node-a", "agent", frames)


def test_groups_put_identical_stacks_together_the_odd_ones_first() -> None:
    stacks = [
        _rank(3, "all_reduce", "update"),
        _rank(2, "get", "load"),
        _rank(0, "all_reduce", "update"),
        _rank(1, "all_reduce", "update"),
        _rank(0, "get", "load", role="critic"),
    ]
    groups = group_stacks(stacks)  # roles mix in a group: the stack decides
    assert [[(r.role, r.rank) for r in g.ranks] for g in groups] == [
        [("actor", 2), ("critic", 0)],
        [("actor", 0), ("actor", 1), ("actor", 3)],
    ]
    assert groups[1].frames[0].function == "all_reduce"
    lone = group_stacks([_rank(5, "a"), _rank(4, "b"), _rank(0, "c"), _rank(1, "c")])
    assert [[r.rank for r in g.ranks] for g in lone] == [[4], [5], [0, 1]]


def test_py_spys_own_dump_of_a_waiting_process_is_read_back() -> None:
    exe = find_py_spy()
    if exe is None:
        pytest.skip("py-spy is not installed")
    code = "import threading\ndef parked():\n    threading.Event().wait(60)\nparked()\n"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(50):  # until the child is parked in its wait (py-spy shows it)
            out = subprocess.run([exe, "dump", "--json", "--pid", str(proc.pid)],
                                 capture_output=True, check=True)  # fmt: skip
            threads = threads_from_py_spy(orjson.loads(out.stdout))
            if threads and [f.function for f in threads[0].frames][:3] == [
                "Condition.wait", "Event.wait", "parked"
            ]:  # fmt: skip
                break
            time.sleep(0.1)
        (main,) = threads
        assert main.name == "MainThread" and main.native_id == proc.pid
        assert [f.function for f in main.frames] == [
            "Condition.wait", "Event.wait", "parked", "<module>"
        ]  # fmt: skip
        assert main.frames[0].file.endswith("threading.py") and main.frames[2].line == 3
        assert pick_thread(threads, proc.pid) is main
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(ValueError, match="expected a JSON list"):
        threads_from_py_spy({"not": "a list"})


def test_queries_fail_naming_the_field() -> None:
    assert StackQuery.parse().method.value == "auto"
    for fields, field in (
        ({"native": True, "method": "agent"}, "native"),
        ({"ranks": [1, -1]}, "ranks"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"method": "gdb"}, "method"),
        ({"role": ""}, "role"),
        ({"colour": "red"}, "colour"),
    ):
        with pytest.raises(RequestInvalid) as err:
            StackQuery.parse(**fields)
        assert [f.field for f in err.value.fields] == [field], fields
