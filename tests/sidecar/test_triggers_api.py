"""The triggers routes and `profd watch` over a real uvicorn sidecar and an in-process
coordinator: bad triggers are 422 naming the field (the session template checked with the
rules of POST /sessions), changes need the token, and the CLI creates, lists and deletes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from helpers import AUTH, TOKEN

GOOD = {"name": "slow-actor", "when": {"kind": "step_time", "role": "actor", "factor": 2.0}}


def cli(args: list[str], home: Path) -> subprocess.CompletedProcess:
    state = home / "state"
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    (state / "token").write_text(TOKEN + "\n")
    env = dict(os.environ, HOME=str(home), PROFD_STATE_DIR=str(state), COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "profd.cli.main", *args],
        env=env, capture_output=True, text=True, timeout=120, cwd=home,
    )  # fmt: skip


def fields(r: httpx.Response) -> dict[str, str]:
    assert r.status_code == 422, r.text
    return {f["field"]: f["message"] for f in r.json()["fields"]}


def test_bad_triggers_are_422_naming_the_field_and_changes_need_the_token(sidecar: Any) -> None:
    url = f"{sidecar.url}/api/v1/triggers"
    when = GOOD["when"]
    late = {**when, "kind": "straggler"}
    got = fields(httpx.post(url, json={**GOOD, "when": late}, headers=AUTH))
    assert "required for a straggler trigger" in got["when.stage"]
    oom = {"kind": "oom", "role": "actor", "stage": "update"}
    got = fields(httpx.post(url, json={**GOOD, "when": oom}, headers=AUTH))
    assert "not used by an oom trigger" in got["when.stage"]
    hook = {**GOOD, "session": {"finish_hook_cmd": "echo hi"}}
    assert "disabled" in fields(httpx.post(url, json=hook, headers=AUTH))["session.finish_hook_cmd"]
    job = {**GOOD, "session": {"job_id": "0a000000"}}  # the offender's job, at firing
    got = fields(httpx.post(url, json=job, headers=AUTH))
    assert "chosen when the trigger fires" in got["session.job_id"]
    away = {**GOOD, "session": {"save_path": "/etc/profd"}}
    assert "session.save_path" in fields(httpx.post(url, json=away, headers=AUTH))
    assert httpx.post(url, json=GOOD).status_code == 401
    assert httpx.get(url).json()["count"] == 0  # nothing half-applied
    r = httpx.post(url, json=GOOD, headers=AUTH)
    assert r.status_code == 201, r.text
    tid = r.json()["trigger_id"]
    assert httpx.delete(f"{url}/{tid}").status_code == 401
    assert httpx.delete(f"{url}/{tid}", headers=AUTH).status_code == 200
    assert httpx.get(f"{url}/{tid}").status_code == 404
    assert httpx.delete(f"{url}/{tid}", headers=AUTH).status_code == 404
    # the other kinds are accepted, and a listed one posts back as it is
    for when in ({**late, "stage": "update", "min_ms": 50}, {"kind": "oom", "role": "actor"}):
        r = httpx.post(url, json={**GOOD, "name": when["kind"], "when": when}, headers=AUTH)
        assert r.status_code == 201, r.text
        listed = r.json()["request"]
        assert listed["when"]["kind"] == when["kind"]
        again = httpx.post(url, json={**listed, "name": f"again-{when['kind']}"}, headers=AUTH)
        assert again.status_code == 201 and again.json()["request"]["when"] == listed["when"]
    assert httpx.get(url).json()["count"] == 4


def test_profd_watch_creates_lists_and_deletes(sidecar: Any, tmp_path: Path) -> None:
    env = tmp_path
    r = cli(["watch", "--role", "actor", "--stage", "update", "--stage-time", "1.5",
             "--min-ms", "200", "--url", sidecar.url, "--json"], env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    made = json.loads(r.stdout)
    assert made["request"]["when"] == {
        "kind": "stage_time", "role": "actor", "stage": "update", "factor": 1.5,
        "baseline_steps": 20, "min_ms": 200.0, "for_steps": 1,
    }  # fmt: skip
    assert made["request"]["session"] == {"tool": "torch", "next_steps": 2}
    late = cli(["watch", "--role", "actor", "--stage", "update", "--straggler", "--min-ms", "50",
                "--url", sidecar.url, "--json"], env)  # fmt: skip
    assert late.returncode == 0, late.stderr
    assert json.loads(late.stdout)["request"]["when"] == {
        "kind": "straggler",
        "role": "actor",
        "stage": "update",
        "factor": 2.0,
        "baseline_steps": 20,
        "min_ms": 50.0,
        "for_steps": 1,
    }  # fmt: skip  (the defaults of the fields a straggler does not use)
    oom = cli(["watch", "--role", "actor", "--oom", "--url", sidecar.url, "--json"], env)
    assert oom.returncode == 0, oom.stderr
    assert json.loads(oom.stdout)["request"]["when"]["kind"] == "oom"
    listed = cli(["watch", "--list", "--url", sidecar.url], env)
    assert made["trigger_id"] in listed.stdout and "actor stage update > 1.5 x" in listed.stdout
    assert "actor stage update ends late vs its peers" in listed.stdout
    assert "actor: CUDA out of memory" in listed.stdout
    bad = cli(["watch", "--role", "actor", "--url", sidecar.url], env)
    assert bad.returncode == 2 and "--step-time" in bad.stderr
    two = cli(["watch", "--role", "actor", "--oom", "--straggler", "--url", sidecar.url], env)
    assert two.returncode == 2 and "one of" in two.stderr
    assert "(got --straggler and --oom)" in " ".join(two.stderr.split())
    # an option the kind does not use is refused naming it, never dropped on the way; a
    # bad value is named by the option typed, not its field in the request
    for extra, field in [
        (["--step-time", "3", "--stage", "update"], "--stage: not used by a step_time"),
        (["--oom", "--baseline-steps", "5"], "--baseline-steps: not used by an oom"),
        (["--oom", "--min-ms", "10"], "--min-ms: not used by an oom"),
        (["--stage", "update", "--straggler", "--baseline-steps", "5"], "--baseline-steps"),
        (["--step-time", "0.5"], "--step-time: Input should be greater than 1"),
        (["--step-time", "2", "--cooldown", "-1"], "--cooldown: Input should be greater"),
        (["--step-time", "0.5", "--cooldown", "-1"], "than 1; --cooldown: Input should be"),
    ]:
        r = cli(["watch", "--role", "critic", *extra, "--url", sidecar.url], env)
        assert r.returncode == 2 and field in " ".join(r.stderr.split()), (extra, r.stderr)
    # one thing per command
    for args in (["--list", "--delete", "x"], ["--file", "t.json", "--role", "a", "--oom"]):
        r = cli(["watch", *args, "--url", sidecar.url], env)
        assert r.returncode == 2 and "do not go together" in r.stderr, (args, r.stderr)
    # the same trigger twice: the second is refused naming the first
    again = cli(["watch", "--role", "actor", "--oom", "--url", sidecar.url], env)
    assert again.returncode == 1
    assert (
        f"already watching a trigger named actor-oom ({json.loads(oom.stdout)['trigger_id']})"
        in (" ".join(again.stderr.split()))
    )
    assert httpx.get(f"{sidecar.url}/api/v1/triggers").json()["count"] == 3
    for t in (late, oom):
        tid = json.loads(t.stdout)["trigger_id"]
        assert cli(["watch", "--delete", tid, "--url", sidecar.url], env).returncode == 0
    gone = cli(["watch", "--delete", made["trigger_id"], "--url", sidecar.url], env)
    assert gone.returncode == 0 and f"deleted {made['trigger_id']}" in gone.stdout
    assert httpx.get(f"{sidecar.url}/api/v1/triggers").json()["count"] == 0


def test_profd_up_trigger_files_keep_what_is_watched_and_replace_what_changed(
    sidecar: Any, tmp_path: Path
) -> None:
    """`profd up --trigger FILE` at every start: the coordinator keeps its triggers (and
    restores them from its state), so the same definition is left alone and an edited one
    replaces the one watched."""
    from profd.cli.client import ApiClient
    from profd.cli.watch_view import post_trigger_files

    api = ApiClient(sidecar.url, TOKEN)
    path = tmp_path / "triggers.json"
    path.write_text(json.dumps(GOOD))
    (first,) = post_trigger_files(api, [path])
    assert first.startswith("trigger slow-actor: watching (trg-")
    assert post_trigger_files(api, [path]) == ["trigger slow-actor: already watching"]
    old_id = httpx.get(f"{sidecar.url}/api/v1/triggers").json()["data"][0]["trigger_id"]
    path.write_text(json.dumps({**GOOD, "when": {**GOOD["when"], "factor": 3.0}}))
    (changed,) = post_trigger_files(api, [path])
    assert changed == f"trigger slow-actor: changed (the file changed it), watching ({old_id})"
    (now,) = httpx.get(f"{sidecar.url}/api/v1/triggers").json()["data"]
    assert now["trigger_id"] == old_id and now["request"]["when"]["factor"] == 3.0


def test_names_are_unique_and_put_changes_a_trigger_in_place(sidecar: Any) -> None:
    """Over HTTP as through the CLI: a second trigger of a name is 409 naming the first (a
    file re-posted finds its triggers by name); PUT changes one under its id, checked as
    POST is, and may not take another's name."""
    url = f"{sidecar.url}/api/v1/triggers"
    first = httpx.post(url, json=GOOD, headers=AUTH)
    assert first.status_code == 201, first.text
    tid = first.json()["trigger_id"]
    again = httpx.post(url, json=GOOD, headers=AUTH)
    assert again.status_code == 409 and again.json()["detail"] == {"trigger_id": tid}
    assert f"a trigger named 'slow-actor' exists ({tid})" in again.json()["message"]
    other = httpx.post(url, json={**GOOD, "name": "other"}, headers=AUTH).json()
    edit = {**GOOD, "when": {**GOOD["when"], "factor": 4.0}}
    assert httpx.put(f"{url}/{tid}", json=edit).status_code == 401  # a change: the token
    put = httpx.put(f"{url}/{tid}", json=edit, headers=AUTH)
    assert put.status_code == 200 and put.json()["trigger_id"] == tid, put.text
    assert put.json()["request"]["when"]["factor"] == 4.0
    assert put.json()["created_at"] == first.json()["created_at"]
    taken = httpx.put(f"{url}/{tid}", json={**edit, "name": "other"}, headers=AUTH)
    assert taken.status_code == 409 and other["trigger_id"] in taken.json()["message"]
    bad = httpx.put(f"{url}/{tid}", json={**edit, "session": {"tool": "nope"}}, headers=AUTH)
    assert "session.tool" in fields(bad)
    hook = httpx.put(f"{url}/{tid}", json={**edit, "session": {"finish_hook_cmd": "x"}},
                     headers=AUTH)  # fmt: skip
    assert "session.finish_hook_cmd" in fields(hook)
    gone = httpx.put(f"{url}/trg-none", json=edit, headers=AUTH)
    assert gone.status_code == 404 and "no trigger 'trg-none'" in gone.text
    listed = {t["trigger_id"]: t for t in httpx.get(url).json()["data"]}
    assert listed[tid]["request"]["when"]["factor"] == 4.0 and len(listed) == 2


