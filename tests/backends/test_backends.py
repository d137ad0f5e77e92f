"""Every backend's decisions at its boundary (CUDA, nsys and torch_npu are faked only where
they cannot exist here; py-spy and torch.profiler are real)."""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from profd.backends import capabilities
from profd.backends.base import CollectionSpec
from profd.backends.npu import NpuBackend
from profd.backends.nsys import NsysApi, NsysBackend, launcher_command, nsys_runtime_env
from profd.backends.nvtx_guard import DISABLED_PATH, NVTX_VAR, apply_guard, runtime_env
from profd.backends.py_spy import py_spy_command
from profd.backends.torch_backend import TorchBackend
from profd.backends.torch_memory import CudaMemoryApi, TorchMemoryBackend
from profd.backends.torch_output import NO_DEVICE_EVENTS
from profd.core.request import NpuToolConfig, PySpyToolConfig

from helpers import busy_python_work, start_agents, wait_armed, wait_terminal


def spec(tmp_path: Path, stem: str = "actor_train_step1_rank0_pid1_20260101000000000") -> Any:
    return CollectionSpec(save_dir=tmp_path / "s", stem=stem, metadata={})


# -- capabilities -------------------------------------------------------------------------
def test_capabilities_here_are_real_reasons() -> None:
    caps = capabilities()
    assert caps["torch"] is None and caps["py_spy"] is None
    assert caps["torch_memory"] == "CUDA is not available in this process"
    assert "not launched under Nsight" in caps["nsys"]
    assert caps["npu"] == "torch_npu is not installed"


# -- torch_memory ---------------------------------------------------------------------------
class FakeCudaMemory(CudaMemoryApi):
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.observer = None

    def is_available(self) -> bool:
        return True

    def start_history(self, max_entries: int) -> None:
        self.calls.append(("start", max_entries))

    def stop_history(self) -> None:
        self.calls.append(("stop",))

    def snapshot(self) -> Any:
        self.calls.append(("snapshot",))
        return {"segments": [{"total_size": 1 << 20}], "device_traces": [[]]}

    def attach_oom_observer(self, callback: Any) -> bool:
        self.observer = callback
        return True


@pytest.fixture
def fake_cuda_memory(monkeypatch) -> FakeCudaMemory:
    from profd.backends import torch_memory

    fake = FakeCudaMemory()
    monkeypatch.setattr(TorchMemoryBackend, "api", fake)
    monkeypatch.setattr(torch_memory._OomHook, "attached", False)
    return fake


def test_torch_memory_records_history_for_the_window_only(fake_cuda_memory, tmp_path) -> None:
    backend = TorchMemoryBackend({"trace_alloc_max_entries": 500})
    coll = backend.open(spec(tmp_path))
    assert fake_cuda_memory.calls == [("start", 500)]
    fake_cuda_memory.observer(0, 1 << 30, 0, 0)  # an out-of-memory while the window is open
    (out,) = coll.close()
    assert fake_cuda_memory.calls[-2:] == [("snapshot",), ("stop",)]
    (written,) = out.write()
    assert written.path.name.endswith("_pid1_20260101000000000.pickle")
    assert pickle.loads(written.path.read_bytes())["segments"][0]["total_size"] == 1 << 20
    oom = sorted((tmp_path / "s").glob("*_oom1.pickle"))
    assert len(oom) == 1
    fake_cuda_memory.observer(0, 1, 0, 0)  # after the window: no collection, nothing written
    assert len(list((tmp_path / "s").glob("*_oom*"))) == 1


def test_torch_memory_session_writes_one_snapshot_per_step(fake_cuda_memory, local_coordinator):
    (agent,) = start_agents(local_coordinator)
    with agent.step(0):
        pass
    view = local_coordinator.call(
        "create_session",
        {"tool": "torch_memory", "steps": [1, 2], "profile_continuous_steps": True},
    )
    assert view.groups == [[1, 2]]  # as requested ...
    wait_armed(agent, view.session_id)
    assert agent.plan.windows[0].groups == ((1,), (2,))  # ... but snapshots are per step
    for s in (1, 2, 3):
        with agent.step(s), agent.stage("update"):
            torch.ones(3).sum()
    view = wait_terminal(local_coordinator, view.session_id)
    assert view.state.value == "done", view.reason
    assert sorted(t.steps[0] for t in view.traces) == [1, 2]
    assert all(t.file_name.endswith(".pickle") for t in view.traces)
    agent.close()


