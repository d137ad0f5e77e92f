"""A replica's windows end in two parts: the engine's stop (the replica is free at once) and
the collection of its files (on a thread of its own), so a later step group's window starts
while the earlier group's files settle. Which files are whose, and what each part reports,
against fake vLLM / SGLang servers over real HTTP; the service's events are read directly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rollout_helpers import sglang_pair, vllm_pair

from profd.core.protocol import AgentEvent, AgentPlan, EventKind, PartDone, WindowPlan
from profd.core.states import ControllerPhase as P
from profd.rollout import EngineProfileOptions
from profd.rollout.relocate import FlushWait
from profd.rollout.service import RolloutService

from helpers import wait_until

OPTS = EngineProfileOptions()
#: Files settle slower than the test's steps last (as a 2 s settle against short steps).
SLOW = FlushWait(
    settle_s=1.5, gz_settle_s=1.5, poll_s=0.05, timeout_s=30, first_file_timeout_s=10,
    peer_grace_s=5,
)  # fmt: skip


class Replica:
    """A service whose plans the test hands in (as its poller would) and whose events it
    reads (as its channel would send them)."""

    def __init__(self, agent: Any, fake: Any, colocated: bool = False) -> None:
        self.fake = fake
        self.svc = RolloutService(agent, replicas=1, colocated=colocated, find_link=lambda: None)
        self.events: list[AgentEvent] = []
        self.svc._emit = self.events.append
        self.svc._worker.start()
        self._version = 0

    def phase(self, window: WindowPlan, step: int, phase: P) -> None:
        self._version += 1
        self.svc._work.put(AgentPlan(self._version, (window,), step, phase))

    def requests(self, path: str) -> int:
        return sum(1 for _, p, _ in self.fake.requests if p == path)

    def part_done(self) -> PartDone:
        done = wait_until(
            lambda: [e.payload for e in self.events if e.kind is EventKind.PART_DONE], 30,
            what="part done",
        )  # fmt: skip
        self.svc.close(10)
        assert len(done) == 1, done
        return done[0]

    def of(self, kind: EventKind) -> list[AgentEvent]:
        return [e for e in self.events if e.kind is kind]


def window(tmp_path: Path, steps: tuple[int, ...], groups: tuple[tuple[int, ...], ...]):
    return WindowPlan("s1", "torch", steps, groups, False, {}, str(tmp_path / "s1"), "*")


def two_groups(r: Replica, w: WindowPlan) -> None:
    """Steps 4 and 5, a group each, shorter than the files' settle."""
    for n, step in enumerate((4, 5), start=1):
        r.phase(w, step, P.STEP_BEGIN)
        wait_until(lambda n=n: r.requests("/start_profile") == n, 10, what=f"start {n}")
        r.fake.advance(2)
        r.phase(w, step, P.STEP_END)
        wait_until(lambda n=n: r.requests("/stop_profile") == n, 10, what=f"stop {n}")


def test_a_step_being_collected_is_not_called_missed(tmp_path) -> None:
    """The next group's step begins while the earlier group's files settle: that step is
    neither missed nor reported so (it was, as "the driver's step passed before the
    replica's window could start")."""
    fake, agent = vllm_pair(tmp_path, tp=1, flush=SLOW)
    with fake:
        r = Replica(agent, fake)
        two_groups(r, window(tmp_path, (4, 5), ((4,), (5,))))
        done = r.part_done()
    assert (done.recorded, done.missed) == ((4, 5), ()), done
    assert not r.of(EventKind.MISSED)
    assert sorted(e.step for e in r.of(EventKind.TRACE)) == [4, 5]


def test_a_colocated_step_being_collected_is_not_called_unmarked(tmp_path) -> None:
    """A colocated replica's step ends while its files settle: not missed for want of
    ``rollout()`` marks (it was reported so, every step)."""
    fake, agent = vllm_pair(tmp_path, tp=1, flush=SLOW)
    with fake:
        r = Replica(agent, fake, colocated=True)
        w = window(tmp_path, (4,), ((4,),))
        r.phase(w, 4, P.STEP_BEGIN)
        r.phase(w, 4, P.ROLLOUT_BEGIN)
        wait_until(lambda: r.requests("/start_profile") == 1, 10, what="start")
        fake.advance(2)
        r.phase(w, 4, P.ROLLOUT_END)
        wait_until(lambda: r.requests("/stop_profile") == 1, 10, what="stop")
        r.phase(w, 4, P.STEP_END)
        done = r.part_done()
    assert (done.recorded, done.missed) == ((4,), ()), done
    assert not r.of(EventKind.MISSED)


def test_an_engine_whose_stop_answers_before_its_files_keeps_each_group_apart(tmp_path):
    """SGLang's stop may answer before its ranks' files exist (only TP-0 answers it): its
    next group starts once the earlier group's files are in, so each group keeps its own
    (all four went to the second group, the first was missed)."""
    fake, agent = sglang_pair(
        tmp_path, tp=2, flush=SLOW, stop_blocks=False, appear_delay_s=0.3, flush_s=0.2
    )
    with fake:
        r = Replica(agent, fake)
        two_groups(r, window(tmp_path, (4, 5), ((4,), (5,))))
        done = r.part_done()
    assert (done.recorded, done.missed) == ((4, 5), ()), done
    assert sorted(e.step for e in r.of(EventKind.TRACE)) == [4, 4, 5, 5]