def test_trigger_files_are_all_or_nothing(sidecar: Any, tmp_path: Path) -> None:
    """A file of triggers: one bad (checked here) or refused (by the sidecar: hook commands
    are off) and none is kept, the error naming which one; `profd up --trigger` with an
    edited trigger the sidecar refuses keeps the one watched (it used to delete it first)."""
    from profd.cli.client import ApiClient, CliError
    from profd.cli.watch_view import post_trigger_files

    url = f"{sidecar.url}/api/v1/triggers"
    other = {**GOOD, "name": "other"}
    bad = {**GOOD, "name": "bad", "when": {**GOOD["when"], "stage": "update"}}
    hook = {**GOOD, "name": "hook", "session": {"finish_hook_cmd": "echo hi"}}
    for items, said in [
        ([other, bad], "(trigger 2 of 2): when.stage: not used by a step_time"),
        ([other, hook], "(trigger 2 of 2): HTTP 422: session.finish_hook_cmd"),
        ([other, other], "trigger name(s) other given twice"),
        ([1, other], "(item 1 of 2: 1): a trigger object"),
    ]:
        path = tmp_path / "many.json"
        path.write_text(json.dumps(items))
        r = cli(["watch", "--file", str(path), "--url", sidecar.url], tmp_path)
        assert r.returncode == 2 and said in " ".join(r.stderr.split()), r.stderr  # bad input
        assert httpx.get(url).json()["count"] == 0  # nothing half-applied
    path.write_text(json.dumps([other, GOOD]))
    r = cli(["watch", "--file", str(path), "--url", sidecar.url], tmp_path)
    assert r.returncode == 0 and r.stdout.count("watching: trg-") == 2, r.stderr
    # `profd up --trigger`: an edit the sidecar refuses changes nothing; nor does an edit
    # it took, when a new trigger after it in the files is refused (put back as it was)
    api = ApiClient(sidecar.url, TOKEN)
    before = httpx.get(url).json()["data"]
    edited = {**GOOD, "when": {**GOOD["when"], "factor": 3.0}, "session": hook["session"]}
    fine_edit = {**GOOD, "when": {**GOOD["when"], "factor": 3.0}}
    for items in ([edited], [fine_edit, {**hook, "name": "new-hook"}]):
        path.write_text(json.dumps(items))
        try:
            post_trigger_files(api, [path])
            raise AssertionError("the refused edit was posted")
        except CliError as exc:
            assert "session.finish_hook_cmd" in str(exc) and "nothing was changed" in str(exc)
        assert httpx.get(url).json()["data"] == before