# -- py-spy (real) ------------------------------------------------------------------------------
def test_py_spy_command_options() -> None:
    cmd = py_spy_command("py-spy", 42, Path("/o.json"), PySpyToolConfig(rate_hz=50, native=True))
    assert cmd[:4] == ["py-spy", "record", "--pid", "42"]
    assert "--nonblocking" in cmd and "--native" in cmd and "--gil" not in cmd
    assert cmd[cmd.index("--rate") + 1] == "50" and cmd[cmd.index("--format") + 1] == "speedscope"


def py_spy_step(owner: Any, work: Callable[[], Any]) -> tuple[Any, Any]:
    """One reward agent's step 1 under a py_spy window, doing ``work``: (its agent, the
    session at its end)."""
    (agent,) = start_agents(owner, role="reward")
    with agent.step(0):
        pass
    view = owner.call("create_session", {"tool": "py_spy", "steps": [1], "roles": {"reward": {}}})
    wait_armed(agent, view.session_id)
    with agent.step(1), agent.stage("compute_reward"):
        work()
    with agent.step(2):
        pass
    return agent, wait_terminal(owner, view.session_id, timeout=60)


def test_py_spy_window_samples_the_worker(local_coordinator) -> None:
    agent, view = py_spy_step(local_coordinator, lambda: busy_python_work(1.5))
    assert view.state.value == "done", view.reason
    (trace,) = view.traces
    assert trace.file_name.endswith(".speedscope.json") and trace.tool == "py_spy"
    profile = json.loads(Path(trace.path).read_text())
    assert "speedscope" in profile["$schema"]
    frames = {f["name"] for f in profile["shared"]["frames"]}
    assert "busy_python_work" in frames
    assert view.warnings == []
    agent.close()


def test_a_py_spy_window_of_an_idle_thread_says_it_has_no_samples(local_coordinator) -> None:
    """py-spy leaves idle threads out: a step that only sleeps gives a profile without a
    sample. It is kept, and the session says so (it was DONE with a full bar, silently)."""
    agent, view = py_spy_step(local_coordinator, lambda: time.sleep(1.0))
    (trace,) = view.traces
    me = f"Thread {threading.get_native_id()} "  # this thread, the one that marks steps
    profiles = json.loads(Path(trace.path).read_text())["profiles"]
    assert not [p for p in profiles if p["name"].startswith(me)]  # profd's threads may be
    (warning,) = view.warnings
    assert "no samples of the training thread" in warning and "py_spy.idle: true" in warning
    agent.close()


@pytest.mark.parametrize("blocked", [True, False], ids=["ray-worker", "plain-process"])
def test_py_spy_stopped_at_once_still_writes(tmp_path: Path, blocked: bool) -> None:
    """As in a Ray worker, the thread that starts py-spy has SIGINT blocked (a child
    inherits that across exec); in any process, a window a few milliseconds long sends its
    SIGINT before py-spy handles it. Either one left no profile (a 120 s wait, or py-spy
    ended by the signal before it wrote)."""
    import signal

    from profd.backends.py_spy import PySpyBackend

    opened: list[Any] = []

    def start_as_a_ray_worker() -> None:
        if blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        opened.append(PySpyBackend({"idle": True}).open(spec(tmp_path, "quick")))

    t = threading.Thread(target=start_as_a_ray_worker)
    t.start()
    t.join()
    (collection,) = opened
    t0 = time.monotonic()
    (out,) = collection.close()  # at once: before py-spy can have set its handler
    (written,) = out.write()
    assert time.monotonic() - t0 < 30
    profile = json.loads(written.path.read_text())
    assert "speedscope" in profile["$schema"] and written.path.name == "quick.speedscope.json"


