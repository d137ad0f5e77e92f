"""An agent that closes stays closed, and still gets its last events through.

Once the coordinator has an agent's ``closed`` event it answers "unknown" for it (its relay
drops it); a closing agent answered so must not register again. But an "unknown" that
comes *before* the coordinator took the event (a coordinator restarted while the job ended)
must still lead to a registration, or the ``closed`` event and the last window's events are
never sent."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from profd.agent.channel import Channel
from profd.core.protocol import AgentEvent, AgentInfo, AgentPlan, EventKind, PollReply

from helpers import wait_until

INFO = AgentInfo("actor-0-x", "actor", 0, 1, {}, "h", 1)


class Registration:
    def __init__(self) -> None:
        self.plan = AgentPlan(version=1)
        self.poll_timeout_s = 1.0


class ScriptedLink:
    """A coordinator the test drives: it forgets the agent on ``forget()``, and answers
    "unknown" to the agent's polls from then on until it registers again."""

    def __init__(self) -> None:
        self.known = False
        self.registrations = 0
        self.reported: list[AgentEvent] = []
        self.poll_unknown = threading.Event()  # a poll was answered "unknown"
        self.registered_after_unknown = threading.Event()
        self.hold_closed = threading.Event()  # set: the `closed` report answers at once
        self.hold_closed.set()
        self._changed = threading.Condition()

    def register(self, info: Any, step: int | None) -> Registration:
        with self._changed:
            self.known = True
            self.registrations += 1
            if self.poll_unknown.is_set():
                self.registered_after_unknown.set()
            self._changed.notify_all()
        return Registration()

    def forget(self) -> None:
        with self._changed:
            self.known = False
            self._changed.notify_all()

    def poll(self, agent_id: str, version: int, step: int | None, timeout: float) -> PollReply:
        with self._changed:
            self._changed.wait_for(lambda: not self.known, timeout)
            if self.known:
                return PollReply(plan=None)
        self.poll_unknown.set()
        return PollReply(plan=None, known=False)

    def report(self, agent_id: str, events: list[AgentEvent]) -> bool:
        if not self.known:
            return False
        self.reported.extend(events)
        if any(e.kind is EventKind.CLOSED for e in events):
            self.forget()  # the coordinator took it: it forgets the agent ...
            # ... and its answer to the relay's sync may reach the poller first
            assert self.hold_closed.wait(10)
        return True

    def clock_ns(self) -> int:
        raise RuntimeError("no clock here")


def channel(link: ScriptedLink) -> Channel:
    made = Channel(INFO, lambda: link, lambda: None, lambda plan: None, retry_s=(0.01, 0.05))
    made.start()
    wait_until(lambda: made.connected, 10, 0.01, what="registration")
    return made


def test_told_unknown_once_the_coordinator_took_closed_it_does_not_register_again() -> None:
    link = ScriptedLink()
    ch = channel(link)
    poller = next(t for t in ch._threads if t.name == "profd-poller")
    link.hold_closed.clear()  # the `closed` report's answer waits for the poller's "unknown"
    ch.leave()
    ch.send(AgentEvent(EventKind.CLOSED))
    assert link.poll_unknown.wait(10)
    link.hold_closed.set()  # now the reporter hears that the coordinator took it
    assert ch.flush(10)
    poller.join(10)
    assert not poller.is_alive() and link.registrations == 1
    assert not link.registered_after_unknown.is_set()
    ch.stop()


def test_told_unknown_before_closed_got_through_it_registers_and_sends_it() -> None:
    """A coordinator restarted while the job ended: it knows no agent, so the poll and the
    report are both refused; the agent registers again and delivers ``closed``."""
    link = ScriptedLink()
    ch = channel(link)
    ch.leave()
    link.forget()
    assert link.poll_unknown.wait(10)
    ch.send(AgentEvent(EventKind.CLOSED))
    assert ch.flush(10), "the closed event never got through"
    assert link.registered_after_unknown.is_set() and link.registrations == 2
    assert [e.kind for e in link.reported] == [EventKind.CLOSED]
    ch.stop()


