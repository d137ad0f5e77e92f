"""Window ends with real torch.profiler windows: the export runs off the training thread, each
window's trace is its own, the next profiler start is ordered after the previous export."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch

from profd.agent.recorder import Recorder
from profd.agent.window_state import ArmedPlan
from profd.backends import make_backend
from profd.backends.base import (
    Backend,
    Collection,
    CollectionSpec,
    HeldSteps,
    PendingOutput,
    WrittenFile,
)
from profd.backends.torch_backend import read_trace
from profd.backends.torch_output import KINETO_GATE
from profd.core.protocol import AgentEvent, AgentInfo, AgentPlan, EventKind, WindowPlan
from profd.core.request import ToolKind

from helpers import user_ranges

INFO = AgentInfo("actor-0-test", "actor", 0, 1, {}, "host", os.getpid())


class Events:
    """What a recorder emits, with a wait for each session's ``part_done``."""

    def __init__(self) -> None:
        self.items: list[AgentEvent] = []
        self._done: dict[str | None, threading.Event] = {}
        self._lock = threading.RLock()

    def __call__(self, event: AgentEvent) -> None:
        with self._lock:
            self.items.append(event)
            if event.kind is EventKind.PART_DONE:
                self._flag(event.session_id).set()

    def _flag(self, sid: str | None) -> threading.Event:
        with self._lock:
            return self._done.setdefault(sid, threading.Event())

    def part_done(self, sid: str, timeout: float = 30.0) -> Any:
        assert self._flag(sid).wait(timeout), f"no part_done for {sid}: {self.items}"
        (done,) = self.of(EventKind.PART_DONE, sid)
        return done.payload

    def of(self, kind: EventKind, sid: str | None = None) -> list[AgentEvent]:
        with self._lock:
            return [e for e in self.items if e.kind is kind and sid in (None, e.session_id)]


def window(sid: str, steps: tuple[int, ...], save_dir: Path) -> WindowPlan:
    """A continuous window with one collection (one trace) per step."""
    groups = tuple((s,) for s in steps)
    return WindowPlan(sid, "torch", steps, groups, False, {"contents": ["cpu"]}, str(save_dir), "*")


def plan(*windows: WindowPlan) -> ArmedPlan:
    return ArmedPlan(AgentPlan(version=1, windows=windows), received_at_step=0)


def train(recorder: Recorder, armed: ArmedPlan, steps: range) -> None:
    """The training loop as the agent's step and stage marks drive the recorder."""
    for s in steps:
        recorder.enter_step(s, armed)
        scope = recorder.active
        with scope.stage("update", False) if scope is not None else nullcontext():
            torch.ones(8).mul(s).sum()
        recorder.exit_step(s)


@pytest.fixture
def events() -> Iterator[Events]:
    yield Events()
    assert KINETO_GATE.pending == 0  # no export left registered


def test_windows_step_after_step_each_write_their_own_trace(events, tmp_path) -> None:
    recorder = Recorder(INFO, events, make_backend)
    armed = plan(window("s", (1, 2, 3, 4, 5), tmp_path))
    train(recorder, armed, range(7))
    done = events.part_done("s")
    assert done.recorded == (1, 2, 3, 4, 5) and done.missed == ()
    traces = [e.payload for e in events.of(EventKind.TRACE)]
    assert sorted(t.steps for t in traces) == [(1,), (2,), (3,), (4,), (5,)]
    paths = {t.path for t in traces}
    assert len(paths) == 5 and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        Path(p).name for p in paths
    )  # none overwritten, no temporary file left
    for t in traces:
        (step,) = t.steps
        trace = read_trace(Path(t.path))  # valid gzip JSON
        assert trace["profd"]["step"] == step
        ranges = [r for r in user_ranges(trace) if r.startswith("step")]
        assert ranges == [f"step{step}"], (step, ranges)  # its own step, no other
        assert "update" in user_ranges(trace)
    assert not events.of(EventKind.ERROR)
    assert recorder.close(10)


class GatedBackend(Backend):
    """The torch backend, except that each window's write first waits for ``release``."""

    kind = ToolKind.TORCH

    def __init__(self) -> None:
        self.entered = threading.Event()  # the exporter thread is inside a write
        self.release = threading.Event()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    def open(self, spec: CollectionSpec) -> Collection:
        return _GatedCollection(make_backend("torch", {"contents": ["cpu"]}).open(spec), self)