# -- nsys (boundary: no CUDA, no nsys here) --------------------------------------------------
class FakeNsys(NsysApi):
    """Stands in for CUDA and nsys: stop() makes 'nsys' write a report, slowly."""

    def __init__(self, report_dir: Path, write_after_s: float = 0.3, writes: bool = True):
        self.dir = report_dir
        self.calls: list[str] = []
        self.write_after_s = write_after_s
        self.writes = writes
        self.ranges = 0

    def launched_under_nsys(self) -> bool:
        return True

    def cuda_available(self) -> bool:
        return True

    def start(self) -> None:
        self.calls.append("start")

    def stop(self) -> None:
        self.calls.append("stop")
        if not self.writes:
            return
        n = self.calls.count("stop")
        path = self.dir / f"worker_process_{os.getpid()}.{n}.nsys-rep"

        def flush() -> None:  # nsys finalises the report after the range, in pieces
            time.sleep(self.write_after_s)
            with open(path, "wb") as f:
                for _ in range(3):
                    f.write(b"x" * 1000)
                    f.flush()
                    time.sleep(0.1)

        threading.Thread(target=flush, daemon=True).start()

    def range(self, label: str):
        self.ranges += 1
        return torch.profiler.record_function(label)

    def report_dir(self) -> Path:
        return self.dir


def test_nsys_launch_settings() -> None:
    env = nsys_runtime_env(base={"env_vars": {"A": "1"}})
    assert env["nsight"]["capture-range"] == "cudaProfilerApi"
    assert env["nsight"]["capture-range-end"] == "repeat"  # no window count fixed at launch
    assert env["env_vars"] == {"A": "1", "PROFD_NSYS": "1"}
    cmd, cenv = launcher_command(["python", "train.py"], Path("/r"))
    assert cmd[:2] == ["nsys", "profile"] and cmd[-2:] == ["python", "train.py"]
    assert "--output" in cmd and "/r/worker_process_%p" in cmd
    assert cenv["PROFD_NSYS_REPORT_DIR"] == "/r"


def test_nsys_window_waits_for_the_report_and_moves_it(monkeypatch, tmp_path) -> None:
    fake = FakeNsys(tmp_path / "nsight")
    fake.dir.mkdir()
    (fake.dir / f"worker_process_{os.getpid()}.0.nsys-rep").write_bytes(b"old")  # not ours
    monkeypatch.setattr(NsysBackend, "api", fake)
    backend = NsysBackend({"settle_s": 0.3, "flush_timeout_s": 10})
    coll = backend.open(spec(tmp_path))
    with coll.annotate("update_actor"):
        pass
    (out,) = coll.close()
    assert fake.calls == ["start", "stop"] and fake.ranges == 1
    (written,) = out.write()
    assert written.path.name == "actor_train_step1_rank0_pid1_20260101000000000.nsys-rep"
    assert written.bytes == 3000  # complete, not a half-written report
    assert (fake.dir / f"worker_process_{os.getpid()}.0.nsys-rep").exists()  # left alone


def test_nsys_report_that_never_appears_is_an_error(monkeypatch, tmp_path) -> None:
    fake = FakeNsys(tmp_path / "nsight", writes=False)
    fake.dir.mkdir()
    monkeypatch.setattr(NsysBackend, "api", fake)
    coll = NsysBackend({"settle_s": 0.1, "flush_timeout_s": 0.5}).open(spec(tmp_path))
    (out,) = coll.close()
    with pytest.raises(TimeoutError, match="no complete report"):
        out.write()


# -- npu (boundary: a fake torch_npu module) -------------------------------------------------
class _Enum:
    def __getattr__(self, name: str) -> str:
        return name


