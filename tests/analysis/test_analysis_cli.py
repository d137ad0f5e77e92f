"""``profd merge`` and ``profd summarize`` on traces recorded by real agents: a directory
offline, a session id through a real sidecar, and bad input that names the option."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from profd.agent import ProfilerAgent
from profd.analysis.models import SessionSummary
from profd.cli.main import app

from helpers import wait_until

MODEL = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
PROFD = [sys.executable, "-m", "profd.cli.main"]


def step(agent: ProfilerAgent, n: int) -> None:
    with agent.step(n):
        with agent.stage("compute_log_prob"), torch.no_grad():
            for _ in range(10):
                MODEL(torch.randn(4, 8))
        with agent.stage("update", role=agent.info.role, update_loop=True):
            for i in range(2):
                with agent.mini_batch(i):
                    MODEL(torch.randn(4, 8)).sum().backward()


@pytest.fixture
def session(local_coordinator) -> Iterator[tuple[Any, Any]]:
    """Two actor ranks and a critic, one profiled step; yields (session view, coordinator)."""
    owner = local_coordinator
    agents = [ProfilerAgent("actor", r, 2, {"dp": r}, find_link=owner.link).start() for r in (0, 1)]
    agents.append(ProfilerAgent("critic", 0, 1, find_link=owner.link).start())
    wait_until(lambda: all(a.connected for a in agents), 10, what="registration")
    for a in agents:
        step(a, 0)
    roles = {"actor": {"all_ranks": True}, "critic": {"all_ranks": True}}
    view = owner.call("create_session", {"steps": [1], "roles": roles})
    wait_until(lambda: all(a.plan.windows for a in agents), 10, what="plans")
    for n in (1, 2):
        for a in agents:
            step(a, n)
    for a in agents:
        a.close()
    view = wait_until(
        lambda: (v := owner.call("get_session", view.session_id)).state.is_terminal and v, 20
    )
    assert view.state.value == "done" and len(view.traces) == 3
    yield view, owner


def run(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def test_summarize_prints_tables_json_and_html(session, tmp_path: Path) -> None:
    view, _ = session
    r = run("summarize", view.save_dir)
    assert r.exit_code == 0, r.output
    for text in (
        "Stage wall time over 1 step(s)",
        "compute_log_prob",
        "actor_update",
        "critic_update",
        "Idle time",
        "Mini-batches",
        "Top operators",
    ):
        assert text in r.stdout, text
    assert max(len(line) for line in r.stdout.splitlines()) <= 80
    r = run("summarize", view.save_dir, "--per-step")
    assert r.exit_code == 0, r.output
    for text in (
        "Stages across ranks",
        "actor rank 0 (dp0)",
        "actor rank 1 (dp1)",
        "critic rank 0",
        "Mini-batches over tracks",
        "Top operators",
    ):
        assert text in r.stdout, text
    r = run("summarize", view.save_dir, "--json", "--html", str(tmp_path / "r.html"))
    assert r.exit_code == 0, r.output
    s = SessionSummary.model_validate(json.loads(r.stdout))
    assert [t.track.split(" @")[0] for t in s.tracks] == [
        "actor rank 0 (dp0)",
        "actor rank 1 (dp1)",
        "critic rank 0",
    ]
    assert {(x.stage, x.ranks) for x in s.stage_stats} == {
        ("compute_log_prob", 2),
        ("actor_update", 2),
        ("compute_log_prob", 1),
        ("critic_update", 1),
    }
    html = (tmp_path / "r.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and html.count("<svg") == 1 + len(s.stages)


def test_merge_writes_a_trace_within_budget_and_says_what_it_dropped(session, tmp_path) -> None:
    view, _ = session
    out = tmp_path / "m.json.gz"
    r = run("merge", view.save_dir, "-o", str(out))
    assert r.exit_code == 0, r.output
    assert "Merged 3 tracks" in r.stdout and "critic rank 0" in r.stdout
    full = len(gzip.decompress(out.read_bytes()))
    budget = full / 2 / (1024 * 1024)
    r = run("merge", view.save_dir, "-o", str(out), "--max-mb", f"{budget:.4f}", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["dropped"]["budget"]["cpu_op"] > 0 and "shortest" in report["budget_note"]
    assert len(gzip.decompress(out.read_bytes())) <= budget * 1024 * 1024
    r = run("merge", view.save_dir, "-o", str(out), "--max-mb", f"{budget:.4f}")
    assert "dropped by budget" in r.stdout and "budget: dropped the" in r.stdout


def test_bad_input_exits_2_naming_the_option(session, tmp_path: Path) -> None:
    view, _ = session
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (("merge", view.save_dir, "--max-mb", "-1"), "--max-mb"),
        (("merge", view.save_dir, "--ranks", "a,b"), "--ranks"),
        (("merge", view.save_dir, "--start", "5", "--end", "1"), "--end"),
        (("merge", view.save_dir, "--stages", "nope", "-o", str(tmp_path / "x.json.gz")), "stages"),
        (("merge", view.save_dir, "-o", str(tmp_path / "x.txt")), "output"),
        (("summarize", str(tmp_path / "no" / "such")), "no such directory"),
        (("summarize", str(empty)), "path: no trace files"),
        (("summarize", view.save_dir, "--late-k", "0"), "--late-k"),
    ]
    for args, named in cases:
        r = run(*args)
        assert r.exit_code == 2, (args, r.output)
        assert named in r.output, (args, r.output)
        assert "Traceback" not in r.output


def test_session_id_resolves_through_the_sidecar(session, make_sidecar, tmp_path: Path) -> None:
    view, _ = session
    env = dict(os.environ, HOME=str(tmp_path), PROFD_STATE_DIR=str(tmp_path / "state"))
    with make_sidecar() as server:
        r = subprocess.run(
            [*PROFD, "summarize", view.session_id, "--url", server.url, "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        s = json.loads(r.stdout)
        assert s["source"] == view.save_dir and s["session_ids"] == [view.session_id]
        r = run("summarize", "no-such-session", "--url", server.url)
        assert r.exit_code == 2 and "neither a directory nor a known session id" in r.output
    r = run("summarize", "some-session", "--url", "http://127.0.0.1:9")
    assert r.exit_code == 3 and "cannot reach the profd sidecar" in r.output


def test_traces_held_elsewhere_are_fetched_never_left_out(
    session, make_sidecar, tmp_path, monkeypatch
) -> None:
    """A session id whose traces are partly on other nodes (no shared filesystem): those are
    downloaded through the sidecar, the local ones linked, and every rank is in the result."""
    from profd.cli import analysis

    view, _ = session
    elsewhere = {t.path for t in view.traces if t.rank == 1}
    monkeypatch.setattr(analysis, "_here", lambda t: t["path"] not in elsewhere)
    monkeypatch.setenv("PROFD_STATE_DIR", str(tmp_path / "state"))
    with make_sidecar() as srv:
        r = run("summarize", view.session_id, "--url", srv.url, "--json")
        assert r.exit_code == 0, r.output
        again = run("merge", view.session_id, "--url", srv.url, "-o", str(tmp_path / "m.json"))
        assert again.exit_code == 0, again.output
    fetched = tmp_path / "state" / "downloads" / view.session_id
    s = json.loads(r.stdout[r.stdout.index("{") :])
    assert s["source"] == str(fetched)
    assert sorted((t["role"], t["rank"]) for t in s["tracks"]) == [
        ("actor", 0),
        ("actor", 1),
        ("critic", 0),
    ]
    for t in view.traces:
        copy = fetched / t.file_name
        assert copy.read_bytes() == Path(t.path).read_bytes()
        assert copy.is_symlink() is (t.path not in elsewhere)  # downloaded only if elsewhere
    assert "fetched 1 trace(s)" in r.output
