"""What an operator sees: `profd cancel`, `profd profile --duration`, the live progress of
`profd profile --wait`, `profd traces` grouped by session, one unit system for sizes, and
`profd status` after `profd down`. The CLI runs as a real process against a real uvicorn
sidecar around an in-process coordinator with real agents."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import torch

from profd.cli.client import (
    LAST_FILE,
    ApiClient,
    CliError,
    format_bytes,
    load_last,
    record_last,
)
from profd.cli.session_view import bar_text, progress_of
from profd.cli.traces_view import by_session, save_root_of, shown_path

from helpers import AUTH, TOKEN, free_port, start_agents, wait_armed, wait_terminal, wait_until

PROFD = [sys.executable, "-m", "profd.cli.main"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def env_for(tmp_path: Path, token: str | None = TOKEN, columns: int = 80) -> dict[str, str]:
    state = tmp_path / "state-cli"
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    if token is not None:
        (state / "token").write_text(token + "\n")
    env = dict(
        os.environ,
        HOME=str(tmp_path),
        PROFD_STATE_DIR=str(state),
        COLUMNS=str(columns),
        PROFD_PORT=str(free_port()),  # the default URL: nothing answers there
    )
    for name in ("TTY_COMPATIBLE", "TTY_INTERACTIVE", "FORCE_COLOR"):
        env.pop(name, None)
    return env


def cli(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*PROFD, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=env["HOME"]
    )


def flat(text: str) -> str:
    return " ".join(text.split())


def nospace(text: str) -> str:
    return "".join(text.split())


def table_rows(text: str) -> list[list[str]]:
    """The rows of the tables in ``text``, each cell whole again (a folded cell continues on
    lines whose first cell is empty)."""
    rows: list[list[str]] = []
    for line in text.splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if cells[0] or not rows:
            rows.append(cells)
        else:
            rows[-1] = [a + b for a, b in zip(rows[-1], cells, strict=True)]
    return rows


def create(url: str, body: dict[str, Any]) -> str:
    r = httpx.post(f"{url}/api/v1/sessions", json=body, headers=AUTH)
    assert r.status_code == 201, r.text
    return r.json()["session_id"]


def run_steps(agents: list[Any], steps: range) -> None:
    for n in steps:
        for a in agents:
            with a.step(n), a.stage("work"):
                torch.ones(4) @ torch.ones(4)


def progress(url: str, sid: str) -> dict[str, Any]:
    return httpx.get(f"{url}/api/v1/sessions/{sid}", headers=AUTH).json()["progress"]


# -- pure helpers ---------------------------------------------------------------------------
def test_a_cancel_waits_for_each_writer_until_its_trace_or_its_end() -> None:
    """`profd cancel` waits for a target that was writing until it wrote one more trace or
    said it is done (a window with nothing to flush), never for the rest of its timeout."""
    from profd.cli.session_view import settle_cancelled

    def target(aid: str, traces: int, done: bool) -> dict[str, Any]:
        return {"agent_id": aid, "traces": ["t"] * traces, "agent_done": done,
                "state": "cancelled", "role": "actor", "rank": 0}  # fmt: skip

    class Api:
        def __init__(self, views: list[dict[str, Any]]) -> None:
            self.views = views

        def get(self, path: str) -> dict[str, Any]:
            return self.views.pop(0)

    first = {"session_id": "s", "targets": [target("a", 0, False), target("b", 1, False)]}
    then = {"session_id": "s", "targets": [target("a", 0, False), target("b", 2, False)]}
    last = {"session_id": "s", "targets": [target("a", 0, True), target("b", 2, False)]}
    view, left = settle_cancelled(Api([then, last]), first, {"a": 0, "b": 1}, 30, quiet=True)
    assert view is last and left == []
    view, left = settle_cancelled(Api([then] * 3), first, {"a": 0, "b": 1}, 1.0, quiet=True)
    assert left == ["a"]  # still writing when the wait ended


def test_sizes_are_decimal_units_everywhere() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(999) == "999 B"
    assert format_bytes(1000) == "1.0 kB"
    assert format_bytes(1536) == "1.5 kB"
    assert format_bytes(999_949) == "999.9 kB"
    assert format_bytes(999_999) == "1.0 MB"  # never "1000.0 kB"
    assert format_bytes(12_345_678) == "12.3 MB"
    assert format_bytes(3 * 10**9) == "3.0 GB"
    assert format_bytes(5 * 10**15) == "5.0 PB"


def test_bar_is_full_only_when_everything_planned_was_recorded() -> None:
    assert bar_text(4, 4) == "█" * 20
    assert bar_text(0, 4) == "░" * 20
    assert bar_text(2, 4) == "█" * 10 + "░" * 10
    assert bar_text(99, 100).count("░") == 1  # short by one: still visibly short
    assert bar_text(0, 0) == "░" * 20


def _view(progress: dict[str, Any] | None, targets: list[str] = ()) -> dict[str, Any]:
    return {"progress": progress, "targets": [{"state": s} for s in targets]}


def test_progress_counts_steps_then_targets_then_falls_back() -> None:
    steps = dict(planned_steps=4, recorded_steps=1, missed_steps=1, targets=2, targets_finished=0)
    assert progress_of(_view({**steps, "fraction": 0.25})) == (
        1,
        4,
        "1/4 steps recorded, 1 missed",
    )
    timed = dict(planned_steps=0, recorded_steps=0, missed_steps=0, targets=3, targets_finished=3)
    assert progress_of(_view({**timed, "fraction": 0.6667})) == (
        2,
        3,
        "2/3 targets wrote traces",
    )
    # a sidecar that does not report progress: targets finished, as before
    assert progress_of(_view(None, ["done", "recording"])) == (1, 2, "1/2 targets finished")


def test_a_fleet_wide_session_prints_its_targets_grouped_with_rank_ranges(
    tmp_path: Path,
) -> None:
    """`profd profile --all-ranks` on a big job: a line per group, not one per rank."""
    import asyncio

    from profd.actors.coordinator import ProfileCoordinator
    from profd.actors.runner import LocalRunner
    from profd.actors.store import MemoryStore
    from profd.cli import common, session_view
    from profd.core.protocol import AgentInfo
    from profd.core.settings import CoordinatorSettings

    async def fleet_view(ranks: list[int]) -> dict[str, Any]:
        settings = CoordinatorSettings(
            save_root=str(tmp_path / "profile"), base_dir=str(tmp_path), tick_s=3600.0
        )
        coord = ProfileCoordinator(settings, store=MemoryStore(), runner=LocalRunner())
        for r in ranks:  # world 41: rank 17 never came
            caps = {"torch": None}
            info = AgentInfo(f"a{r}", "actor", r, 41, {}, "h", 100 + r, capabilities=caps)
            await coord.register(info, 1)
        request = {"steps": [5], "roles": {"actor": {"all_ranks": True}}}
        view = await coord.create_session(request)
        return view.model_dump(mode="json")

    def printed(view: dict[str, Any]) -> str:
        with common.console.capture() as out:
            session_view.print_session(view)
        return out.get()

    view = asyncio.run(fleet_view([r for r in range(41) if r != 17]))
    text = printed(view)
    assert len(view["targets"]) == 40
    rows = [ln for ln in text.splitlines() if "actor" in ln]
    assert len(rows) == 1 and "0-16,18-40" in rows[0] and " 40 " in rows[0], text
    assert "40 targets, grouped (--json lists each one)" in text
    # a target in another state is a group of its own
    view["targets"][3] = {**view["targets"][3], "state": "failed", "reason": "agent lost"}
    rows = [ln for ln in printed(view).splitlines() if "actor" in ln]
    assert len(rows) == 2 and any("3 " in ln and "failed" in ln for ln in rows), rows
    assert session_view.rank_ranges([8, 0, 1, 2, 5, 2]) == "0-2,5,8"
    # a small session keeps a row per target
    view["targets"] = view["targets"][: session_view.MAX_TARGET_ROWS]
    rows = [ln for ln in printed(view).splitlines() if "actor" in ln]
    assert len(rows) == session_view.MAX_TARGET_ROWS
    # its warnings (one per rank's empty py-spy profile, say): the first few, then a count
    view["warnings"] = [f"actor rank {r} x.speedscope.json: no samples" for r in range(7)]
    lines = [ln for ln in printed(view).splitlines() if "warning" in ln]
    assert len(lines) == session_view.MAX_WARNINGS_SHOWN + 1
    assert "no samples" in lines[0] and "2 more warning(s)" in lines[-1]


def test_trace_paths_are_shown_under_their_save_root() -> None:
    t = {
        "session_id": "20240405-abc",
        "trace_id": "t1",
        "created_at": 1.0,
        "path": "/data/profile/20240405-abc/rollout-engine-replica0/x.json.gz",
    }
    assert save_root_of(t) == "/data/profile"
    assert shown_path(t) == "20240405-abc/rollout-engine-replica0/x.json.gz"
    elsewhere = {**t, "path": "/somewhere/x.json.gz"}
    assert save_root_of(elsewhere) is None and shown_path(elsewhere) == "/somewhere/x.json.gz"
    a2 = {**t, "trace_id": "t2", "created_at": 3.0}
    b1 = {**t, "session_id": "b", "trace_id": "b1", "created_at": 2.0}
    groups = by_session([t, b1, a2])
    assert [(sid, [x["trace_id"] for x in g]) for sid, g in groups] == [
        ("20240405-abc", ["t2", "t1"]),
        ("b", ["b1"]),
    ]


# -- profd cancel ---------------------------------------------------------------------------
def test_cancel_prints_the_final_state_and_refuses_unknown_or_ended(
    sidecar: Any, local_coordinator: Any, tmp_path: Path
) -> None:
    url = sidecar.url
    env = env_for(tmp_path)
    (agent,) = start_agents(local_coordinator, 1, "actor")
    try:
        sid = create(url, {"steps": [1000]})
        wait_armed(agent, sid)

        r = cli(["cancel", sid, "--url", url], env_for(tmp_path / "no-token", token=None))
        assert r.returncode == 1 and "HTTP 401" in r.stderr, r.stderr  # a change: the token

        r = cli(["cancel", sid, "--url", url, "--reason", "operator stop"], env)
        assert r.returncode == 0, r.stderr
        line = r.stdout.splitlines()[0]
        assert line.startswith(f"session {sid} CANCELLED "), r.stdout
        assert "0/1 steps recorded" in line and "█" not in line  # nothing was recorded
        view = httpx.get(f"{url}/api/v1/sessions/{sid}", headers=AUTH).json()
        assert view["state"] == "cancelled"
        assert view["reason"] == "operator stop", view["reason"]  # kept as the session's reason
        assert all(len(x) <= 80 for x in r.stdout.splitlines()), r.stdout

        again = cli(["cancel", sid, "--url", url], env)
        assert again.returncode == 1, again.stdout
        assert "HTTP 409" in again.stderr and "already cancelled" in flat(again.stderr)

        unknown = cli(["cancel", "20990101-nope", "--url", url], env)
        assert unknown.returncode == 1 and "HTTP 404" in unknown.stderr, unknown.stderr

        other = create(url, {"steps": [2000]})
        r = cli(["cancel", other, "--url", url, "--json"], env)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["session_id"] == other and out["state"] == "cancelled"
    finally:
        agent.close(timeout=10)


def test_cancel_waits_for_the_trace_its_flush_writes(
    sidecar: Any, local_coordinator: Any, tmp_path: Path
) -> None:
    """A window open when the session is cancelled is written (at the job's next step mark):
    `profd cancel` waits for that trace, so what it prints is what the session holds."""
    url = sidecar.url
    env = env_for(tmp_path)
    (agent,) = start_agents(local_coordinator, 1, "actor")
    stop = threading.Event()

    def job() -> None:  # steps of about 1 s: the flush comes up to a second after the cancel
        n = 1
        while not stop.is_set():
            with agent.step(n), agent.stage("work"):
                torch.ones(4) @ torch.ones(4)
                stop.wait(1.0)
            n += 1

    loop = threading.Thread(target=job, daemon=True)
    loop.start()
    try:
        sid = create(url, {"next_steps": 30, "profile_continuous_steps": True})

        def part_state() -> str:
            view = httpx.get(f"{url}/api/v1/sessions/{sid}", headers=AUTH).json()
            return view["targets"][0]["state"]

        wait_until(lambda: part_state() == "recording", 30, 0.1, what="recording")
        r = cli(["cancel", sid, "--url", url], env)
        assert r.returncode == 0, r.stderr
        assert "1 trace(s) in" in r.stdout, r.stdout  # the flushed window's, waited for
        assert "that were recording" in r.stderr, r.stderr  # it said what it waits for
        view = httpx.get(f"{url}/api/v1/sessions/{sid}", headers=AUTH).json()
        assert view["state"] == "cancelled" and len(view["traces"]) == 1, view["traces"]
        assert view["targets"][0]["recorded_steps"], view["targets"][0]
        # not waiting: it names who still writes and a command that lists their traces
        sid = create(url, {"next_steps": 30, "profile_continuous_steps": True})
        wait_until(lambda: part_state() == "recording", 30, 0.1, what="recording")
        r = cli(["cancel", sid, "--url", url, "--wait-s", "0"], env)
        hint = flat(r.stdout)
        assert r.returncode == 0 and "still writing their last trace after 0 s: actor rank 0" \
            in hint, r.stdout  # fmt: skip
        command = re.search(r"`(profd traces [^`]+)`", hint).group(1).split()
        listed = cli([*command[1:], "--url", url], env)
        assert listed.returncode == 0, listed.stderr
    finally:
        stop.set()
        loop.join(10)
        agent.close(timeout=10)


# -- profd profile --duration ---------------------------------------------------------------
def test_duration_is_exclusive_with_steps_and_maps_to_duration_s(
    sidecar: Any, local_coordinator: Any, tmp_path: Path
) -> None:
    env = env_for(tmp_path)
    url = sidecar.url
    for args, named in (
        (["--duration", "2", "--steps", "5"], "--steps and --duration"),
        (["--duration", "2", "--next-steps", "1"], "--next-steps and --duration"),
        (["--steps", "5", "--next-steps", "1"], "--steps and --next-steps"),
    ):
        r = cli(["profile", "--url", url, *args], env)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        text = flat(r.stderr.replace("│", " "))
        assert "give one of --steps, --next-steps or --duration" in text, text
        assert named in text, text
    r = cli(["profile", "--url", url, "--duration", "0"], env)
    assert r.returncode == 2 and "more than 0" in flat(r.stderr.replace("│", " ")), r.stderr
    r = cli(["profile", "--url", url], env)
    assert r.returncode == 2 and "--duration" in r.stderr, r.stderr
    r = cli(["profile", "--url", url, "--next-steps", "0"], env)  # refused by the sidecar
    assert r.returncode == 2 and "HTTP 422" in r.stderr and "next_steps" in r.stderr, r.stderr

    (agent,) = start_agents(local_coordinator, 1, "actor")
    try:
        r = cli(["profile", "--url", url, "--duration", "1.5", "--json"], env)
        assert r.returncode == 0, r.stderr
        view = json.loads(r.stdout)
        assert view["request"]["duration_s"] == 1.5
        assert view["request"].get("steps") is None and view["request"].get("next_steps") is None
        httpx.post(f"{url}/api/v1/sessions/{view['session_id']}/cancel", headers=AUTH)
    finally:
        agent.close(timeout=10)


def test_duration_replaces_the_window_of_a_config(tmp_path: Path) -> None:
    from profd.cli.requests import build_request

    config = tmp_path / "req.yaml"
    config.write_text("steps: [5, 6]\nroles: {actor: {all_ranks: true}}\n")
    body = build_request(
        config, None, None, None, [], None, False, False, None, False, duration=30.0
    )
    assert body["duration_s"] == 30.0 and "steps" not in body
    body = build_request(config, None, None, 2, [], None, False, False, None, False)
    assert body["next_steps"] == 2 and "steps" not in body and "duration_s" not in body


def test_sessions_show_steps_as_runs_and_timed_windows_by_their_length() -> None:
    """`profd sessions` at 80 columns: thirty steps printed one number a line, the state
    wrapped ("parti|al"); steps are runs now and the state is whole."""
    from profd.cli.main import _steps_shown

    assert _steps_shown({"steps": [*range(82, 112), 120]}) == "82-111,120"
    assert _steps_shown({"steps": [], "request": {"duration_s": 2.5}}) == "for 2.5 s"
    assert _steps_shown({"steps": None, "request": {}}) == "-"
    from profd.cli.main import _window_shown  # a line of `profd sessions` in 80 columns

    assert _window_shown({"steps": [3, 4]}) == "steps 3-4"
    assert _window_shown({"steps": [], "request": {"duration_s": 2.5}}) == "for 2.5 s"


def test_a_config_that_cannot_be_read_is_a_usage_error_not_a_traceback(tmp_path: Path) -> None:
    env = dict(os.environ, HOME=str(tmp_path), PROFD_STATE_DIR=str(tmp_path / "s"), COLUMNS="400")
    for path, said in [(tmp_path / "nope.yaml", "No such file"), (tmp_path, "Is a directory")]:
        r = cli(["profile", "--config", str(path), "--next-steps", "1"], env)
        err = " ".join(r.stderr.split())
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"cannot read {path}: {said}" in err and "--config" in err, r.stderr


# -- profd profile --wait -------------------------------------------------------------------
def test_wait_shows_steps_recorded_live_and_a_short_end_differently(
    sidecar: Any, local_coordinator: Any, tmp_path: Path
) -> None:
    url = sidecar.url
    env = env_for(tmp_path, columns=120)
    env.update(TTY_COMPATIBLE="1", TTY_INTERACTIVE="1")  # the bar as a terminal shows it
    agents = start_agents(local_coordinator, 2, "actor")
    err_path = tmp_path / "wait.err"
    try:
        with open(err_path, "w") as err:
            proc = subprocess.Popen(
                [*PROFD, "profile", "--url", url, "--steps", "1,2", "--all-ranks", "--wait"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                cwd=tmp_path,
            )
        try:
            wait_until(lambda: all(a.plan.windows for a in agents), 30, what="plans")
            (sid,) = {w.session_id for a in agents for w in a.plan.windows}
            run_steps(agents, range(1, 2))  # step 1 on both ranks: 2 of 4
            wait_until(lambda: progress(url, sid)["recorded_steps"] == 2, 20, what="2 recorded")
            wait_until(
                lambda: "2/4 steps recorded" in ANSI.sub("", err_path.read_text()),
                30,
                what="the live bar at 2/4",
            )
            httpx.post(f"{url}/api/v1/sessions/{sid}/cancel", headers=AUTH)
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        for a in agents:
            a.close(timeout=10)
    live = ANSI.sub("", err_path.read_text())
    assert "0/4 steps recorded" in live  # it started empty and moved while the session ran
    assert proc.returncode == 1, out  # not `done`
    last = ANSI.sub("", out).strip().splitlines()
    outcome = [x for x in last if x.startswith(f"session {sid} ")][-1]
    assert "CANCELLED" in outcome and "2/4 steps recorded" in outcome, out
    assert "█" * 10 + "░" * 10 in outcome  # half full: the bar shows it ended short
    assert "\x1b[" in out and "33m" in out  # in colour: yellow, not done's green


def test_wait_done_fills_the_bar_and_json_stays_machine_readable(
    sidecar: Any, local_coordinator: Any, tmp_path: Path
) -> None:
    url = sidecar.url
    agents = start_agents(local_coordinator, 2, "actor")
    try:
        for first, as_json in ((1, False), (10, True)):  # the second after the first's steps
            steps = f"{first},{first + 1}"
            args = ["profile", "--url", url, "--steps", steps, "--all-ranks", "--wait"]
            proc = subprocess.Popen(
                [*PROFD, *args, *(["--json"] if as_json else [])],
                env=env_for(tmp_path),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=tmp_path,
            )
            try:
                wait_until(lambda: all(a.plan.windows for a in agents), 30, what="plans")
                (sid,) = {w.session_id for a in agents for w in a.plan.windows}
                run_steps(agents, range(first, first + 3))
                wait_terminal(local_coordinator, sid)
                out, err = proc.communicate(timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            assert proc.returncode == 0, err
            if as_json:
                view = json.loads(out)
                assert view["state"] == "done" and view["progress"]["fraction"] == 1.0
                assert view["progress"]["recorded_steps"] == 4
            else:
                outcome = [x for x in out.splitlines() if x.startswith(f"session {sid} ")][-1]
                assert "DONE" in outcome and "█" * 20 in outcome, out
                assert "4/4 steps recorded" in outcome
                assert all(len(x) <= 80 for x in out.splitlines()), out
            for a in agents:  # the next session starts from a clean plan
                wait_until(lambda a=a: not a.plan.windows, 20, what="plan cleared")
    finally:
        for a in agents:
            a.close(timeout=10)


def test_wait_rides_out_a_sidecar_restart_and_names_its_session_first(
    local_coordinator: Any, tmp_path: Path
) -> None:
    """The sidecar goes away in the middle of `profd profile --wait` (a crash, then `profd
    up`): the wait goes on and ends with the session's outcome, and the session's name was
    printed before the transient bar, so a user can come back to it."""
    from helpers import start_sidecar

    first = start_sidecar(local_coordinator)
    url = first.url
    agents = start_agents(local_coordinator, 2, "actor")
    err_path = tmp_path / "wait.err"
    proc = None
    try:
        with open(err_path, "w") as err:
            proc = subprocess.Popen(
                [*PROFD, "profile", "--url", url, "--steps", "1,2", "--all-ranks", "--wait"],
                env=env_for(tmp_path),
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                cwd=tmp_path,
            )
        wait_until(lambda: all(a.plan.windows for a in agents), 30, what="plans")
        (sid,) = {w.session_id for a in agents for w in a.plan.windows}
        named = f"session {sid}: 2 target(s); waiting for its end"
        wait_until(lambda: named in err_path.read_text(), 30, what="the session named")
        first.stop()
        told = "cannot reach the profd sidecar"
        wait_until(lambda: told in err_path.read_text(), 30, what="the outage noticed")
        run_steps(agents, range(1, 4))  # the session ends while no sidecar answers
        wait_terminal(local_coordinator, sid)
        assert proc.poll() is None, err_path.read_text()  # still waiting
        with start_sidecar(local_coordinator, port=first.port):
            out, _ = proc.communicate(timeout=60)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        for a in agents:
            a.close(timeout=10)
    err_text = flat(err_path.read_text())
    assert proc.returncode == 0, out + err_text
    assert "profd answers again" in err_text
    outcome = [x for x in out.splitlines() if x.startswith(f"session {sid} ")][-1]
    assert "DONE" in outcome and "4/4 steps recorded" in outcome, out


def test_wait_says_once_when_the_targets_steps_stand_still(local_coordinator: Any) -> None:
    """A session waiting for step 50 of a job stuck at step 3: `--wait` says so once, after
    STALL_WARN_S without a new step (a fake clock; the agents and sidecar are real); a step
    begun meanwhile starts the count again. The session itself goes on waiting."""
    from profd.cli.client import ApiClient
    from profd.cli.session_view import STALL_CHECK_S, STALL_WARN_S, StallWatch

    from helpers import start_sidecar

    agents = start_agents(local_coordinator, 2, "actor")
    run_steps(agents, range(1, 4))
    now = [0.0]
    try:
        with start_sidecar(local_coordinator) as sidecar:
            r = httpx.post(
                f"{sidecar.url}/api/v1/sessions",
                json={"steps": [50], "roles": {"actor": {"all_ranks": True}}},
                headers=AUTH,
            )
            view = r.json()
            watch = StallWatch(ApiClient(sidecar.url), view, clock=lambda: now[0])
            wait_until(
                lambda: (
                    {
                        a["current_step"]
                        for a in ApiClient(sidecar.url).get("/api/v1/agents")["data"]
                    }
                    == {3}
                ),
                10,
                what="step 3 known",
            )
            assert watch.check(view) is None  # the first read: steps at 3
            now[0] += STALL_WARN_S - 1
            assert watch.check(view) is None  # not long enough
            run_steps(agents[:1], range(4, 5))  # rank 0 begins step 4: the count restarts
            wait_until(
                lambda: (
                    4
                    in {
                        a["current_step"]
                        for a in ApiClient(sidecar.url).get("/api/v1/agents")["data"]
                    }
                ),
                10,
                what="step 4 known",
            )
            now[0] += STALL_CHECK_S
            assert watch.check(view) is None
            now[0] += STALL_WARN_S
            hint = watch.check(view)
            assert hint is not None and "no target has begun a new step for" in hint
            assert "at steps 3..4" in hint and "starts at step 50" in hint
            assert f"profd cancel {view['session_id']}" in hint and "profd stacks" in hint
            now[0] += STALL_WARN_S
            assert watch.check(view) is None  # said once
            sid = view["session_id"]
            assert local_coordinator.call("get_session", sid).state.value == "armed"
    finally:
        for a in agents:
            a.close(timeout=10)


def test_the_stall_hint_waits_longer_for_a_job_of_slow_steps() -> None:
    """An RL job whose steps take a minute each: two minutes without a new step is not a
    stall; five of its steps are."""
    from profd.cli.session_view import STALL_STEPS, StallWatch

    class Api:  # the sidecar's answer, as GET /api/v1/agents gives it
        def get(self, path: str) -> dict[str, Any]:
            assert path == "/api/v1/agents"
            return {"data": [{"agent_id": "a", "current_step": 7, "median_step_s": 60.0}]}

    now = [0.0]
    view = {"session_id": "s", "state": "armed", "steps": [9], "targets": [{"agent_id": "a"}]}
    watch = StallWatch(Api(), view, clock=lambda: now[0])  # type: ignore[arg-type]
    assert watch.check(view) is None
    now[0] = 130.0
    assert watch.check(view) is None  # two of its steps
    now[0] = STALL_STEPS * 60.0 + 1
    hint = watch.check(view)
    assert hint is not None and "at step 7" in hint and "starts at step 9" in hint


# -- profd traces / status ------------------------------------------------------------------
def test_traces_grouped_by_session_newest_first_under_the_save_root(
    sidecar: Any, local_coordinator: Any, tmp_path: Path
) -> None:
    url = sidecar.url
    env = env_for(tmp_path)
    agents = start_agents(local_coordinator, 2, "actor")
    try:
        sids = []
        for steps in ([1, 2], [5]):
            sid = create(url, {"steps": steps, "roles": {"actor": {"all_ranks": True}}})
            for a in agents:
                wait_armed(a, sid)
            run_steps(agents, range(steps[0], steps[-1] + 2))
            assert wait_terminal(local_coordinator, sid).state.value == "done"
            sids.append(sid)
    finally:
        for a in agents:
            a.close(timeout=10)
    first, second = sids
    every = httpx.get(f"{url}/api/v1/traces", params={"limit": 100}, headers=AUTH).json()
    traces = every["data"]
    assert len(traces) == 6
    save_root = str(Path(traces[0]["path"]).parent.parent)

    r = cli(["traces", "--url", url], env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert all(len(x) <= 80 for x in lines), r.stdout
    titles = [x.strip() for x in lines if x.strip().startswith("session ")]
    assert titles[0].startswith(f"session {second}: 2 trace(s), ")  # the newest session first
    assert titles[1].startswith(f"session {first}: 4 trace(s), ")
    assert nospace(f"paths under {save_root}/") in nospace(r.stdout)
    rows = table_rows(r.stdout)
    # newest first, grouped (the second session's 2 traces, then the first's 4), each at its
    # path under the save root (not the full path) and its size in the CLI's one unit
    assert [row[-1] for row in rows] == [f"{t['session_id']}/{t['file_name']}" for t in traces]
    assert [row[-2] for row in rows] == [format_bytes(t["bytes"]) for t in traces]
    assert [row[1:4] for row in rows] == [
        ["actor", str(t["rank"]), str(t["steps"][0])] for t in traces
    ]
    assert not re.search(r"\d (KB|KiB|MiB|GiB)\b", r.stdout)
    assert f"6 trace(s), {format_bytes(every['bytes'])}" in flat(r.stdout)

    r = cli(["traces", "--url", url, "--json"], env)
    data = json.loads(r.stdout)
    assert [t["trace_id"] for t in data] == [t["trace_id"] for t in traces]
    assert all(Path(t["path"]).is_absolute() and t["path"].startswith(save_root) for t in data)

    r = cli(["traces", "--url", url, "--limit", "3"], env)  # the paging options as before
    assert r.returncode == 0, r.stderr
    text = flat(r.stdout)
    assert "the newest 3 of 6 traces; 3 more" in text
    assert "2 trace(s) on this page" in text  # a session's count is the page's, said so
    assert "3 of 6 trace(s) shown" in text and f"of {format_bytes(every['bytes'])}" in text
    # one line, however narrow: the command (its cursor token) copies whole
    cursor = re.search(r"--cursor (\S+)` for the next page", r.stdout).group(1)
    r = cli(["traces", "--url", url, "--limit", "3", "--cursor", cursor, "--json"], env)
    assert [t["trace_id"] for t in json.loads(r.stdout)] == [t["trace_id"] for t in traces[3:]]

    r = cli(["traces", "--url", url, "--session", first], env)
    assert f"session {first}: 4 trace(s)" in r.stdout and second not in r.stdout
    r = cli(["sessions", "--url", url], env)  # 80 columns (a pipe's): ids whole, to copy
    assert r.returncode == 0 and first in r.stdout and second in r.stdout, r.stdout
    assert all(len(x) <= 80 for x in r.stdout.splitlines()), r.stdout  # nothing cropped
    assert f"{first}  done  torch  steps 1-2  2 target(s)  4 trace(s)\n" in r.stdout, r.stdout
    wide = cli(["sessions", "--url", url], env_for(tmp_path, columns=200))
    assert " by " in wide.stdout and "request" in wide.stdout  # a request, not a trigger
    r = cli(["traces", "--url", url, "--session", "20990101-000000-nope"], env)
    assert r.returncode == 1 and "HTTP 404" in r.stderr, r.stdout + r.stderr

    # several sessions at once: a folder each (a merge of the folder is one session's)
    r = cli(["traces", "--url", url, "--download", str(tmp_path / "dl")], env)
    assert r.returncode == 0 and "(a folder per session)" in flat(r.stdout), r.stdout + r.stderr
    got = sorted(str(p.relative_to(tmp_path / "dl")) for p in (tmp_path / "dl").rglob("*.gz"))
    assert got == sorted(f"{t['session_id']}/{t['file_name']}" for t in traces)
    r = cli(["traces", "--url", url, "--session", first, "--download", str(tmp_path / "one")], env)
    assert r.returncode == 0 and len(list((tmp_path / "one").glob("*.json.gz"))) == 4

    st = cli(["status", "--url", url], env_for(tmp_path, columns=200))
    assert st.returncode == 0, st.stderr
    assert f"6 traces ({format_bytes(every['bytes'])})" in st.stdout, st.stdout


# -- profd status after profd down ----------------------------------------------------------
def test_status_after_down_names_the_port_that_was_in_use(tmp_path: Path, monkeypatch) -> None:
    from profd.cli import service
    from profd.cli.ray_cluster import ServiceState, save_state

    env = env_for(tmp_path)
    state_dir = Path(env["PROFD_STATE_DIR"])
    port = free_port()  # where "profd up" ran; nothing answers there any more
    monkeypatch.setenv("PROFD_STATE_DIR", str(state_dir))
    save_state(
        state_dir,
        ServiceState(
            url=f"http://127.0.0.1:{port}",
            host="127.0.0.1",
            port=port,
            ray_address="10.255.255.1:6379",
            started_ray=False,
            save_root=str(tmp_path),
        ),
    )

    def gone(address: str | None, quiet: bool = False) -> None:
        raise ConnectionError("the cluster is gone in this test")

    monkeypatch.setattr("profd.core.ray_env.connect_ray", gone)
    service.down(address=None)  # the real `profd down`, against a cluster that is gone
    assert not (state_dir / "sidecar.json").exists()
    last = load_last(state_dir)
    assert last is not None and last.url == f"http://127.0.0.1:{port}"
    assert last.ray_address == "10.255.255.1:6379"

    for args in (["status"], ["sessions"], ["cancel", "x"]):
        r = cli(args, env, timeout=60)
        assert r.returncode == 3, (args, r.stdout, r.stderr)
        text = flat(r.stderr)
        assert f"profd is not running (last at http://127.0.0.1:{port}," in text, text
        assert "stopped by `profd down`" in text and "`profd up` starts it" in text
        assert f"127.0.0.1:{env['PROFD_PORT']}" in text  # the default it tried, named
    # --url: the address given, not the history
    r = cli(["status", "--url", f"http://127.0.0.1:{env['PROFD_PORT']}"], env, timeout=60)
    assert r.returncode == 3 and "cannot reach the profd sidecar" in r.stderr
    assert "last at" not in r.stderr


def test_a_recorded_sidecar_wins_over_the_last_address(tmp_path: Path) -> None:
    from profd.cli.ray_cluster import ServiceState, save_state

    state_dir = tmp_path / "state"
    record_last(state_dir, "http://127.0.0.1:1111")
    assert (state_dir / LAST_FILE).stat().st_mode & 0o077 == 0
    client = ApiClient.from_state(None, state_dir, default="http://127.0.0.1:2222")
    assert client.url == "http://127.0.0.1:2222" and client.last is not None
    save_state(
        state_dir,
        ServiceState(
            url="http://127.0.0.1:3333",
            host="127.0.0.1",
            port=3333,
            ray_address=None,
            started_ray=False,
            save_root=str(tmp_path),
        ),
    )
    client = ApiClient.from_state(None, state_dir, default="http://127.0.0.1:2222")
    assert client.url == "http://127.0.0.1:3333" and client.last is None
    err = client._unreachable(ConnectionError())
    assert isinstance(err, CliError) and err.exit_code == 3
    assert "cannot reach the profd sidecar at http://127.0.0.1:3333" in str(err)
    # `profd down --keep-ray` keeps the record and notes the same address as stopped
    record_last(state_dir, "http://127.0.0.1:3333")
    err = ApiClient.from_state(None, state_dir)._unreachable(ConnectionError())
    assert "profd is not running (last at http://127.0.0.1:3333, stopped by" in str(err)
    (state_dir / LAST_FILE).write_text("{not json")
    assert load_last(state_dir) is None  # a damaged record: only the plain message


def test_up_forgets_the_last_address(tmp_path: Path) -> None:
    from profd.cli.service import _forget_last

    record_last(tmp_path, "http://127.0.0.1:1111")
    _forget_last(tmp_path)
    assert load_last(tmp_path) is None


def test_a_missing_stack_names_the_rank_asked_for(capsys: Any) -> None:
    """`profd stacks --ranks 9` without --role: "rank 9", not "* rank 9"."""
    from profd.cli.stacks_view import print_stacks

    missing = [
        {"role": "*", "rank": 9, "reason": "no live agent has this rank"},
        {"role": "actor", "rank": 3, "pid": 41, "reason": "py-spy could not attach"},
    ]
    print_stacks({"groups": [], "missing": missing, "notes": []})
    out = " ".join(capsys.readouterr().out.split())
    assert "no stack from rank 9: no live agent has this rank" in out
    assert "no stack from actor rank 3 (pid 41): py-spy could not attach" in out


def test_watch_list_says_every_part_of_a_condition() -> None:
    from profd.cli.watch_view import describe

    step = {"kind": "step_time", "role": "actor", "factor": 2.0, "baseline_steps": 20}
    assert describe(step) == "actor step > 2 x median of 20"
    full = {**step, "min_ms": 100.0, "for_steps": 2}
    assert describe(full) == "actor step > 2 x median of 20 (at least 100 ms, 2 in a row)"
    late = {"kind": "straggler", "role": "actor", "stage": "update", "min_ms": 50.0}
    assert describe(late) == "actor stage update ends late vs its peers (by at least 50 ms)"


def test_summary_sections_are_one_blank_line_apart() -> None:
    """A section with nothing to print leaves no empty line (three stood before the
    operators of a summary without mini-batches)."""
    from io import StringIO

    from rich.console import Console

    from profd.analysis import summarize_dir
    from profd.cli.summary_view import print_summary

    buf = StringIO()
    summary = summarize_dir(Path(__file__).parents[1] / "fixtures" / "cuda")
    assert not summary.mini_batches  # a section that prints nothing
    print_summary(summary, Console(file=buf, width=80))
    text = buf.getvalue()
    assert "Top operators" in text and "GPU time per track" in text
    assert "\n\n\n" not in text.replace(" ", "")


def test_watch_list_keeps_session_ids_whole_in_80_columns(capsys: Any) -> None:
    from profd.cli import watch_view

    when = {"kind": "stage_time", "role": "actor", "stage": "update", "factor": 2.0,
            "baseline_steps": 20, "min_ms": 100.0, "for_steps": 2}  # fmt: skip
    firing = {"state": "fired", "session_id": "20261205-093027-b405",
              "evidence": {"rank": 1, "observed_s": 0.84, "baseline_s": 0.42}}  # fmt: skip
    t = {"trigger_id": "trg-9369e822", "name": "slow-update", "request": {"when": when},
         "suppressed": {"cooldown": 3, "max_per_hour": 12}, "fired": 2,
         "firings": [firing]}  # fmt: skip
    idle = {**t, "trigger_id": "trg-1", "firings": [], "suppressed": {}, "fired": 0,
            "idle_reason": "no alive agent of role 'actor'"}  # fmt: skip
    watch_view.print_triggers([t, idle])
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 80
    assert "last: fired 20261205-093027-b405: rank 1 840 ms vs 420 ms" in out
    assert "fired 2 (suppressed: cooldown 3, max_per_hour 12)" in out
    assert "trg-1  slow-update  fired 0\n" in out and "judges nothing: no alive agent" in out