def fake_torch_npu(calls: list) -> types.ModuleType:
    mod = types.ModuleType("torch_npu")

    class Profile:
        def __init__(self, **kwargs: Any) -> None:
            calls.append(("profile", kwargs))
            self.kwargs = kwargs

        def start(self) -> None:
            calls.append(("start",))

        def step(self) -> None:
            calls.append(("step",))

        def stop(self) -> None:
            calls.append(("stop",))
            out = Path(self.kwargs["on_trace_ready"]) / "host_1_2_ascend_pt"
            out.mkdir(parents=True)
            (out / "trace_view.json").write_text("{}")

    profiler = types.SimpleNamespace(
        ProfilerActivity=_Enum(),
        ProfilerLevel=_Enum(),
        ExportType=_Enum(),
        _ExperimentalConfig=lambda **kw: ("experimental", kw),
        tensorboard_trace_handler=lambda d, analyse_flag: d if analyse_flag in (True, False) else 0,
        profile=Profile,
    )
    mstx = types.SimpleNamespace(
        range_start=lambda label: calls.append(("range_start", label)) or 7,
        range_end=lambda rid: calls.append(("range_end", rid)),
    )
    mod.profiler = profiler
    mod.npu = types.SimpleNamespace(mstx=mstx)
    return mod


def test_npu_mapping_start_stop_and_mstx(monkeypatch, tmp_path) -> None:
    calls: list = []
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(calls))
    coll = NpuBackend(NpuToolConfig(level="level1", analysis=True)).open(spec(tmp_path))
    with coll.annotate("update_actor"):
        coll.step()
    (out,) = coll.close()
    (written,) = out.write()
    kwargs = calls[0][1]
    assert kwargs["activities"] == ["CPU", "NPU"]  # empty contents = everything (fix §13.6)
    assert kwargs["with_stack"] and kwargs["record_shapes"] and kwargs["with_modules"]
    experimental = kwargs["experimental_config"][1]
    assert experimental["profiler_level"] == "Level1" and experimental["data_simplification"]
    assert experimental["mstx_domain_exclude"] == ["communication"]
    assert [c[0] for c in calls[1:]] == ["start", "range_start", "step", "range_end", "stop"]
    assert written.path.name == "host_1_2_ascend_pt" and written.bytes == 2


def test_npu_contents_select_flags(monkeypatch, tmp_path) -> None:
    calls: list = []
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(calls))
    NpuBackend(NpuToolConfig(contents=("cpu", "stack"))).open(spec(tmp_path))
    kwargs = calls[0][1]
    assert kwargs["activities"] == ["CPU"] and kwargs["with_stack"]
    assert not kwargs["record_shapes"] and not kwargs["profile_memory"]


