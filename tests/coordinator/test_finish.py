"""Finish hooks (real subprocesses) and exactly-once uploads (fsspec, file://)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from profd.actors.hook_upload import hook_env, run_hook, upload_file
from profd.core.request import SessionRequest

from helpers import coordinator_settings, start_agents, wait_armed, wait_terminal, wait_until


def run(agents, steps) -> None:
    for s in steps:
        for a in agents:
            with a.step(s), a.stage("update"):
                torch.ones(4).sum()


def session(owner, agents, request: dict, steps=range(1, 4)):
    run(agents, [0])
    view = owner.call("create_session", request)
    targeted = {t.agent_id for t in view.targets}
    for a in agents:
        if a.agent_id in targeted:
            wait_armed(a, view.session_id)
    run(agents, steps)
    view = wait_terminal(owner, view.session_id, timeout=30)
    for a in agents:
        a.close()
    return view


# -- the hook-agent rule (pure) ----------------------------------------------------------------
def _record(role: str, rank: int, node: str):
    from profd.actors.registry import AgentRecord
    from profd.core.protocol import AgentInfo

    info = AgentInfo(f"{role}-{rank}", role, rank, 4, {}, node, 100 + rank, node_id=node)
    return AgentRecord(info, 0.0, 0.0)


def _hook_session(targets: list, **request):
    from profd.actors.sessions import Part, Session

    req = SessionRequest.model_validate({"steps": [1], "finish_hook_cmd": "true", **request})
    parts = {r.info.agent_id: Part(r.info.agent_id, r.info.role, r.info.rank, "*") for r in targets}
    return Session("s1", req, "/tmp/s1", 0.0, parts, [], 100.0)


@pytest.mark.parametrize(
    ("request_fields", "chosen"),
    [
        ({}, [("actor", 0), ("actor", 2)]),  # one profiled agent per node, lowest (role, rank)
        ({"finish_hook_ranks": [1, 3, 9]}, [("actor", 1), ("actor", 3)]),  # listed, any node
        ({"finish_hook_all_ranks": True}, [("actor", r) for r in range(4)]),  # the roles' ranks
    ],
)
def test_hook_agents_rule(request_fields, chosen) -> None:
    from profd.actors.finisher import hook_agents

    agents = [_record("actor", r, f"node{r // 2}") for r in range(4)] + [_record("critic", 0, "n")]
    profiled = [agents[0], agents[1], agents[2]]  # ranks 0, 1 on node0; rank 2 on node1
    got = hook_agents(_hook_session(profiled, **request_fields), agents)
    assert [(r.info.role, r.info.rank) for r in got] == chosen


# -- the work functions ------------------------------------------------------------------------
def test_run_hook_exit_code_output_and_timeout(tmp_path) -> None:
    ok = run_hook("echo hello; echo $PROFD_ROLE", {"PROFD_ROLE": "actor"}, str(tmp_path), 10)
    assert ok.ok and ok.exit_code == 0 and ok.output.split() == ["hello", "actor"]
    bad = run_hook("echo oops >&2; exit 3", {}, None, 10)
    assert not bad.ok and bad.exit_code == 3 and "oops" in bad.output
    hung = run_hook("echo started; sleep 30", {}, None, 0.5)
    assert hung.timed_out and not hung.ok and hung.duration_s < 10 and "started" in hung.output


def test_hook_env_carries_profd_and_verl_names() -> None:
    env = hook_env(
        session_id="s",
        save_dir="/d",
        tool="nsys",
        role="actor",
        rank=3,
        pid=9,
        node="n1",
        traces=["/d/a", "/d/b"],
    )
    assert env["PROFD_SAVE_PATH"] == env["VERL_PROFILE_SAVE_PATH"] == "/d"
    assert env["VERL_PROFILE_RANK"] == "3" and env["VERL_PROFILE_ROLE"] == "actor"
    assert env["PROFD_TRACES"] == "/d/a\n/d/b" and "VERL_PROFILE_RAY_NSIGHT_DIR" in env


def test_upload_is_checked_and_idempotent(tmp_path) -> None:
    src = tmp_path / "t.json.gz"
    src.write_bytes(b"x" * 1000)
    dest_root = tmp_path / "bucket"
    first = upload_file(str(src), f"file://{dest_root}", "s1", 1000)
    assert (
        first.ok and not first.skipped and (dest_root / "s1" / "t.json.gz").stat().st_size == 1000
    )
    again = upload_file(str(src), f"file://{dest_root}", "s1", 1000)
    assert again.ok and again.skipped  # never a second copy
    wrong = upload_file(str(src), f"file://{dest_root}", "s2", 999)
    assert not wrong.ok and "size mismatch" in wrong.error
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    fail = upload_file(str(src), f"file://{blocked}", "s3", 1000)
    assert not fail.ok and fail.error


def test_upload_uri_protocol_is_validated() -> None:
    with pytest.raises(ValueError, match="upload_uri"):
        SessionRequest.model_validate({"steps": [1], "upload_uri": "nosuchproto://x"})
    assert SessionRequest.model_validate({"steps": [1], "upload_uri": "file:///tmp/x"}).upload_uri


# -- through the coordinator --------------------------------------------------------------------
def test_hook_runs_once_per_node_after_the_last_step(local_coordinator, tmp_path) -> None:
    marker = tmp_path / "hooks.jsonl"
    cmd = (
        f"python3 -c \"import json,os; open('{marker}','a').write(json.dumps("
        "{k: os.environ[k] for k in ('PROFD_SESSION_ID','PROFD_RANK','VERL_PROFILE_SAVE_PATH',"
        "'PROFD_TRACES')}) + '\\n')\"; echo uploaded"
    )
    agents = start_agents(local_coordinator, 2)
    view = session(
        local_coordinator,
        agents,
        {"steps": [1, 2], "finish_hook_cmd": cmd, "roles": {"actor": {"all_ranks": True}}},
    )
    assert view.state.value == "done", view.reason
    (hook,) = view.hooks  # both agents share this node: one run
    assert hook.state == "done" and hook.exit_code == 0 and "uploaded" in hook.output
    (line,) = marker.read_text().splitlines()
    env = json.loads(line)
    assert env["PROFD_SESSION_ID"] == view.session_id and env["PROFD_RANK"] == "0"
    assert env["VERL_PROFILE_SAVE_PATH"] == view.save_dir
    assert sorted(env["PROFD_TRACES"].split("\n")) == sorted(t.path for t in view.traces)


def test_hook_ranks_override_and_hanging_hook_times_out(local_coordinator) -> None:
    agents = start_agents(local_coordinator, 2)
    view = session(
        local_coordinator,
        agents,
        {
            "steps": [1],
            "finish_hook_cmd": "sleep 30",
            "finish_hook_all_ranks": True,
            "finish_hook_timeout_s": 1,
            "roles": {"actor": {"ranks": [1]}},
        },
    )
    assert view.state.value == "done"  # the traces are fine; the hook's failure is reported
    assert sorted(h.rank for h in view.hooks) == [0, 1]  # all ranks, profiled or not
    assert all(h.state == "timed_out" for h in view.hooks)
    assert any("timed out after 1 s" in w for w in view.warnings)


def test_finish_hook_ranks_choose_the_ranks_and_report_absent_ones(local_coordinator) -> None:
    agents = start_agents(local_coordinator, 2)
    view = session(
        local_coordinator,
        agents,
        {
            "steps": [1],
            "finish_hook_cmd": "echo ran on $PROFD_RANK",
            "finish_hook_ranks": [1, 5],
            "roles": {"actor": {"ranks": [0]}},
        },
    )
    assert view.state.value == "done", view.reason
    (hook,) = view.hooks  # rank 1 runs it though only rank 0 was profiled
    assert hook.rank == 1 and hook.state == "done" and "ran on 1" in hook.output
    assert any("finish_hook_ranks [5]" in w for w in view.warnings), view.warnings


def test_open_group_at_job_end_still_runs_the_hook(local_coordinator, tmp_path) -> None:
    """verl §13 item 3: a continuous group still open at the end never ran the command."""
    marker = tmp_path / "ran"
    (agent,) = start_agents(local_coordinator)
    run([agent], [0])
    view = local_coordinator.call(
        "create_session",
        {
            "steps": [1, 2, 3],
            "profile_continuous_steps": True,
            "finish_hook_cmd": f"touch {marker}",
        },
    )
    wait_armed(agent, view.session_id)
    run([agent], [1, 2])  # the job ends inside the group
    agent.close()
    view = wait_terminal(local_coordinator, view.session_id)
    assert view.state.value == "partial" and marker.exists()
    assert view.hooks[0].state == "done"


def test_every_trace_is_uploaded_once(local_coordinator, tmp_path) -> None:
    bucket = tmp_path / "bucket"
    agents = start_agents(local_coordinator, 2)
    view = session(
        local_coordinator,
        agents,
        {
            "steps": [1, 2],
            "upload_uri": f"file://{bucket}",
            "roles": {"actor": {"all_ranks": True}},
        },
    )
    assert view.state.value == "done", view.reason
    assert len(view.uploads) == len(view.traces) == 4
    assert all(u.state == "done" for u in view.uploads)
    for t in view.traces:
        copy = bucket / view.session_id / t.file_name
        assert copy.stat().st_size == t.bytes == Path(t.path).stat().st_size
    # the same TRACE event again (an agent retrying after an outage): no second upload
    from profd.core.protocol import AgentEvent, EventKind, TraceWritten

    t = view.traces[0]
    written = TraceWritten(t.trace_id, t.path, t.bytes, tuple(t.steps), t.scope, t.tool)
    again = AgentEvent(EventKind.TRACE, view.session_id, 1, payload=written)
    assert local_coordinator.call("report", t.agent_id, [again]) is True
    assert len(local_coordinator.call("get_session", view.session_id).uploads) == 4
    assert sorted(p.name for p in (bucket / view.session_id).iterdir()) == sorted(
        t.file_name for t in view.traces
    )  # no partial or duplicate copies


def test_failed_upload_makes_the_session_partial(local_coordinator, tmp_path) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("x")
    (agent,) = start_agents(local_coordinator)
    view = session(local_coordinator, [agent], {"steps": [1], "upload_uri": f"file://{blocked}"})
    assert view.state.value == "partial"
    assert "upload of" in view.reason and view.uploads[0].state == "failed"
    assert Path(view.traces[0].path).is_file()  # the trace itself is intact


def test_pending_upload_resumes_once_after_a_coordinator_restart(tmp_path) -> None:
    """The coordinator dies while an upload is in flight: its successor (same state directory)
    runs the pending upload, once, and the session ends done."""
    import asyncio

    from profd.actors.coordinator import ProfileCoordinator
    from profd.actors.runner import LocalRunner
    from profd.testing.coordinator import InProcessCoordinator

    class StuckRunner:  # the upload never returns: the coordinator "dies" before it does
        async def run(self, node_id, fn, *args):
            await asyncio.Event().wait()

    settings = coordinator_settings(tmp_path)
    bucket = tmp_path / "bucket"
    first = InProcessCoordinator(ProfileCoordinator(settings, runner=StuckRunner()))
    (agent,) = start_agents(first)
    run([agent], [0])
    view = first.call("create_session", {"steps": [1], "upload_uri": f"file://{bucket}"})
    wait_armed(agent, view.session_id)
    run([agent], [1, 2])
    wait_until(
        lambda: first.call("get_session", view.session_id).uploads, 10, what="upload pending"
    )
    agent.close()
    pending = first.call("get_session", view.session_id)
    assert pending.state.value == "collecting" and pending.uploads[0].state == "pending"
    first.close()

    second = InProcessCoordinator(ProfileCoordinator(settings, runner=LocalRunner()))
    try:
        second.call("status")  # the first call starts its housekeeping, which resumes uploads
        done = wait_terminal(second, view.session_id, timeout=30)
        assert done.state.value == "done", done.reason
        (upload,) = done.uploads
        assert upload.state == "done"
        (trace,) = done.traces
        assert [p.name for p in (bucket / view.session_id).iterdir()] == [trace.file_name]
        assert (bucket / view.session_id / trace.file_name).stat().st_size == trace.bytes
    finally:
        second.close()


def test_an_upload_resumed_on_a_new_cluster_is_read_by_node_address(tmp_path, monkeypatch) -> None:
    """Node ids change with a new cluster: a pending upload restored from the state goes to
    the live node with the recorded address, and one whose node is gone fails, saying so."""
    import asyncio

    from profd.actors.finisher import Finisher
    from profd.actors.runner import NodeAddress
    from profd.actors.sessions import UploadRecord

    monkeypatch.setattr("profd.actors.finisher.ray_node", lambda: ("head", "10.0.0.1"))

    class Runner:
        async def nodes(self) -> list[NodeAddress]:
            return [NodeAddress("head", "10.0.0.1", "h"), NodeAddress("b-new", "10.0.0.2", "b")]

        async def run(self, node_id, fn, *args):
            raise AssertionError("not called here")

    fin = Finisher(Runner(), lambda s: None, str(tmp_path))
    moved = UploadRecord("/x.json.gz", 10, node_id="b-old", node_ip="10.0.0.2", hostname="b")
    assert asyncio.run(fin._node_of(moved)) == "b-new"
    gone = dataclasses.replace(moved, node_ip="10.9.9.9", hostname="gone")
    with pytest.raises(FileNotFoundError, match="not in this Ray cluster"):
        asyncio.run(fin._node_of(gone))
    here = dataclasses.replace(moved, node_id="old-head", node_ip="10.0.0.1")
    assert asyncio.run(fin._node_of(here)) == "head"
