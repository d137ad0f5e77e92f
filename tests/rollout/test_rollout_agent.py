"""RolloutAgent against fake vLLM / SGLang servers over real HTTP on 127.0.0.1: naming and
relocation cases, token windows, modes, registration info and events."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from rollout_helpers import FAST, names, sglang_pair, vllm_pair

from profd.analysis.summary import summarize_dir
from profd.core.clock_hints import WINDOWS_FILE, read_clock_hints
from profd.core.protocol import EventKind, PartDone, ReplicaInfo, TraceWritten
from profd.core.states import PartState
from profd.rollout import EngineProfileOptions, RolloutAgent, WindowMode, engine_trace_dir
from profd.rollout.engines import InProcessEngine
from profd.testing.fake_engines import chrome_trace_bytes, read_trace

OPTS = EngineProfileOptions()


def run(agent, fake, session_dir: Path, opts=OPTS, keep=None, iterations=3, mode="continuous"):
    started = agent.start_window("s1", session_dir, opts, keep, mode)
    assert started.ok, started.reason
    fake.advance(iterations)
    return agent.finish_window("s1")


@pytest.mark.parametrize("pair", [vllm_pair, sglang_pair])
def test_documented_example_tp2_ranks_0_and_8(tmp_path, pair) -> None:
    # Reference §8.5: tp=2, ranks [0, 8] → replicas 0 and 4; exactly globalrank0 and
    # globalrank8 come up; their tp mates stay in the replica sub-directories.
    session = tmp_path / "session"
    fake0, agent0 = pair(tmp_path, replica=0)
    fake4, agent4 = pair(tmp_path, replica=4)
    with fake0, fake4:
        out0 = run(agent0, fake0, session, keep={0, 8})
        out4 = run(agent4, fake4, session, keep={0, 8})
    assert out0.state is PartState.DONE and out4.state is PartState.DONE, (out0.reason, out4.reason)
    up = names(session)
    assert len(up) == 2
    assert up[0].startswith("rollout-replica0-globalrank0_") and up[1].startswith(
        "rollout-replica4-globalrank8_"
    )
    assert [f.global_rank for f in out4.traces] == [8]
    assert [f.global_rank for f in out4.kept_in_subdir] == [9]
    # one tp peer per replica, and (vLLM 0.32) the workers' side files, kept, not traces
    sides = ["rank0.profiler_out.txt", "rank1.profiler_out.txt"] if pair is vllm_pair else []
    for replica in ("rollout-replica0", "rollout-replica4"):
        kept = names(session / replica)
        assert len([n for n in kept if n.endswith(".trace.json.gz")]) == 1
        assert sorted(n for n in kept if n.endswith(".txt")) == sides
    assert len(out0.side_files) == len(sides) and not any(".txt" in f.path for f in out0.traces)
    doc = read_trace(out4.traces[0].path)  # a complete, readable trace of the right GPU
    assert doc["distributedInfo"]["rank"] == 0 and doc["fake_engine"]["rank"] == 0
    assert read_trace(out4.kept_in_subdir[0].path)["distributedInfo"]["rank"] == 1


@pytest.mark.parametrize(
    ("pair", "layout", "fake_kw", "files"),
    [
        (sglang_pair, (1, 2, 1), {}, 2),  # -DP-
        (sglang_pair, (1, 1, 2), {}, 2),  # -PP-
        (vllm_pair, (2, 2, 1), {}, 4),  # vLLM dp > 1: -rank-<k> repeats per dp engine
        (vllm_pair, (1, 1, 2), {}, 2),  # vLLM pp > 1
    ],
)
def test_ambiguous_layouts_are_named_by_replica_and_all_come_up(
    tmp_path, pair, layout, fake_kw, files
) -> None:
    tp, dp, pp = layout
    fake, agent = pair(tmp_path, replica=1, tp=tp, dp=dp, pp=pp, **fake_kw)
    session = tmp_path / "s"
    with fake:
        out = run(agent, fake, session, keep={agent.global_ranks.start})
    assert out.state is PartState.DONE, out.reason
    up = names(session)
    assert len(up) == files and all(n.startswith("rollout-replica1_") for n in up)
    assert all(f.global_rank is None and f.rank_note for f in out.traces)
    assert any("cannot be told apart" in w for w in out.warnings)
    assert out.kept_in_subdir == ()


def test_vllm_moe_names_resolve_global_ranks_with_dp(tmp_path) -> None:
    fake, agent = vllm_pair(tmp_path, replica=1, tp=2, dp=2, moe=True)
    session = tmp_path / "s"
    with fake:
        out = run(agent, fake, session, keep={4, 7})
    assert out.state is PartState.DONE, out.reason
    assert [f.global_rank for f in out.traces] == [4, 7]  # dp0 tp0 and dp1 tp1 of replica 1
    assert sorted(f.global_rank for f in out.kept_in_subdir) == [5, 6]
    assert all(f.rank_note == "" for f in out.traces + out.kept_in_subdir)


def test_sglang_expert_parallel_names_keep_their_tp_rank(tmp_path) -> None:
    fake, agent = sglang_pair(tmp_path, replica=1, tp=4, ep=2)
    session = tmp_path / "s"
    with fake:
        out = run(agent, fake, session, keep={5, 7})
    assert out.state is PartState.DONE, out.reason
    up = names(session)
    assert [f.global_rank for f in out.traces] == [5, 7] and len(up) == 2
    assert up[0].startswith("rollout-replica1-globalrank5_") and "-TP-1-EP-0." in up[0]
    assert up[1].startswith("rollout-replica1-globalrank7_") and "-TP-3-EP-1." in up[1]
    assert sorted(f.global_rank for f in out.kept_in_subdir) == [4, 6]


def test_vllm_legacy_host_pid_names_and_frontend_trace(tmp_path) -> None:
    fake, agent = vllm_pair(tmp_path, tp=2, version="0.8.5", legacy_names=True)
    with fake:
        out = run(agent, fake, tmp_path / "s", keep={1})
    assert out.state is PartState.DONE, out.reason
    # Two workers + the API server's trace, none with a rank: all come up by replica only.
    assert len(out.traces) == 3 and all(f.global_rank is None for f in out.traces)
    assert any(".async_llm." in f.path for f in out.traces)
    assert all(Path(f.path).name.startswith("rollout-replica0_") for f in out.traces)


def test_vllm_frontend_trace_next_to_rank_files(tmp_path) -> None:
    fake, agent = vllm_pair(tmp_path, tp=2, frontend_trace=True)
    with fake:
        out = run(agent, fake, tmp_path / "s", keep={1})
    assert out.state is PartState.DONE, out.reason
    by_rank = {f.global_rank: Path(f.path).name for f in out.traces}
    assert set(by_rank) == {1, None}
    assert by_rank[1].startswith("rollout-replica0-globalrank1_") and ".async_llm." in by_rank[None]
    assert [f.global_rank for f in out.kept_in_subdir] == [0]


def test_vllm_token_window_from_launch_config(tmp_path) -> None:
    opts = EngineProfileOptions(
        contents=("cuda", "stack", "shapes"), profile_token_start=2, profile_token_end=5
    )
    fake, agent = vllm_pair(tmp_path, launch_opts=opts)
    with fake:
        out = run(agent, fake, tmp_path / "s", opts=opts, iterations=10)
        assert fake.running is False  # max_iterations stopped the workers on their own
    assert out.state is PartState.DONE and out.warnings == ()
    doc = read_trace(out.traces[0].path)["fake_engine"]
    assert doc["iterations"] == [2, 3, 4]  # tokens [2, 5)
    assert doc["with_stack"] and doc["record_shapes"] and not doc["with_memory"]


def test_vllm_0_12_token_window_through_env(tmp_path) -> None:
    opts = EngineProfileOptions(profile_token_start=1, profile_token_end=3)
    fake, agent = vllm_pair(tmp_path, tp=1, version="0.12.0", launch_opts=opts)
    assert fake.launch["delay"] == 2 and fake.launch["max"] == 2 and not fake.launch["frontend"]
    with fake:
        out = run(agent, fake, tmp_path / "s", opts=opts, iterations=6)
    assert read_trace(out.traces[0].path)["fake_engine"]["iterations"] == [1, 2]


def test_vllm_old_version_records_the_whole_span_and_says_so(tmp_path) -> None:
    opts = EngineProfileOptions(profile_token_start=1, profile_token_end=3)
    fake, agent = vllm_pair(tmp_path, tp=1, version="0.9.2", launch_opts=opts)
    with fake:
        agent.start_window("s1", tmp_path / "s", opts)
        fake.advance(4)
        out = agent.finish_window("s1")
    assert any("no iteration window" in w for w in out.warnings)
    rank_files = [f for f in out.traces if ".async_llm." not in f.path]
    assert read_trace(rank_files[0].path)["fake_engine"]["iterations"] == [0, 1, 2, 3]


def test_vllm_session_window_other_than_launched_is_a_warning(tmp_path) -> None:
    fake, agent = vllm_pair(tmp_path, tp=1, version="0.13.0")  # launched without a window
    asked = EngineProfileOptions(profile_token_start=3, profile_token_end=4)
    with fake:
        started = agent.start_window("s1", tmp_path / "s", asked)
        fake.advance(2)
        out = agent.finish_window("s1")
    assert any("fixed at launch" in w for w in started.warnings)
    assert out.state is PartState.DONE and any("fixed at launch" in w for w in out.warnings)
    assert read_trace(out.traces[0].path)["fake_engine"]["iterations"] == [0, 1]


def test_vllm_0_32_session_window_goes_with_the_start(tmp_path) -> None:
    fake, agent = vllm_pair(tmp_path, tp=1)  # 0.32, launched without a window
    asked = EngineProfileOptions(profile_token_start=3, profile_token_end=5)
    with fake:
        started = agent.start_window("s1", tmp_path / "s", asked)
        fake.advance(9)
        out = agent.finish_window("s1")
    assert not any("fixed at launch" in w for w in started.warnings + out.warnings)
    assert fake.requests[0][2] == {"delay_iterations": 4, "max_iterations": 2}
    assert out.state is PartState.DONE, out.reason
    assert read_trace(out.traces[0].path)["fake_engine"]["iterations"] == [3, 4]  # tokens 3, 4


def test_sglang_token_window_start_step_and_num_steps(tmp_path) -> None:
    opts = EngineProfileOptions(
        contents=("cuda", "memory"), profile_token_start=2, profile_token_end=5
    )
    fake, agent = sglang_pair(tmp_path, tp=2)
    with fake:
        started = agent.start_window("s1", tmp_path / "s", opts)
        fake.advance(8)  # the engine starts at pass 2, stops after 3 passes and writes
        assert len(names(tmp_path / "s" / "rollout-replica0")) == 4  # 2 traces, 2 snapshots
        out = agent.finish_window("s1")
    body = fake.requests[0][2]
    assert body["start_step"] == 2 and body["num_steps"] == 3
    assert body["activities"] == ["CPU", "GPU", "MEM"]  # memory: SGLang's memory snapshot
    assert out.state is PartState.DONE, out.reason
    assert not any("memory" in w for w in started.warnings)
    assert any("already stopped after num_steps" in w for w in out.warnings)
    traces = [f for f in out.traces if f.path.endswith(".json.gz")]
    assert read_trace(traces[0].path)["fake_engine"]["iterations"] == [2, 3, 4]
    snapshots = sorted((f.global_rank, Path(f.path).name) for f in out.traces if f not in traces)
    assert [g for g, _ in snapshots] == [0, 1]
    assert all(n.startswith("rollout-replica0-globalrank") for _, n in snapshots)
    assert all(n.endswith("-memory.pickle") for _, n in snapshots)


@pytest.mark.parametrize("mode", list(WindowMode))
@pytest.mark.parametrize("pair", [vllm_pair, sglang_pair])
def test_engines_are_profiled_in_both_modes(tmp_path, pair, mode) -> None:
    fake, agent = pair(tmp_path, tp=1)
    with fake:
        out = run(agent, fake, tmp_path / "s", mode=mode)
    assert out.state is PartState.DONE and out.mode is mode and len(out.traces) == 1


def test_one_window_at_a_time(tmp_path) -> None:
    fake, agent = sglang_pair(tmp_path, tp=1)
    with fake:
        assert agent.start_window("a", tmp_path / "a", OPTS).ok
        second = agent.start_window("b", tmp_path / "b", OPTS)
        assert not second.ok and "already profiling session a" in second.reason
        assert agent.busy_with == "a"
        unknown = agent.finish_window("b")
        assert unknown.state is PartState.PARTIAL and "no window of session b" in unknown.reason
        assert agent.finish_window("a").state is PartState.DONE
        assert agent.busy_with is None and agent.start_window("b", tmp_path / "b", OPTS).ok
        agent.finish_window("b")
    assert fake.requests[-1][1] == "/stop_profile"


def test_run_window_for_a_duration_and_cancel(tmp_path) -> None:
    fake, agent = vllm_pair(tmp_path, tp=1)
    with fake:
        t0 = time.monotonic()
        out = agent.run_window("d1", tmp_path / "d1", OPTS, duration_s=0.4)
        assert time.monotonic() - t0 >= 0.4 and out.state is PartState.DONE
        cancel = threading.Event()
        threading.Timer(0.2, cancel.set).start()
        t0 = time.monotonic()
        out2 = agent.run_window("d2", tmp_path / "d2", OPTS, duration_s=60, cancel=cancel)
        assert time.monotonic() - t0 < 10
    assert out2.state is PartState.DONE and len(out2.traces) == 1
    with pytest.raises(ValueError, match="duration_s"):
        agent.run_window("d3", tmp_path, OPTS, duration_s=0)


def test_relocate_false_reports_files_where_the_engine_wrote_them(tmp_path) -> None:
    fake, agent = sglang_pair(tmp_path, tp=2)
    with fake:
        agent.start_window("s1", tmp_path / "s", OPTS, {1}, relocate=False)
        out = agent.finish_window("s1")
    assert out.state is PartState.DONE
    assert names(tmp_path / "s") == []
    assert [f.global_rank for f in out.traces] == [1]
    assert Path(out.traces[0].path).parent == tmp_path / "s" / "rollout-replica0"


def test_describe_and_agent_info(tmp_path) -> None:
    fake, agent = vllm_pair(tmp_path, replica=3, tp=2, dp=2)
    info = agent.describe()
    assert (info.role, info.replica_index, info.world_size, info.global_ranks) == (
        "rollout",
        3,
        4,
        (12, 16),
    )
    assert info.engine_kind == "vllm" and info.endpoint == fake.url
    assert info.trace_dir == str(engine_trace_dir(tmp_path / "root", 3))
    assert info.capabilities["torch"] is None and info.capabilities["nsys"]
    ai = info.to_agent_info("rollout-3-abc", "host", 42, replicas=8)
    assert (ai.role, ai.rank, ai.world_size) == ("rollout", 3, 8)
    assert ai.topology == {"tp": 2, "dp": 2, "pp": 1}
    assert ai.replica == ReplicaInfo(world_size=4, global_rank_start=12, global_rank_stop=16)


def test_agent_provides_vllm_launch_settings(tmp_path) -> None:
    class Engine:
        def start_profile(self):
            pass

        def stop_profile(self):
            pass

    agent = RolloutAgent(0, (1, 1, 1), InProcessEngine(Engine()), trace_dir=tmp_path / "t")
    s = agent.launch_settings(EngineProfileOptions(contents=("cuda", "memory")), "0.14.0")
    assert s.profiler_config["torch_profiler_dir"] == str(tmp_path / "t") and agent.vllm_launch is s
    sg = RolloutAgent(0, (1, 1, 1), InProcessEngine(Engine(), "sglang"))
    with pytest.raises(ValueError, match="launch settings are for vLLM"):
        sg.launch_settings(OPTS, "0.14.0")
    with pytest.raises(ValueError, match="trace_dir"):
        RolloutAgent(0, (1, 1, 1), InProcessEngine(Engine())).launch_settings(OPTS, "0.14.0")
    with pytest.raises(ValueError, match="replica_index"):
        RolloutAgent(-1, (1, 1, 1), InProcessEngine(Engine()))


def test_events_for_the_coordinator(tmp_path) -> None:
    fake, agent = sglang_pair(tmp_path, replica=2, tp=2)
    with fake:
        out = run(agent, fake, tmp_path / "s", keep={5})
    events = out.events("torch", steps=[7, 8], node_id="n1")
    kinds = [e.kind for e in events]
    assert kinds == [EventKind.TRACE, EventKind.PART_DONE]
    written = events[0].payload
    assert isinstance(written, TraceWritten)
    assert written.global_rank == 5 and written.replica == 2 and written.steps == (7, 8)
    assert written.scope == "rollout" and written.bytes > 0 and len(written.trace_id) == 16
    assert events[0].session_id == "s1" and events[0].step == 7
    done = events[1].payload
    assert isinstance(done, PartDone) and done.replica == 2
    assert done.kept_in_subdir == (out.kept_in_subdir[0].path,)


def test_in_process_engine_window(tmp_path) -> None:
    class Engine:
        """An SGLang-like engine object writing one file per tp rank on stop."""

        def __init__(self) -> None:
            self.kw: dict = {}

        def start_profile(self, **kw):
            self.kw = kw

        def stop_profile(self):
            out = Path(self.kw["output_dir"])
            for t in range(2):
                (out / f"123.4-TP-{t}.trace.json").write_text("{}")

    agent = RolloutAgent(0, (2, 1, 1), InProcessEngine(Engine(), "sglang"), flush=FAST)
    agent.start_window("s1", tmp_path / "s", OPTS, {1})
    out = agent.finish_window("s1")
    assert out.state is PartState.DONE and [f.global_rank for f in out.traces] == [1]
    assert out.traces[0].path.endswith("rollout-replica0-globalrank1_123.4-TP-1.trace.json")


def test_traces_without_a_wall_clock_are_placed_by_the_window_start(tmp_path) -> None:
    # An engine whose traces have no baseTimeNanoseconds: the agent records when it told the
    # engine to start, beside the files, and the summary places them there.
    fake, agent = vllm_pair(tmp_path, tp=2, relative_clock=True)
    session = tmp_path / "session"
    before = time.time()
    with fake:
        out = run(agent, fake, session)
    assert out.state is PartState.DONE, out.reason
    hints = read_clock_hints(session)
    assert sorted(hints) == names(session)
    assert all(before * 1e6 <= h.start_us <= time.time() * 1e6 for h in hints.values())
    (session / "wall.pt.trace.json.gz").write_bytes(chrome_trace_bytes("vllm", 0, 1, [7], {}))
    s = summarize_dir(session)
    assert not s.skipped and sorted(a.name for a in s.aligned) == sorted(hints)
    assert all("replica 0's profiling window" in a.source for a in s.aligned)
    assert 0 <= s.span_ms < 60_000
    (session / WINDOWS_FILE).unlink()  # without the record they cannot be placed
    s = summarize_dir(session)
    assert sorted(x.name for x in s.skipped) == sorted(hints) and not s.aligned


def test_no_start_record_when_a_token_window_delays_the_recording(tmp_path) -> None:
    # with a delay the profiler starts some iterations after the call: its ts 0 is not the
    # call, so no record places it there
    opts = EngineProfileOptions(profile_token_start=2, profile_token_end=4)
    fake, agent = vllm_pair(tmp_path, tp=1, relative_clock=True)
    session = tmp_path / "session"
    with fake:
        out = run(agent, fake, session, opts=opts, iterations=6)
    assert out.state is PartState.DONE, out.reason
    assert read_clock_hints(session) == {} and not (session / WINDOWS_FILE).exists()


def test_the_next_window_starts_while_the_last_ones_files_are_collected(tmp_path) -> None:
    """A stop frees the replica at once (a later group's window starts while the earlier
    one's files settle). The files there when the next window starts are the earlier
    window's; what appears after is the next one's (an engine may write a window's files
    before its stop: a token window ends by itself), even while the earlier one collects."""
    import shutil

    fake, agent = vllm_pair(tmp_path, tp=1)
    with fake:
        assert agent.start_window("a", tmp_path / "a", OPTS, relocate=False).ok
        fake.advance(2)
        stopped = agent.stop_window("a")
        assert agent.busy_with is None
        (mine,) = [p for p in agent.trace_dir.iterdir() if p.name.endswith(".json.gz")]
        late = mine.with_name(mine.name.replace(".", "8.", 1))  # a's, written after its stop
        shutil.copy(mine, late)
        assert agent.start_window("b", tmp_path / "b", OPTS, relocate=False).ok
        early = mine.with_name(mine.name.replace(".", "9.", 1))  # b's, before b's stop
        shutil.copy(mine, early)
        a = agent.collect(stopped)
        fake.advance(2)
        b = agent.finish_window("b")
    assert a.state is PartState.DONE
    assert sorted(Path(t.path).name for t in a.traces) == sorted([mine.name, late.name])
    assert b.state is PartState.DONE and len(b.traces) == 2
    assert early.name in {Path(t.path).name for t in b.traces}
    assert agent.windows_finished == 2


def test_a_window_stopped_before_the_last_one_was_collected_keeps_its_own_files(
    tmp_path,
) -> None:
    """Two windows stopped before either's files were collected (steps shorter than the
    files' settle): what the second stop wrote is the second window's alone."""
    fake, agent = vllm_pair(tmp_path, tp=1)
    with fake:
        assert agent.start_window("a", tmp_path / "a", OPTS).ok
        fake.advance(2)
        first = agent.stop_window("a")
        assert agent.start_window("b", tmp_path / "b", OPTS).ok
        fake.advance(2)
        second = agent.stop_window("b")
        a, b = agent.collect(first), agent.collect(second)  # the earlier one first
    for out, session in ((a, "a"), (b, "b")):
        assert out.state is PartState.DONE, out.reason
        (trace,) = out.traces
        assert Path(trace.path).is_relative_to(tmp_path / session), trace.path
    assert agent.windows_finished == 2
