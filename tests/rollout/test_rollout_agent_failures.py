"""Engine failures become the replica's ``partial`` outcome with the reason, never an exception;
other replicas are unaffected; slow flushes are waited for and unfinished files reported."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from rollout_helpers import FAST, names, sglang_pair, vllm_pair

from profd.core.states import PartState
from profd.rollout import (
    EngineProfileOptions,
    EngineTimeouts,
    FlushWait,
    InProcessEngine,
    RolloutAgent,
    SglangHttpEngine,
    VllmHttpEngine,
)
from profd.rollout.relocate import gzip_complete
from profd.testing.fake_engines import read_trace

from helpers import free_port, wait_until

OPTS = EngineProfileOptions()


def test_endpoint_down_at_start(tmp_path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    timeouts = EngineTimeouts(connect_s=1, start_s=2, stop_s=2)
    for engine in (VllmHttpEngine(url, timeouts), SglangHttpEngine(url, timeouts)):
        agent = RolloutAgent(0, (1, 1, 1), engine, trace_dir=tmp_path / "t", flush=FAST)
        started = agent.start_window("s1", tmp_path / "s", OPTS)
        assert not started.ok and "unreachable" in started.reason
        out = agent.finish_window("s1")
        assert out.state is PartState.PARTIAL
        assert out.reason.startswith("replica 0: start failed:") and url in out.reason
        assert agent.busy_with is None  # the replica is free for the next session


def test_endpoint_gone_before_stop(tmp_path) -> None:
    fake, agent = vllm_pair(
        tmp_path, tp=2, flush=FAST.model_copy(update={"first_file_timeout_s": 30})
    )
    with fake:
        assert agent.start_window("s1", tmp_path / "s", OPTS).ok
        fake.kill()
        t0 = time.monotonic()
        out = agent.finish_window("s1")
    # The engine is gone: no 30 s wait for files that cannot come.
    assert time.monotonic() - t0 < 5
    assert out.state is PartState.PARTIAL
    assert "stop failed: vllm endpoint" in out.reason and "unreachable" in out.reason
    assert "no trace file in" in out.reason and "repeated start/stop" not in out.reason


def test_start_refused(tmp_path) -> None:
    fake, agent = sglang_pair(tmp_path, tp=1, refuse_start=True)
    with fake:
        started = agent.start_window("s1", tmp_path / "s", OPTS)
        out = agent.finish_window("s1")
    assert not started.ok
    assert out.state is PartState.PARTIAL
    assert (
        "start failed: sglang refused /start_profile: HTTP 500: Internal Server Error" in out.reason
    )
    assert [r[1] for r in fake.requests] == ["/start_profile"]  # no stop for a window never started


def test_stop_hangs_then_late_files_do_not_leak_into_the_next_window(tmp_path) -> None:
    timeouts = EngineTimeouts(connect_s=1, start_s=5, stop_s=0.5)
    fake, agent = vllm_pair(tmp_path, tp=2, timeouts=timeouts, stop_hangs=True)
    with fake:
        agent.start_window("s1", tmp_path / "s1", OPTS)
        out = agent.finish_window("s1")
        assert out.state is PartState.PARTIAL
        assert "stop failed: vllm /stop_profile did not answer within 0.5s" in out.reason
        fake.release()  # the stop finally returns and the workers write window 1's files
        engine_dir = agent.trace_dir
        # two traces and, from vLLM 0.32, their two side files
        wait_until(lambda: len(names(engine_dir)) == 4, 10, what="late files")
        late = set(names(engine_dir))
        fake.stop_hangs = False
        agent.start_window("s2", tmp_path / "s2", OPTS, {0})
        fake.advance(2)
        out2 = agent.finish_window("s2")
    assert out2.state is PartState.DONE, out2.reason
    # Window 2 took only its own traces; window 1's late traces stay in the engine directory.
    # The side files window 2 rewrote under the same names are window 2's, and go with it.
    late_traces = {n for n in late if n.endswith(".pt.trace.json.gz")}
    assert set(names(engine_dir)) == late_traces and len(late_traces) == 2
    assert all(f.source_name not in late for f in out2.traces + out2.kept_in_subdir)
    assert sorted(Path(f).name for f in out2.side_files) == sorted(late - late_traces)


@pytest.mark.parametrize(("version", "hinted"), [("0.13.0", True), ("0.32.0", False)])
def test_vllm_writes_nothing_after_a_repeated_start_stop(tmp_path, version, hinted) -> None:
    # the known bug of older vLLM; 0.32 was seen writing every window, so no hint there
    fake, agent = vllm_pair(tmp_path, tp=2, version=version, no_files_after_first_window=True)
    with fake:
        agent.start_window("s1", tmp_path / "s1", OPTS)
        fake.advance(2)
        first = agent.finish_window("s1")
        agent.start_window("s2", tmp_path / "s2", OPTS)
        fake.advance(2)
        second = agent.finish_window("s2")
    assert first.state is PartState.DONE and len(first.traces) == 2
    assert second.state is PartState.PARTIAL and second.traces == ()
    assert "no trace file appeared" in second.reason and "delay_iterations" in second.reason
    assert ("repeated start/stop" in second.reason) is hinted


def test_a_failing_replica_leaves_the_others_alone(tmp_path) -> None:
    session = tmp_path / "s"
    good_fake, good = sglang_pair(tmp_path, replica=0, tp=2)
    bad_fake, bad = sglang_pair(tmp_path, replica=1, tp=2, refuse_start=True)
    with good_fake, bad_fake:
        for agent in (good, bad):
            agent.start_window("s1", session, OPTS, {0, 2})
        good_fake.advance(2)
        bad_out = bad.finish_window("s1")
        good_out = good.finish_window("s1")
    assert bad_out.state is PartState.PARTIAL and "replica 1" in bad_out.reason
    assert good_out.state is PartState.DONE and [f.global_rank for f in good_out.traces] == [0]
    assert names(session) == [Path(good_out.traces[0].path).name]


def test_requested_rank_without_file_is_a_partial(tmp_path) -> None:
    class Engine:
        """Writes only tp rank 0's file: rank 1's worker lost its trace."""

        def start_profile(self, **kw):
            self.out = Path(kw["output_dir"])

        def stop_profile(self):
            (self.out / "9.1-TP-0.trace.json").write_text("{}")

    agent = RolloutAgent(0, (2, 1, 1), InProcessEngine(Engine(), "sglang"), flush=FAST)
    agent.start_window("s1", tmp_path / "s", OPTS, {1})
    out = agent.finish_window("s1")
    assert (
        out.state is PartState.PARTIAL and "no trace for requested global rank(s) [1]" in out.reason
    )
    assert [f.global_rank for f in out.kept_in_subdir] == [0]  # still kept, never dropped


def test_engine_adapter_bug_is_contained(tmp_path) -> None:
    class Broken:
        kind = "vllm"
        flavor = "sglang"
        endpoint = "broken"
        output_dir_per_window = True

        def start(self, window):
            raise KeyError("oops")

        def stop(self):
            raise AssertionError("never called")

        def close(self):
            pass

    agent = RolloutAgent(0, (1, 1, 1), Broken(), flush=FAST)
    started = agent.start_window("s1", tmp_path / "s", OPTS)
    assert not started.ok and "KeyError" in started.reason
    assert agent.finish_window("s1").state is PartState.PARTIAL


def test_slow_flush_is_waited_for(tmp_path) -> None:
    # The stop answers at once; files appear 0.3 s later and grow for 1.2 s, with pauses
    # longer than the settle interval.
    flush = FAST.model_copy(update={"first_file_timeout_s": 10})  # robust on a busy machine
    fake, agent = sglang_pair(
        tmp_path, tp=2, flush=flush, stop_blocks=False, flush_s=1.2, appear_delay_s=0.3
    )
    with fake:
        agent.start_window("s1", tmp_path / "s", OPTS, {1})
        fake.advance(3)
        t0 = time.monotonic()
        out = agent.finish_window("s1")
        elapsed = time.monotonic() - t0
    assert out.state is PartState.DONE, out.reason
    assert elapsed >= 1.2
    for f in out.traces + out.kept_in_subdir:
        assert gzip_complete(f.path) and read_trace(f.path)["fake_engine"]["iterations"] == [
            1,
            2,
            3,
        ]


def test_flush_slower_than_the_timeout_is_reported_not_moved(tmp_path) -> None:
    flush = FlushWait(
        settle_s=0.15, poll_s=0.03, timeout_s=0.8, first_file_timeout_s=0.6, peer_grace_s=0.5
    )
    fake, agent = vllm_pair(tmp_path, tp=2, flush=flush, stop_blocks=False, flush_s=2.0)
    with fake:
        agent.start_window("s1", tmp_path / "s", OPTS)
        fake.advance(2)
        out = agent.finish_window("s1")
        fake.join_writers()
    assert out.state is PartState.PARTIAL
    assert "2 file(s) still being written" in out.reason
    assert out.traces == () and len(out.incomplete) == 2
    for inc in out.incomplete:
        # Left where the engine writes, and complete once the engine is done.
        assert Path(inc.path).parent == agent.trace_dir and gzip_complete(inc.path)
    assert names(tmp_path / "s") == []


def test_a_timed_out_start_is_followed_by_a_stop(tmp_path) -> None:
    release = threading.Event()

    class Slow:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def start_profile(self, **kw):
            release.wait(5)  # the engine starts, but answers too late
            self.calls.append("start")

        def stop_profile(self):
            self.calls.append("stop")

    slow = Slow()
    timeouts = EngineTimeouts(connect_s=1, start_s=0.3, stop_s=2)
    engine = InProcessEngine(slow, "sglang", timeouts=timeouts)
    agent = RolloutAgent(0, (1, 1, 1), engine, flush=FAST)
    started = agent.start_window("s1", tmp_path / "s", OPTS)
    assert not started.ok and "did not return within 0.3s" in started.reason
    release.set()
    out = agent.finish_window("s1")
    assert out.state is PartState.PARTIAL and "stop" in slow.calls
    assert any("sent a stop after the timed-out start" in w for w in out.warnings)


def test_bad_mode_fails_early_naming_the_field(tmp_path) -> None:
    agent = RolloutAgent(0, (1, 1, 1), VllmHttpEngine("http://127.0.0.1:9"), trace_dir=tmp_path)
    with pytest.raises(ValueError, match="mode: must be continuous or discrete"):
        agent.start_window("s1", tmp_path / "s", OPTS, mode="sometimes")
    assert agent.busy_with is None
