"""Stacks through an in-process coordinator and real agents, each attached on its own thread
of this process: rank 2's thread is stuck in its loader, ranks 0 and 1 wait for their peers.

Real py-spy reads them from outside; py-spy refused by the kernel (a real refusal: the
py-spy given to profd runs without CAP_SYS_PTRACE, so Linux refuses to let it attach to this
process) falls back to the agents' own threads, and the groups and frames are the same. An
agent whose poller is gone is listed as missing, never an error of the whole request."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from profd.core.errors import ConflictError, NotFoundError
from profd.core.stacks import find_py_spy

from helpers import coordinator_settings, wait_until

WORLD = 3
STUCK = 2


def stuck_loader(release: threading.Event) -> None:
    release.wait()  # the read that never returns


def wait_for_peers(release: threading.Event) -> None:
    release.wait()  # a collective waiting for the stuck rank


class Rank(threading.Thread):
    """One rank's training thread: attaches its agent, then blocks where its rank blocks."""

    def __init__(self, owner: Any, rank: int, release: threading.Event) -> None:
        super().__init__(name=f"rank-{rank}", daemon=True)
        self.owner, self.rank, self.release = owner, rank, release
        self.agent: Any = None
        self.attached = threading.Event()

    def run(self) -> None:
        from profd.agent import ProfilerAgent

        self.agent = ProfilerAgent("trainer", self.rank, WORLD, find_link=self.owner.link)
        self.agent.start()
        self.attached.set()
        if self.rank == STUCK:
            stuck_loader(self.release)
        else:
            wait_for_peers(self.release)


def _owner(tmp_path: Path, **settings: Any) -> Any:
    from profd.actors.coordinator import ProfileCoordinator
    from profd.actors.runner import LocalRunner
    from profd.testing.coordinator import InProcessCoordinator

    coordinator = ProfileCoordinator(
        coordinator_settings(tmp_path, **settings), runner=LocalRunner()
    )
    return InProcessCoordinator(coordinator)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[Any, list[Rank]]]:
    owner = _owner(tmp_path)
    release = threading.Event()
    ranks = [Rank(owner, r, release) for r in range(WORLD)]
    try:
        for r in ranks:
            r.start()
        wait_until(
            lambda: all(r.attached.is_set() and r.agent.connected for r in ranks), 20,
            what="agents registered",
        )  # fmt: skip
        yield owner, ranks
    finally:
        release.set()
        for r in ranks:
            r.join(5)
            if r.agent is not None:
                r.agent.close(2)
        owner.close()


def _shape(view: Any) -> list[tuple[list[int], list[tuple[str, str, int]]]]:
    return [
        ([r.rank for r in g.ranks], [(f.function, f.file, f.line) for f in g.stack])
        for g in view.groups
    ]


def refuse_py_spy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The real py-spy, run without CAP_SYS_PTRACE: the kernel refuses it this process."""
    real, setpriv = find_py_spy(), shutil.which("setpriv")
    if real is None or setpriv is None:
        pytest.skip("needs py-spy and setpriv")
    wrapper = tmp_path / "py-spy"
    drop = "--bounding-set=-sys_ptrace --inh-caps=-sys_ptrace"
    wrapper.write_text(f'#!/bin/sh\nexec {setpriv} {drop} -- {real} "$@"\n')
    wrapper.chmod(0o755)
    probe = subprocess.run([str(wrapper), "dump", "--pid", str(os.getpid())], capture_output=True)
    assert probe.returncode != 0 and b"Permission denied" in probe.stderr, probe.stderr
    monkeypatch.setenv("PROFD_PY_SPY", str(wrapper))
    return str(wrapper)


def test_py_spy_refused_falls_back_to_the_agents_with_the_same_groups(
    job: tuple[Any, list[Rank]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    owner, _ = job
    by_py_spy = owner.call("stacks", {})
    assert by_py_spy.notes == [] and by_py_spy.missing == []
    assert [[r.rank for r in g.ranks] for g in by_py_spy.groups] == [[STUCK], [0, 1]]
    odd = by_py_spy.groups[0]
    assert [f.function for f in odd.stack[:3]] == ["Condition.wait", "Event.wait", "stuck_loader"]
    assert by_py_spy.groups[1].stack[2].function == "wait_for_peers"
    assert {r.method for g in by_py_spy.groups for r in g.ranks} == {"py_spy"}
    assert {r.thread for g in by_py_spy.groups for r in g.ranks} == {"rank-0", "rank-1", "rank-2"}

    refuse_py_spy(tmp_path, monkeypatch)
    fallback = owner.call("stacks", {})
    assert _shape(fallback) == _shape(by_py_spy)  # the same groups, the same frames
    assert {r.method for g in fallback.groups for r in g.ranks} == {"agent"}
    (note,) = fallback.notes
    assert note.startswith("py-spy could not read 3 process(es)") and "Permission denied" in note

    only = owner.call("stacks", {"method": "py_spy"})  # py-spy or nothing: missing, with why
    assert only.groups == [] and len(only.missing) == WORLD
    assert all("Permission denied" in m.reason for m in only.missing)


def test_filters_a_silent_agent_and_py_spy_turned_off(
    job: tuple[Any, list[Rank]], tmp_path: Path
) -> None:
    owner, ranks = job
    view = owner.call("stacks", {"method": "agent", "ranks": [1, 5]})
    assert [[r.rank for r in g.ranks] for g in view.groups] == [[1]]
    assert [(m.rank, m.reason) for m in view.missing] == [(5, "no live agent has this rank")]
    with pytest.raises(NotFoundError, match="role: no live agent has role 'critic'"):
        owner.call("stacks", {"role": "critic"})
    # a job: these in-process agents are in this process's (none outside Ray); another's id
    # matches none of them
    (job,) = {a.job_id or "none" for a in owner.call("list_agents")}
    view = owner.call("stacks", {"method": "agent", "ranks": [1], "job_id": job})
    assert [[r.rank for r in g.ranks] for g in view.groups] == [[1]]
    with pytest.raises(NotFoundError, match="job_id: no live agent of Ray job 'ffffffff'"):
        owner.call("stacks", {"job_id": "ffffffff"})
    with pytest.raises(ValueError, match="native"):
        owner.call("stacks", {"native": True, "method": "agent"})

    ranks[0].agent._channel.stop(1)  # its poller ends with its next long-poll
    wait_until(lambda: not ranks[0].agent._channel._threads[0].is_alive(), 20, what="poller")
    view = owner.call("stacks", {"method": "agent", "timeout_s": 0.5})
    assert [[r.rank for r in g.ranks] for g in view.groups] == [[1], [2]]
    ((silent),) = view.missing
    assert silent.rank == 0 and "did not answer within 0.5 s" in silent.reason

    off = _owner(tmp_path / "off", stacks_py_spy=False)
    try:
        with pytest.raises(ConflictError, match="stacks_py_spy"):
            off.call("stacks", {"method": "py_spy"})
        assert off.call("stacks", {}).notes == ["no agent is attached"]
    finally:
        off.close()
