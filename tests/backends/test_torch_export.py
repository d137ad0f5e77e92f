"""The torch backend's window end: Kineto's export deferred to the exporter thread and
ordered before the next profiler start (``KINETO_GATE``); ``trace_only`` where torch has it."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from profd.backends.base import CollectionSpec
from profd.backends.torch_backend import (
    KINETO_GATE,
    TorchBackend,
    read_trace,
    torch_profiler_kwargs,
)
from profd.core.request import TorchToolConfig

from helpers import user_ranges


def spec(save_dir: Path, step: int = 1, schedule: dict | None = None) -> CollectionSpec:
    stem = f"actor_train_step{step}_rank0_pid1_20260101000000000"
    return CollectionSpec(save_dir=save_dir, stem=stem, metadata={}, schedule=schedule)


def record(save_dir: Path, step: int = 1) -> list:
    coll = TorchBackend({"contents": ["cpu"]}).open(spec(save_dir, step))
    with coll.annotate(f"step{step}"):
        torch.ones(4).sum()
    return coll.close()


def test_the_window_end_registers_its_export_until_it_is_written(tmp_path) -> None:
    (out,) = record(tmp_path)
    assert KINETO_GATE.pending == 1  # nothing exported on the training thread
    assert list(tmp_path.iterdir()) == []
    (written,) = out.write()
    assert KINETO_GATE.pending == 0
    assert "step1" in user_ranges(read_trace(written.path))


def test_the_trace_names_its_published_file_not_the_temporary_one(tmp_path) -> None:
    """Kineto writes ``traceName`` as the file it exports to (profd's hidden temporary);
    the published trace names itself, ``_part1`` included when the name was taken."""
    (first,) = record(tmp_path)[0].write()
    (second,) = record(tmp_path)[0].write()  # same stem: the next free name
    assert second.path.name.endswith("_part1.json.gz")
    for written in (first, second):
        assert read_trace(written.path)["traceName"] == str(written.path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        w.path.name for w in (first, second)
    )  # no temporary left behind


def test_a_failed_or_dropped_export_lets_the_next_window_start(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(KINETO_GATE, "wait_s", 0.5)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    (out,) = record(blocker)
    with pytest.raises(OSError):
        out.write()
    assert KINETO_GATE.pending == 0
    (dropped,) = record(tmp_path, 2)
    del dropped  # never written (a caller that lost it): releases when collected
    gc.collect()
    assert KINETO_GATE.pending == 0
    (out,) = record(tmp_path, 3)  # starts at once: nothing left to wait for
    (written,) = out.write()
    assert written.path.name.startswith("actor_train_step3_")


def test_windows_a_schedule_saves_while_open_are_exported_at_once(tmp_path) -> None:
    """The profiler restarts inside the same step(): those exports stay on the training
    thread; only the window that ends with the collection is deferred."""
    schedule = {"wait": 0, "warmup": 0, "active": 1, "repeat": 0, "skip_first": 0}
    coll = TorchBackend({"contents": ["cpu"]}).open(spec(tmp_path, schedule=schedule))
    for i in range(2):
        with coll.annotate(f"mini_batch{i}"):
            torch.ones(4).sum()
        coll.step()
    ready = coll.take_ready()
    assert len(ready) == 2 and KINETO_GATE.pending == 0
    with coll.annotate("mini_batch2"):
        torch.ones(4).sum()
    (last,) = coll.close()
    assert KINETO_GATE.pending == 1
    names = [user_ranges(read_trace(o.write()[0].path)) for o in (*ready, last)]
    assert names == [["mini_batch0"], ["mini_batch1"], ["mini_batch2"]]
    assert KINETO_GATE.pending == 0


def test_trace_only_is_asked_for_except_with_stacks() -> None:
    plain = torch_profiler_kwargs(TorchToolConfig(contents=["cpu"]), False)
    stacks = torch_profiler_kwargs(TorchToolConfig(contents=["cpu", "stack"]), False)
    assert "experimental_config" not in stacks  # torch would turn it off with a warning
    config = plain.get("experimental_config")
    if hasattr(torch._C._profiler._ExperimentalConfig(), "trace_only"):
        assert config is not None and config.trace_only


# Run in a process of its own: before the fix, ending the window off its thread crashed the
# process (a segmentation fault in Kineto's export of the empty result).
OFF_THREAD = r"""
import sys, threading, time
from pathlib import Path
import torch
from profd.backends.base import CollectionSpec
from profd.backends.torch_backend import TorchBackend, read_trace

out = Path(sys.argv[1])
opener_alive = sys.argv[2] == "alive"

def spec(step):
    return CollectionSpec(out, f"actor_train_step{step}_rank0_pid1_20260101000000000", {})

def next_window(step):
    coll = TorchBackend({"contents": ["cpu"]}).open(spec(step))
    with coll.annotate(f"step{step}"):
        torch.ones(4).sum()
    (written,) = coll.close()[0].write()
    return f"step{step}" in [e["name"] for e in read_trace(written.path)["traceEvents"]]

box, release = {}, threading.Event()

def training():
    box["coll"] = TorchBackend({"contents": ["cpu"]}).open(spec(1))
    with box["coll"].annotate("step1"):
        torch.ones(4).sum()
    if opener_alive:
        release.wait(30)
        # its next window first stops the refused one (on this, its own thread)
        box["next"] = next_window(3)

thread = threading.Thread(target=training, name="training")
thread.start()
if not opener_alive:
    thread.join()
while "coll" not in box:
    time.sleep(0.01)
try:
    outputs = box["coll"].close()
    for o in outputs:
        o.write()
    print("closed off its thread")
except RuntimeError as exc:
    print("refused:", exc)
if opener_alive:
    try:  # the refused window still records on its thread: no second one beside it
        TorchBackend({"contents": ["cpu"]}).open(spec(9))
        print("a second window started beside it")
    except RuntimeError as exc:
        print("beside it:", exc)
    release.set()
    thread.join()
    print("opener's next window:", box.get("next"))
print("next window:", next_window(2))  # the process can profile again
"""


@pytest.mark.parametrize("opener", ["ended", "alive"])
def test_a_window_ended_off_its_thread_is_refused_not_crashed(tmp_path, opener) -> None:
    """torch's profiler is its starting thread's: stopped on another thread it returns an
    empty result whose export crashed the process. The window fails, saying why; the
    process goes on and profiles again."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", OFF_THREAD, str(tmp_path), opener],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    if opener == "ended":
        assert "refused: the thread that started this torch window (training) ended" in r.stdout
    else:
        assert "refused: this torch window was started on thread training and is being " \
            "ended on MainThread" in r.stdout, r.stdout  # fmt: skip
        assert "beside it: a torch window of this process" in r.stdout, r.stdout
        assert "still records until thread training marks again" in r.stdout, r.stdout
        assert "opener's next window: True" in r.stdout, r.stdout
    assert "this trace is lost" in r.stdout and "next window: True" in r.stdout, r.stdout