def run_script(script: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``script`` in a Python process of its own (``tests/`` as its argv[1], then ``args``),
    which must end normally: a crash there is a failure here, not of the test run."""
    tests = str(Path(__file__).resolve().parents[1])
    r = subprocess.run(
        [sys.executable, "-c", script, tests, *args], capture_output=True, text=True,
        timeout=120, cwd=cwd,
    )  # fmt: skip
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    return r


# In a process of its own: before the torch backend refused it, this crashed the process.
THREAD_ENDED = r"""
import sys, tempfile, threading
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from helpers import coordinator_settings, start_agents, wait_armed
from profd.actors.coordinator import ProfileCoordinator
from profd.testing.coordinator import InProcessCoordinator

owner = InProcessCoordinator(ProfileCoordinator(coordinator_settings(Path(tempfile.mkdtemp()))))
(agent,) = start_agents(owner, 1, "actor")
sid = owner.call("create_session", {"steps": [3, 4, 5, 6], "profile_continuous_steps": True}
                 ).session_id
wait_armed(agent, sid)

def training():  # the job's loop ends inside the window, without closing the agent
    for n in range(1, 5):
        with agent.step(n), agent.stage("work"):
            torch.ones(4).sum()

thread = threading.Thread(target=training, name="training")
thread.start()
thread.join()
print("closed:", agent.close(timeout=10))  # at exit, from the main thread
part = owner.call("get_session", sid).targets[0]
print("state:", part.state.value)
print("reason:", part.reason)
print("warnings:", owner.call("get_session", sid).warnings)
owner.close()
"""


def test_a_job_whose_training_thread_ends_mid_window_survives_its_close(tmp_path) -> None:
    """The training thread ends inside a window and the agent is closed from the main
    thread (atexit does that): torch can stop the window only on its thread, so the window
    fails, saying why, and the process ends normally (it crashed in Kineto's export)."""
    r = run_script(THREAD_ENDED, tmp_path)
    assert "state: failed" in r.stdout, r.stdout
    assert "the thread that started this torch window (training) ended" in r.stdout, r.stdout


# In a process of its own (the profiler state it checks is the process's).
CLOSED_ELSEWHERE = r"""
import sys, tempfile, threading, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from helpers import coordinator_settings, start_agents, wait_armed
from profd.actors.coordinator import ProfileCoordinator
from profd.testing.coordinator import InProcessCoordinator

owner = InProcessCoordinator(ProfileCoordinator(coordinator_settings(Path(tempfile.mkdtemp()))))
(agent,) = start_agents(owner, 1, "actor")
sid = owner.call("create_session", {"steps": list(range(3, 200)),
                                    "profile_continuous_steps": True}).session_id
wait_armed(agent, sid)
stop, seen = threading.Event(), []

stages = sys.argv[2] == "stages"

def training():  # goes on after the agent was closed from elsewhere
    n = 0
    while not stop.is_set():
        n += 1
        with agent.step(n):
            if stages:
                with agent.stage("work"):
                    torch.ones(4).sum()
            else:  # a loop that marks only its steps
                torch.ones(4).sum()
        seen.append(torch.autograd._profiler_enabled())
        time.sleep(0.01)

thread = threading.Thread(target=training, name="training")
thread.start()
deadline = time.monotonic() + 30
while not (seen and seen[-1]) and time.monotonic() < deadline:
    time.sleep(0.01)
print("recording:", bool(seen and seen[-1]))
agent.close(timeout=10)  # from the main thread, while the training thread goes on
marks = len(seen)
deadline = time.monotonic() + 10
while seen[-1] and time.monotonic() < deadline:
    time.sleep(0.01)
print("stopped on its thread:", not seen[-1], "marks later:", len(seen) - marks)
stop.set()
thread.join()
part = owner.call("get_session", sid).targets[0]
print("state:", part.state.value)
print("reason:", part.reason)
owner.close()
"""


@pytest.mark.parametrize("marks", ["stages", "steps"])
def test_an_agent_closed_off_the_training_thread_stops_its_window_there(
    tmp_path, marks: str
) -> None:
    """The agent is closed from another thread while the training thread goes on: the
    window cannot be stopped there, so its part fails saying why, and the training thread's
    next mark stops it (it recorded every op of that thread until the thread ended)."""
    r = run_script(CLOSED_ELSEWHERE, tmp_path, marks)
    assert "recording: True" in r.stdout, r.stdout
    assert "stopped on its thread: True" in r.stdout, r.stdout
    assert "state: failed" in r.stdout and "is being ended on MainThread" in r.stdout, r.stdout