# -- torch: device-event check and faults ----------------------------------------------------
class _Window:
    """A recorded window whose Kineto export is this text (what CUPTI did or did not give)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def export_chrome_trace(self, path: str) -> None:
        Path(path).write_text(self.text)


_LAUNCH = {
    # Kineto's layouts: classic (before torch 2.13, as recorded on an H200) and 2.13's
    "classic": '"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1,',
    "2.13": '"ph": "X",\n    "cat": "cuda_driver",\n    "name": "cuLaunchKernel",\n',
}
_KERNEL = '"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0,'
_CPU = '"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1,'


@pytest.mark.parametrize(
    ("events", "flagged"),
    [
        ([_LAUNCH["classic"]], True),  # launches, no device event: CUPTI recorded nothing
        ([_LAUNCH["2.13"], _CPU], True),
        (['"ph": "X", "cat": "cuda_runtime", "name": "hipLaunchKernel", "pid": 1,'], True),
        ([_LAUNCH["classic"], _KERNEL], False),
        ([_CPU], False),  # a CPU-only role on a GPU machine launched nothing: nothing missing
    ],
)
def test_a_window_that_launched_device_work_but_holds_none_is_flagged(
    tmp_path, events: list[str], flagged: bool
) -> None:
    from profd.backends.torch_output import TorchOutput

    text = '{"traceEvents": [' + ", ".join("{" + e + "}" for e in events) + "]}"
    out = TorchOutput(_Window(text), spec(tmp_path), "", expect_device=True)
    (written,) = out.write()
    assert written.warnings == ((NO_DEVICE_EVENTS,) if flagged else ())


def test_a_cpu_window_expecting_the_device_is_not_flagged(tmp_path) -> None:
    """A real window of CPU work where CUDA activity was asked for (CUDA present, the role
    runs on the CPU): no device work was launched, so no warning."""
    coll = TorchBackend({"contents": ["cpu"]}).open(spec(tmp_path))
    coll._expect_device = True
    with coll.annotate("x"):
        torch.ones(4).sum()
    (out,) = coll.close()
    (written,) = out.write()
    assert written.warnings == ()


def test_device_event_scan_finds_kernels_across_chunks(tmp_path) -> None:
    from profd.backends.torch_output import DEVICE_EVENTS, DEVICE_LAUNCHES
    from profd.core.files import gzip_file

    raw = tmp_path / "t.json"
    pad = b" " * ((1 << 20) - 10)  # the match straddles the 1 MiB chunk boundary
    raw.write_bytes(b'{"traceEvents": [' + pad + b'{"ph": "X", "cat": "kernel"}]}')
    found = gzip_file(raw, tmp_path / "t.json.gz", find=(DEVICE_EVENTS, DEVICE_LAUNCHES))
    assert found == (True, False)
    raw.write_bytes(b'{"traceEvents": [{"ph": "X", "cat": "cpu_op"}]}')
    assert gzip_file(raw, tmp_path / "u.json.gz", find=(DEVICE_EVENTS,)) == (False,)
    assert gzip_file(raw, tmp_path / "v.json.gz") == ()


@pytest.mark.parametrize("at", [0, (1 << 20) - 5, (1 << 20) - 1, 1 << 20, (2 << 20) - 3])
def test_gzip_replaces_across_chunk_boundaries(tmp_path, at) -> None:
    import gzip

    from profd.core.files import gzip_file

    old, new = b'"traceName": "/d/.x.json.tmp"', b'"traceName": "/d/x_step1.json.gz"'
    body = b"a" * at + old + b"b" * 100 + old + b"c" * ((1 << 20) + 7)
    raw = tmp_path / "t.json"
    raw.write_bytes(body)
    gzip_file(raw, tmp_path / "t.json.gz", replace=[(old, new)])
    assert gzip.decompress((tmp_path / "t.json.gz").read_bytes()) == body.replace(old, new)
    # two pairs, the second's text across the same boundary and at the end of the file
    # (held back by both pairs at once)
    head, head2 = b'"profd": {"steps": null}', b'"profd": {"steps": [1, 2]}'
    body = head + body[:at] + head + body[at:] + head
    gzip_file(raw_of(tmp_path, body), tmp_path / "u.json.gz", replace=[(old, new), (head, head2)])
    want = body.replace(old, new).replace(head, head2)
    assert gzip.decompress((tmp_path / "u.json.gz").read_bytes()) == want


def raw_of(tmp_path, body: bytes):
    raw = tmp_path / "u.json"
    raw.write_bytes(body)
    return raw


def test_device_warning_reaches_the_session(monkeypatch, local_coordinator) -> None:
    import re

    from profd.backends import torch_output

    real_open = TorchBackend.open
    # no GPU here: the stage's range stands for a launch whose device events CUPTI lost
    monkeypatch.setattr(torch_output, "DEVICE_LAUNCHES", re.compile(rb'"name"\s*:\s*"update"'))

    def open_expecting_device(self, spec):
        coll = real_open(self, spec)
        coll._expect_device = True
        return coll

    monkeypatch.setattr(TorchBackend, "open", open_expecting_device)
    (agent,) = start_agents(local_coordinator)
    with agent.step(0):
        pass
    view = local_coordinator.call("create_session", {"steps": [1]})
    wait_armed(agent, view.session_id)
    with agent.step(1), agent.stage("update"):
        torch.ones(8).sum()
    with agent.step(2):
        pass
    view = wait_terminal(local_coordinator, view.session_id)
    assert view.state.value == "done"
    assert any(NO_DEVICE_EVENTS in w and "actor rank 0" in w for w in view.warnings)
    agent.close()


def test_cpu_only_window_is_not_flagged(tmp_path) -> None:
    coll = TorchBackend({"contents": ["cpu"]}).open(spec(tmp_path))
    with coll.annotate("x"):
        torch.ones(4).sum()
    (out,) = coll.close()
    (written,) = out.write()
    assert written.warnings == ()


def test_backend_failure_is_reported_and_training_goes_on(monkeypatch, local_coordinator):
    def broken(self, spec):
        raise RuntimeError("profiler refused to start")

    monkeypatch.setattr(TorchBackend, "open", broken)
    (agent,) = start_agents(local_coordinator)
    with agent.step(0):
        pass
    view = local_coordinator.call("create_session", {"steps": [1, 2]})
    wait_armed(agent, view.session_id)
    done = []
    for s in (1, 2, 3):
        with agent.step(s), agent.stage("update"):
            done.append(s)
    assert done == [1, 2, 3]
    view = wait_terminal(local_coordinator, view.session_id)
    assert view.state.value == "failed"
    assert "profiler refused to start" in view.targets[0].reason
    agent.close()


# -- NVTX guard ------------------------------------------------------------------------------
def test_nvtx_guard_rules() -> None:
    env: dict[str, str] = {}
    assert apply_guard(env) and env[NVTX_VAR] == DISABLED_PATH  # unset -> set anyway
    env = {NVTX_VAR: "/usr/lib/libcupti-injection.so"}
    msg = apply_guard(env)
    assert env[NVTX_VAR] == DISABLED_PATH and "/usr/lib/libcupti-injection.so" in msg
    assert "PROFD_KEEP_NVTX_INJECTION=1" in msg
    for opt_out in ("PROFD_KEEP_NVTX_INJECTION", "VERL_KEEP_NVTX_INJECTION"):
        env = {NVTX_VAR: "/x.so", opt_out: "1"}
        assert apply_guard(env) is None and env[NVTX_VAR] == "/x.so"
    env = {NVTX_VAR: "/nsys/injection.so"}
    assert apply_guard(env, under_nsys=True) is None and env[NVTX_VAR] == "/nsys/injection.so"
    nsys_lib = "/opt/nvidia/nsight-systems/2025.1/target-linux-x64/libToolsInjection64.so"
    env = {NVTX_VAR: nsys_lib}  # launched under someone's nsys: its NVTX ranges stay
    assert apply_guard(env) is None and env[NVTX_VAR] == nsys_lib
    assert runtime_env({"pip": ["x"]})["env_vars"][NVTX_VAR] == DISABLED_PATH
    assert "env_vars" not in runtime_env({}, tool="nsys")


def test_a_second_torch_window_in_one_process_is_refused(tmp_path) -> None:
    first = TorchBackend({"contents": ["cpu"]}).open(
        spec(tmp_path, "a_rank0_pid1_20260101000000000")
    )
    with pytest.raises(RuntimeError, match="another torch profiler window is open"):
        TorchBackend({}).open(spec(tmp_path, "b_rank0_pid1_20260101000000000"))
    first.close()
    second = TorchBackend({"contents": ["cpu"]}).open(
        spec(tmp_path, "c_rank0_pid1_20260101000000000")
    )
    assert len(second.close()) == 1


@pytest.mark.parametrize(
    ("contents", "cuda", "activities", "shapes", "memory", "stack"),
    [
        ([], True, {"CPU", "CUDA"}, False, False, False),  # empty: CPU and CUDA (reference)
        ([], False, {"CPU"}, False, False, False),
        (["cuda"], True, {"CPU", "CUDA"}, False, False, False),  # CPU always on
        (["cpu"], True, {"CPU"}, False, False, False),
        (["cpu", "shapes", "memory", "stack"], True, {"CPU"}, True, True, True),
        (["cuda", "stack"], True, {"CPU", "CUDA"}, False, False, True),
    ],
)
def test_contents_become_torch_profiler_arguments(
    contents, cuda, activities, shapes, memory, stack
) -> None:
    from profd.backends.torch_backend import torch_profiler_kwargs
    from profd.core.request import TorchToolConfig

    kw = torch_profiler_kwargs(TorchToolConfig(contents=contents), cuda)
    assert {a.name for a in kw["activities"]} == activities
    assert (kw["record_shapes"], kw["profile_memory"], kw["with_stack"]) == (shapes, memory, stack)


def test_shapes_and_stack_are_in_the_recorded_trace(tmp_path) -> None:
    """The flags reach torch: input shapes on operators, Python frames from with_stack."""
    from profd.backends.torch_backend import read_trace

    def record(contents: list[str]) -> dict:
        coll = TorchBackend({"contents": contents}).open(spec(tmp_path / "_".join(contents)))
        with coll.annotate("x"):
            torch.ones(4, 4) @ torch.ones(4, 4)
        (out,) = coll.close()
        (written,) = out.write()
        return read_trace(written.path)

    def mm_args(trace: dict) -> dict:
        return next(e for e in trace["traceEvents"] if e.get("name") == "aten::mm")["args"]

    rich, plain = record(["cpu", "shapes", "stack"]), record(["cpu"])
    assert mm_args(rich)["Input Dims"] == [[4, 4], [4, 4]] and "Input Dims" not in mm_args(plain)
    cats = {e.get("cat") for e in rich["traceEvents"]}
    assert "python_function" in cats
    assert "python_function" not in {e.get("cat") for e in plain["traceEvents"]}


def test_cuda_asked_on_a_worker_without_cuda_is_a_warning(monkeypatch, tmp_path) -> None:
    from profd.backends.torch_backend import NO_CUDA_HERE

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for contents, warned in ((["cuda", "cpu"], True), ([], False), (["cpu"], False)):
        coll = TorchBackend({"contents": contents}).open(spec(tmp_path / str(len(contents))))
        with coll.annotate("x"):
            torch.ones(4).sum()
        (out,) = coll.close()
        (written,) = out.write()
        assert (NO_CUDA_HERE in written.warnings) is warned, contents


def test_attaching_an_agent_applies_the_nvtx_guard(monkeypatch, local_coordinator) -> None:
    """The guard is wired into attach: a worker's CUPTI-grabbing injection is disabled before
    any session can ask for CUDA activity; the opt-out keeps it."""
    monkeypatch.setenv(NVTX_VAR, "/usr/lib/libcupti-injection.so")
    (agent,) = start_agents(local_coordinator)
    assert os.environ[NVTX_VAR] == DISABLED_PATH
    agent.close()
    monkeypatch.setenv(NVTX_VAR, "/usr/lib/libcupti-injection.so")
    monkeypatch.setenv("PROFD_KEEP_NVTX_INJECTION", "1")
    (agent,) = start_agents(local_coordinator)
    assert os.environ[NVTX_VAR] == "/usr/lib/libcupti-injection.so"
    agent.close()


def test_py_spy_is_refused_where_ptrace_is_restricted(tmp_path) -> None:
    from profd.backends.py_spy import ptrace_refusal

    scope, status = tmp_path / "ptrace_scope", tmp_path / "status"
    status.write_text("Name:\tpython\nCapEff:\t0000000000000000\n")
    assert ptrace_refusal(tmp_path / "absent", status, euid=1000) is None  # no Yama
    for value, refused in (("0", False), ("1", True), ("2", True), ("3", True)):
        scope.write_text(value + "\n")
        reason = ptrace_refusal(scope, status, euid=1000)
        assert (reason is not None) is refused, value
        if refused:
            assert f"ptrace_scope={value}" in reason
    scope.write_text("1\n")
    assert ptrace_refusal(scope, status, euid=0) is None  # root
    status.write_text("CapEff:\t0000000000080000\n")  # CAP_SYS_PTRACE (bit 19)
    assert ptrace_refusal(scope, status, euid=1000) is None
    scope.write_text("3\n")
    assert ptrace_refusal(scope, status, euid=0) is not None  # nobody may