def test_a_window_in_another_directory_leaves_the_earlier_collection_alone(tmp_path):
    """SGLang writes each session's files in that session's directory: a window of another
    session starting does not cut the earlier one's wait short (its trace was left behind,
    unindexed)."""
    fake, agent = sglang_pair(tmp_path, tp=1, stop_blocks=False, appear_delay_s=0.3)
    with fake:
        assert agent.start_window("a", tmp_path / "a", OPTS).ok
        fake.advance(2)
        first = agent.stop_window("a")
        assert agent.start_window("b", tmp_path / "b", OPTS).ok  # at once: another directory
        a = agent.collect(first)
        fake.advance(2)
        b = agent.finish_window("b")
    for out, session in ((a, "a"), (b, "b")):
        assert out.state.value == "done", out.reason
        (trace,) = out.traces
        assert Path(trace.path).is_relative_to(tmp_path / session)


@pytest.mark.parametrize("collected_before_the_next_stop", [True, False])
def test_a_side_file_rewritten_in_place_is_never_taken_with_the_next_windows_content(
    tmp_path, collected_before_the_next_stop: bool
) -> None:
    """vLLM rewrites ``rank<k>.profiler_out.txt`` at every stop. Once the next window has
    started, the earlier window's files are whole (its stop returned with them written):
    its collection takes its side file at once; one still uncollected when the next stop
    rewrites it is left to that window, with a warning (it was moved away as the earlier
    window's, with the next one's content)."""
    fake, agent = vllm_pair(tmp_path, tp=1, flush=SLOW)
    with fake:
        assert agent.start_window("a", tmp_path / "a", OPTS).ok
        fake.advance(2)
        first = agent.stop_window("a")
        assert agent.start_window("b", tmp_path / "b", OPTS).ok
        a = agent.collect(first) if collected_before_the_next_stop else None
        fake.advance(2)
        second = agent.stop_window("b")
        a = a or agent.collect(first)
        b = agent.collect(second)
    assert a.state.value == b.state.value == "done", (a.reason, b.reason)
    assert len(a.traces) == len(b.traces) == 1
    (side_b,) = b.side_files
    assert Path(side_b).is_relative_to(tmp_path / "b")
    if collected_before_the_next_stop:
        (side_a,) = a.side_files
        assert Path(side_a).is_relative_to(tmp_path / "a")
    else:
        assert a.side_files == ()
        assert any("written again by the engine's next window" in w for w in a.warnings)


def test_a_start_on_the_thread_that_stopped_collects_the_earlier_window_first(tmp_path):
    """The agent used alone, one thread: stop, then start again in the same directory,
    with an engine whose stop answers before its files (SGLang). The start collects the
    earlier window itself (nobody else would: it waited forever), and a later ``collect``
    answers with that same outcome."""
    import threading

    fake, agent = sglang_pair(tmp_path, tp=1, stop_blocks=False, appear_delay_s=0.3)
    with fake:
        assert agent.start_window("a", tmp_path / "s", OPTS).ok
        fake.advance(2)
        first = agent.stop_window("a")
        started: list[Any] = []
        start = threading.Thread(  # (a thread: the test ends if it hangs, as it did)
            target=lambda: started.append(agent.start_window("b", tmp_path / "s", OPTS)),
            daemon=True,
        )
        start.start()
        start.join(30)
        assert started and started[0].ok, started
        a = agent.collect(first)
        assert a is agent.collect(first) and a.state.value == "done", a.reason
        assert len(a.traces) == 1 and agent.windows_finished == 1
        fake.advance(2)
        b = agent.finish_window("b")
    assert b.state.value == "done" and len(b.traces) == 1, b.reason
    assert b.traces[0].path != a.traces[0].path


def test_a_frozen_window_without_files_says_why_once_with_vllms_hints(tmp_path):
    """A vLLM before 0.32 writes nothing after a repeated start/stop in one process: the
    second window, frozen by a third's start, says so (its reason named the replica twice
    and lost the hint)."""
    fake, agent = vllm_pair(tmp_path, tp=1, version="0.31.0", no_files_after_first_window=True)
    with fake:
        for sid in ("a", "b"):
            assert agent.start_window(sid, tmp_path / sid, OPTS).ok
            fake.advance(2)
            stopped = agent.stop_window(sid)
        assert agent.start_window("c", tmp_path / "c", OPTS).ok
        b = agent.collect(stopped)
        agent.finish_window("c")
    assert b.state.value != "done" and not b.traces
    assert b.reason.count("replica 0") == 1, b.reason
    assert "when its stop returned" in b.reason and "before 0.32" in b.reason, b.reason
