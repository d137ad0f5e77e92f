"""``profd summarize`` for people, through the real CLI on traces recorded by real agents:
the default output is folded over steps (its length does not grow with them) and fits 80
columns, shortening long names with a legend; ``--per-step`` and ``--wide`` show it all."""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from profd.agent import ProfilerAgent
from profd.cli.main import app

from helpers import coordinator_settings, wait_until

MODEL = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
LONG = "compute_reference_policy_log_probabilities"  # longer than a stage column
ROLE = "actor_rollout_ref"
STEPS = 6


def step(agent: ProfilerAgent, n: int) -> None:
    with agent.step(n):
        with agent.stage(LONG), torch.no_grad():
            for _ in range(3):
                MODEL(torch.randn(4, 8))
        with agent.stage("update", role=agent.info.role, update_loop=True):
            for i in range(2):
                with agent.mini_batch(i):
                    MODEL(torch.randn(4, 8)).sum().backward()


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> Iterator[dict[int, Path]]:
    """One recording of STEPS profiled steps (two actor ranks and a critic, one trace per
    rank and step); {steps: directory} for it and for its first two steps only."""
    from profd.actors.coordinator import ProfileCoordinator
    from profd.testing.coordinator import InProcessCoordinator

    tmp = tmp_path_factory.mktemp("summarize-output")
    owner = InProcessCoordinator(ProfileCoordinator(coordinator_settings(tmp)))
    try:
        agents = [ProfilerAgent(ROLE, r, 2, {"dp": r}, find_link=owner.link) for r in (0, 1)]
        agents.append(ProfilerAgent("critic", 0, 1, find_link=owner.link))
        for a in agents:
            a.start()
        wait_until(lambda: all(a.connected for a in agents), 10, what="registration")
        roles = {"actor": {"all_ranks": True}, "critic": {"all_ranks": True}}
        request = {"steps": list(range(1, STEPS + 1)), "roles": roles}
        view = owner.call("create_session", request)
        wait_until(lambda: all(a.plan.windows for a in agents), 10, what="plans")
        for n in range(1, STEPS + 2):
            for a in agents:
                step(a, n)
        for a in agents:
            a.close()
        view = wait_until(
            lambda: (v := owner.call("get_session", view.session_id)).state.is_terminal and v, 30
        )
    finally:
        owner.close()
    assert view.state.value == "done" and len(view.traces) == 3 * STEPS, view
    two = tmp / "two-steps"
    two.mkdir()
    for t in view.traces:
        if re.search(r"_step[12]_", t.file_name):
            (two / t.file_name).symlink_to(t.path)
    assert len(list(two.iterdir())) == 3 * 2
    yield {STEPS: Path(view.save_dir), 2: two}


def run(*args: str, **env: str) -> str:
    r = CliRunner().invoke(app, ["summarize", *args], env=env or None)
    assert r.exit_code == 0, r.output
    return r.stdout


def _no_stragglers(out: str) -> list[str]:
    """The lines of ``out`` but its straggler section (and the first line, which wraps where
    the directory's name is long)."""
    lines = out.splitlines()[2:]
    top = next(i for i, x in enumerate(lines) if x.startswith(("Stragglers:", "No straggler.")))
    end = next((i for i in range(top, len(lines)) if not lines[i].strip()), len(lines))
    return lines[:top] + lines[end + 1 :]


def stage_rows(out: str) -> list[list[str]]:
    """Cells of the rows of the default stage table (between its rule and the note)."""
    lines = out.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("Stage wall time"))
    rule = next(i for i in range(top, len(lines)) if set(lines[i].strip()) == {"─"})
    end = next(i for i in range(rule, len(lines)) if lines[i].startswith("slowest:"))
    return [re.split(r"\s{2,}", line.strip()) for line in lines[rule + 1 : end]]