class _GatedCollection(Collection):
    def __init__(self, inner: Collection, gate: GatedBackend) -> None:
        self._inner, self._gate = inner, gate
        self.export_wait_s = inner.export_wait_s

    def annotate(self, label: str) -> AbstractContextManager[Any]:
        return self._inner.annotate(label)

    def close(self) -> list[PendingOutput]:
        return [_GatedOutput(o, self._gate) for o in self._inner.close()]


class _GatedOutput(PendingOutput):
    def __init__(self, inner: PendingOutput, gate: GatedBackend) -> None:
        self._inner, self._gate = inner, gate

    def write(self, held: HeldSteps | None = None) -> list[WrittenFile]:
        self._gate.entered.set()
        assert self._gate.release.wait(30), "the test never released the export"
        return self._inner.write(held)


def test_training_goes_on_while_the_export_is_pending(events, tmp_path) -> None:
    gated = GatedBackend()
    recorder = Recorder(INFO, events, lambda kind, options: gated)
    armed = plan(window("s", (1,), tmp_path))
    train(recorder, armed, range(2))
    assert gated.entered.wait(10)  # the exporter thread holds step 1's window ...
    train(recorder, armed, range(2, 5))  # ... and the training thread runs steps 2-4
    assert not events.of(EventKind.TRACE) and KINETO_GATE.pending == 1
    gated.release.set()
    assert events.part_done("s").recorded == (1,)
    (trace,) = events.of(EventKind.TRACE)
    assert user_ranges(read_trace(Path(trace.payload.path))).count("step1") == 1
    assert recorder.close(10)


def test_a_job_that_ends_while_its_last_window_is_written_says_so(events, tmp_path) -> None:
    """``close`` waits ``timeout`` for the files; a window still being written then ends
    with that reason, not with its steps read as never reached."""
    gated = GatedBackend()
    recorder = Recorder(INFO, events, lambda kind, options: gated)
    armed = plan(window("s", (1,), tmp_path))
    train(recorder, armed, range(2))
    assert gated.entered.wait(10)
    assert not recorder.close(0.2)  # the job's end: the export is still held
    (error,) = events.of(EventKind.ERROR, "s")
    assert "the job ended while 1 trace(s) of this window were still being written" in (
        error.message
    )
    done = events.part_done("s")
    assert done.recorded == () and done.missed == (1,)
    gated.release.set()
    assert recorder.close(10)  # the export ends; the window is not reported again
    assert len(events.of(EventKind.PART_DONE, "s")) == 1


def test_a_window_start_waits_for_the_pending_export_at_most_wait_s(
    events, tmp_path, monkeypatch
) -> None:
    """Kineto's export must not overlap the next profiler start: with step 1's export held,
    step 2's window gives up after ``wait_s`` (reported) and training never stops; once the
    export is done the next window starts."""
    monkeypatch.setattr(KINETO_GATE, "wait_s", 0.3)
    gated = GatedBackend()
    recorder = Recorder(INFO, events, lambda kind, options: gated)
    armed = plan(window("s", (1, 2), tmp_path), window("next", (4,), tmp_path))
    train(recorder, armed, range(2))
    assert gated.entered.wait(10)
    train(recorder, armed, range(2, 4))
    (error,) = events.of(EventKind.ERROR)
    assert "still being exported after 0.3 s" in error.message
    gated.release.set()
    done = events.part_done("s")
    assert done.recorded == (1,) and done.missed == (2,)
    train(recorder, armed, range(4, 6))
    assert events.part_done("next").recorded == (4,)
    assert recorder.close(10)


def test_a_failed_export_is_reported_logged_once_and_the_next_window_records(
    events, tmp_path, caplog
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the save directory should be")
    recorder = Recorder(INFO, events, make_backend)
    armed = plan(window("bad", (1, 2), blocker), window("good", (3,), tmp_path / "good"))
    with caplog.at_level(logging.DEBUG, logger="profd.agent.export"):
        train(recorder, armed, range(5))
        bad, good = events.part_done("bad"), events.part_done("good")
    assert bad.recorded == () and bad.missed == (1, 2)
    errors = events.of(EventKind.ERROR, "bad")
    assert len(errors) == 2 and all("export failed" in e.message for e in errors)
    warned = [
        r for r in caplog.records if r.name == "profd.agent.export" and r.levelno >= logging.WARNING
    ]
    assert len(warned) == 1 and "bad" in warned[0].getMessage()
    assert good.recorded == (3,)  # the failed export let the next profiler start
    (trace,) = events.of(EventKind.TRACE, "good")
    assert "step3" in user_ranges(read_trace(Path(trace.payload.path)))
    assert recorder.close(10)