def test_stacks_route_bad_input_and_no_agents(sidecar: Any) -> None:
    for ranks in ("²", "1," + "9" * 5000, "-1", "", " , "):
        r = httpx.get(f"{sidecar.url}/api/v1/stacks", params={"ranks": ranks})
        assert r.status_code == 422 and r.json()["fields"][0]["field"] == "ranks", r.text
    r = httpx.get(f"{sidecar.url}/api/v1/stacks", params={"role": "actor"})
    assert r.status_code == 404 and "role: no live agent has role 'actor'" in r.text
    view = httpx.get(f"{sidecar.url}/api/v1/stacks").json()
    assert view["groups"] == [] and view["notes"] == ["no agent is attached"]


def test_a_clean_up_that_fails_names_what_was_left() -> None:
    """The sidecar refuses the second trigger and then goes away: the first cannot be
    removed again, and the error says so, naming it (it said "no trigger was kept", or
    raised the DELETE's error alone). A trigger changed in place gets its old request
    back."""
    from profd.cli.client import CliError
    from profd.cli.watch_view import post_triggers

    class Api:
        def __init__(self, delete_fails_with: int | None) -> None:
            self.deletes: list[str] = []
            self.puts: list[tuple[str, Any]] = []
            self.fail = delete_fails_with

        def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
            if body["name"] == "refused":
                raise CliError("HTTP 422: when.factor: ...", 1, 422)
            return {"trigger_id": f"trg-{body['name']}", "name": body["name"]}

        def request(self, method: str, path: str, json: Any = None) -> Any:
            tid = path.rsplit("/", 1)[-1]
            if method == "PUT":
                self.puts.append((tid, json))
                return {"trigger_id": tid, "name": json["name"]}
            self.deletes.append(tid)
            if self.fail is not None:
                raise CliError("gone", 3 if self.fail == 0 else 1, self.fail or None)
            return {}

    items = [("f (trigger 1 of 2)", {"name": "ok"}), ("f (trigger 2 of 2)", {"name": "refused"})]
    api = Api(delete_fails_with=0)  # unreachable
    try:
        post_triggers(api, items)  # type: ignore[arg-type]
        raise AssertionError("posted")
    except CliError as exc:
        assert "f (trigger 2 of 2): HTTP 422" in str(exc)
        assert "could not undo trg-ok" in str(exc) and "nothing was changed" not in str(exc)
    # a trigger changed in place, then a later one refused: its old request is put back
    api = Api(delete_fails_with=None)
    old = {"trigger_id": "trg-old", "name": "ok", "request": {"name": "ok", "v": 1}}
    try:
        post_triggers(api, items, replaces={"ok": old})  # type: ignore[arg-type]
        raise AssertionError("posted")
    except CliError as exc:
        assert "nothing was changed" in str(exc)
    assert api.puts == [("trg-old", {"name": "ok"}), ("trg-old", old["request"])]
    assert api.deletes == []  # it made nothing new to delete