def legend(out: str) -> dict[str, str]:
    lines = out.splitlines()
    start = lines.index("Names shortened to fit (--wide prints them whole):")
    pairs = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        short, full = re.split(r"\s{2,}", line.strip())
        pairs[short] = full
    return pairs


def test_default_output_is_one_row_per_stage_and_role_and_does_not_grow(sessions) -> None:
    six, two = run(str(sessions[STEPS])), run(str(sessions[2]))
    assert "steps 1-6 (6)" in six and "steps 1-2 (2)" in two
    # (a loaded machine may make a rank late in some step: its row is content, not growth)
    assert len(_no_stragglers(six)) == len(_no_stragglers(two))
    for out in (six, two):
        rows = stage_rows(out)
        # stages x roles that ran them: the long stage on both roles, one update each
        assert len(rows) == 4, out
        assert all(len(r) == 7 for r in rows), rows
    assert "Stages across ranks" not in six  # the per-step table is not printed


def test_every_line_fits_80_columns_even_when_columns_says_otherwise(sessions) -> None:
    for out in (run(str(sessions[STEPS])), run(str(sessions[STEPS]), COLUMNS="200")):
        too_long = [line for line in out.splitlines() if len(line) > 80]
        assert not too_long, "\n".join(too_long)


def test_the_legend_maps_short_names_to_full_names(sessions) -> None:
    out = run(str(sessions[STEPS]))
    pairs = legend(out)
    assert set(pairs.values()) == {LONG, f"{ROLE}_update"}, pairs
    for short, full in pairs.items():
        assert "…" in short and len(short) <= 18
        assert full.startswith(short.split("…")[0]) and full.endswith(short.split("…")[1])
    shown = {r[0] for r in stage_rows(out)}
    assert shown == {*pairs, "critic_update"}
    assert LONG not in out.replace(f"  {LONG}", "")  # the full name only in the legend


def test_numbers_are_the_fold_of_the_json(sessions) -> None:
    from profd.analysis.aggregate import percentile

    out = run(str(sessions[STEPS]))
    s = json.loads(run(str(sessions[STEPS]), "--json"))
    rows = {(r[0], r[1]): r for r in stage_rows(out)}
    short = {full: key for key, full in legend(out).items()}
    times = [t for t in s["stage_times"] if t["stage"] == LONG and t["role"] == ROLE]
    assert len(times) == 2 * STEPS
    walls = [t["wall_ms"] for t in times]
    worst = max(times, key=lambda t: t["wall_ms"])
    row = rows[(short[LONG], ROLE)]
    assert row[2:6] == [
        "2",
        f"{statistics.median(walls):,.1f}",
        f"{percentile(walls, 0.9):,.1f}",
        f"{worst['wall_ms']:,.1f}",
    ]
    assert row[6].startswith(f"r{worst['rank']} ") and row[6].endswith(f"/{STEPS}")


def test_per_step_prints_every_step(sessions) -> None:
    out = run(str(sessions[STEPS]), "--per-step")
    assert "Stages across ranks" in out and "Wall time per step x stage x track" in out
    first_cells = {line.split("│")[1].strip() for line in out.splitlines() if "│" in line}
    assert {str(n) for n in range(1, STEPS + 1)} <= first_cells
    assert len(out.splitlines()) > len(run(str(sessions[2]), "--per-step").splitlines())


def test_wide_prints_full_names(sessions) -> None:
    out = run(str(sessions[STEPS]), "--wide")
    rows = stage_rows(out)
    assert {r[0] for r in rows} == {LONG, f"{ROLE}_update", "critic_update"}
    assert "…" not in out and "Names shortened" not in out
    assert max(len(line) for line in out.splitlines()) > 80


def test_a_terminal_sets_the_width(monkeypatch: Any) -> None:
    import os
    import shutil

    from profd.cli import summary_view

    class Tty:
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(summary_view.sys, "stdout", Tty())
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *_: os.terminal_size((132, 40)))
    assert summary_view._columns(wide=False) == 132
    assert summary_view._columns(wide=True) > 10_000
