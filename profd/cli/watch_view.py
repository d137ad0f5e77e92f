"""``profd watch``: triggers that profile a slow rank by themselves (POST / GET / DELETE
``/api/v1/triggers``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

import typer
from rich.markup import escape

from profd.cli.client import EXIT_USAGE, CliError
from profd.cli.common import JsonOpt, UrlOpt, console, fail, finite, print_json, sidecar_client

__all__ = ["describe", "print_triggers", "trigger_body", "watch"]


def trigger_body(
    role: str,
    factor: float | None,
    stage: str | None,
    next_steps: int,
    options: dict[str, Any],
    kind: str | None = None,
) -> dict[str, Any]:
    """The POST /api/v1/triggers body of the command line's options (``None``: not given).
    ``kind``: step_time (the default), stage_time, straggler or oom."""
    kind = kind or "step_time"
    when: dict[str, Any] = {"kind": kind, "role": role}
    # Only what the command line gave: an option this kind does not use is the server's
    # 422 naming it (`--stage` on a step-time trigger), never dropped on the way.
    given = {"factor": factor, "stage": stage}
    given |= {k: options[k] for k in ("baseline_steps", "min_ms", "for_steps")}
    when.update({k: v for k, v in given.items() if v is not None})
    if kind in ("step_time", "stage_time"):
        mark = f"stage-{stage}" if kind == "stage_time" else "step"
        default_name = f"{role}-{mark}-x{factor:g}"
    elif kind == "straggler":
        default_name = f"{role}-{stage}-straggler"
    else:
        default_name = f"{role}-oom"
    return {
        "name": options["name"] or default_name,
        "when": when,
        "session": {"tool": options["tool"], "next_steps": next_steps},
        "cooldown_s": options["cooldown_s"],
        "max_per_hour": options["max_per_hour"],
        "max_disk_mb": options["max_disk_mb"],
    }


def describe(when: dict[str, Any]) -> str:
    """A trigger's condition in a few words."""
    kind = when["kind"]
    if kind == "oom":
        return f"{when['role']}: CUDA out of memory"
    extra = []  # what else must hold, as the dashboard says it
    if when.get("min_ms"):
        extra.append(f"{'by ' if kind == 'straggler' else ''}at least {when['min_ms']:g} ms")
    if (when.get("for_steps") or 1) > 1:
        extra.append(f"{when['for_steps']} in a row")
    tail = f" ({', '.join(extra)})" if extra else ""
    if kind == "straggler":
        return f"{when['role']} stage {when['stage']} ends late vs its peers{tail}"
    mark = f"stage {when['stage']}" if when.get("stage") else "step"
    median = f"median of {when['baseline_steps']}"
    return f"{when['role']} {mark} > {when['factor']:g} x {median}{tail}"


def _last(f: dict[str, Any]) -> str:
    ev = f["evidence"]
    head = f"{f['state']} {f['session_id'] or ''}: rank {ev['rank']} "
    if ev.get("kind") == "straggler" or "late_s" in ev:
        return head + f"{ev.get('late_s', 0) * 1000:.0f} ms late (step {ev.get('step')})"
    if ev.get("kind") == "oom":
        return head + "out of memory"
    return head + f"{ev['observed_s'] * 1000:.0f} ms vs {ev['baseline_s'] * 1000:.0f} ms"


def print_triggers(triggers: list[dict[str, Any]]) -> None:
    """A block per trigger, not a table: in 80 columns a table folded its session ids in
    two, and an id cut in two cannot be copied."""
    if not triggers:
        console.print("No trigger.")
    for t in triggers:
        quiet = ", ".join(f"{k} {v}" for k, v in sorted(t["suppressed"].items()))
        console.print(
            f"[bold]{escape(t['trigger_id'])}[/bold]  {escape(t['name'])}  fired {t['fired']}"
            + (f" (suppressed: {escape(quiet)})" if quiet else "")
        )
        console.print(f"  when: {escape(describe(t['request']['when']))}")
        if t["firings"]:
            console.print(f"  last: {escape(_last(t['firings'][0]))}")
        if t.get("idle_reason"):  # a sidecar of an older profd does not say
            console.print(f"  [yellow]judges nothing: {escape(t['idle_reason'])}[/yellow]")


def watch(
    role: Annotated[str | None, typer.Option(help="Role whose ranks are watched.")] = None,
    step_time: Annotated[
        float | None,
        typer.Option(callback=finite, help="Fire when a rank's step takes this x the median."),
    ] = None,
    stage_time: Annotated[
        float | None,
        typer.Option(callback=finite, help="Fire when a rank's --stage takes this x the median."),
    ] = None,
    stage: Annotated[
        str | None, typer.Option(help="The stage of --stage-time or --straggler.")
    ] = None,
    straggler: Annotated[
        bool, typer.Option(help="Fire when a rank's --stage ends late against its peers'.")
    ] = False,
    oom: Annotated[bool, typer.Option(help="Fire when a rank runs out of CUDA memory.")] = False,
    next_steps: Annotated[int, typer.Option(help="Steps profiled when it fires.")] = 2,
    baseline_steps: Annotated[
        int | None, typer.Option(help="Durations per rank in the median (default 20).")
    ] = None,
    min_ms: Annotated[
        float | None,
        typer.Option(callback=finite, help="Never fire below this duration (default 0)."),
    ] = None,
    for_steps: Annotated[
        int | None, typer.Option(help="Slow durations in a row needed (default 1).")
    ] = None,
    cooldown_s: Annotated[
        float, typer.Option("--cooldown", callback=finite, help="Quiet seconds after.")
    ] = 300,
    max_per_hour: Annotated[int, typer.Option(help="Firings in any 60 minutes.")] = 4,
    max_disk_mb: Annotated[
        float, typer.Option(callback=finite, help="Trace budget of its sessions.")
    ] = 1024,
    tool: Annotated[str, typer.Option(help="Profiling backend of its sessions.")] = "torch",
    name: Annotated[str | None, typer.Option(help="Name shown with its firings.")] = None,
    from_file: Annotated[
        Path | None, typer.Option("--file", help="Post the trigger(s) of this JSON file.")
    ] = None,
    list_: Annotated[bool, typer.Option("--list", help="List the triggers.")] = False,
    delete: Annotated[str | None, typer.Option(help="Delete this trigger.")] = None,
    url: UrlOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Profile a slow rank by itself: when a rank's step (or stage) time exceeds FACTOR x
    its role's rolling median, its stage ends late against its peers', or it runs out of
    memory, profile its next steps and one healthy peer's.

    * `profd watch --role actor --step-time 2.0`
    * `profd watch --role actor --stage update_actor --stage-time 1.5 --min-ms 500`
    * `profd watch --role actor --stage update_actor --straggler --min-ms 50`
    * `profd watch --role actor --oom`
    * `profd watch --list`, `profd watch --delete TRIGGER_ID`"""
    _one_mode(locals())
    try:
        api = sidecar_client(url)
        if list_ or delete is not None:
            _list_or_delete(api, delete, as_json)
            return
        if from_file is not None:
            checked = checked_triggers(from_file)
        else:
            body = _body(role, step_time, stage_time, stage, next_steps, locals())
            checked = [("the command line", body)]
        made = post_triggers(api, checked, new_names_only=True)
    except CliError as exc:
        fail(exc)
    if as_json:
        print_json(made if len(made) != 1 else made[0])
        return
    for view in made:
        console.print(f"watching: {view['trigger_id']} ({view['name']})")


def _list_or_delete(api: Any, delete: str | None, as_json: bool) -> None:
    if delete is None:
        triggers = api.get("/api/v1/triggers")["data"]
        print_json(triggers) if as_json else print_triggers(triggers)
        return
    view = api.request("DELETE", f"/api/v1/triggers/{quote(delete, safe='')}")
    print_json(view) if as_json else console.print(f"deleted {view['trigger_id']}")


#: ``profd watch``'s options that make a trigger (any one given: the command makes one).
_MAKING = ("role", "step_time", "stage_time", "stage", "straggler", "oom", "baseline_steps",
           "min_ms", "for_steps", "name")  # fmt: skip


def _one_mode(opts: dict[str, Any]) -> None:
    """One thing per command: list, delete, post a file, or make a trigger from options."""
    modes = [
        flag
        for flag, on in (
            ("--list", opts["list_"]),
            ("--delete", opts["delete"] is not None),
            ("--file", opts["from_file"] is not None),
            ("a trigger's options", any(opts[k] not in (None, False) for k in _MAKING)),
        )
        if on
    ]
    if len(modes) > 1:
        raise typer.BadParameter(
            f"{' and '.join(modes)} do not go together: give one of --list, --delete ID, "
            "--file FILE, or a trigger's options (--role with --step-time, ...)"
        )


def _body(
    role: str | None,
    step_time: float | None,
    stage_time: float | None,
    stage: str | None,
    next_steps: int,
    opts: dict[str, Any],
) -> dict[str, Any]:
    kinds = [k for k, on in (("step_time", step_time is not None),
             ("stage_time", stage_time is not None), ("straggler", opts["straggler"]),
             ("oom", opts["oom"])) if on]  # fmt: skip
    if role is None or len(kinds) != 1:
        given = [f"--{k.replace('_', '-')}" for k in kinds]
        why = f" (got {' and '.join(given)})" if len(given) > 1 else ""
        raise typer.BadParameter(
            f"give --role and one of --step-time, --stage-time, --straggler or --oom{why}"
        )
    (kind,) = kinds
    if kind in ("stage_time", "straggler") and stage is None:
        raise typer.BadParameter(f"--{kind.replace('_', '-')} needs --stage", param_hint="--stage")
    factor = step_time if step_time is not None else stage_time
    body = trigger_body(role, factor, stage, next_steps, opts, kind=kind)
    _check_options(body, kind)
    return body


#: The option that gave each field of a command line's trigger.
_OPTION_OF = {
    "when.role": "--role", "when.stage": "--stage", "when.min_ms": "--min-ms",
    "when.for_steps": "--for-steps", "when.baseline_steps": "--baseline-steps",
    "session.next_steps": "--next-steps", "session.tool": "--tool", "name": "--name",
    "cooldown_s": "--cooldown", "max_per_hour": "--max-per-hour",
    "max_disk_mb": "--max-disk-mb",
}  # fmt: skip


def _check_options(body: dict[str, Any], kind: str) -> None:
    """Check the trigger here as the sidecar will, so a bad value is named by the option
    the user typed (``--step-time``), not by its field in the request (``when.factor``)."""
    from pydantic import ValidationError

    from profd.core.request import field_errors
    from profd.core.trigger_request import TriggerRequest

    try:
        TriggerRequest.model_validate(body)
    except ValidationError as exc:
        factor = "--step-time" if kind == "step_time" else "--stage-time"
        options = {"when.factor": factor, **_OPTION_OF}
        named = [
            (options.get(e.field, e.field or "the trigger"), e.message) for e in field_errors(exc)
        ]
        first, message = named[0]
        raise typer.BadParameter(
            "; ".join([message, *(f"{o}: {m}" for o, m in named[1:])]), param_hint=first
        ) from None


def checked_triggers(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """A file's triggers, each checked here as the sidecar will check it, with where it is
    written (``FILE (trigger 2 of 3)``): one bad trigger, and nothing is posted."""
    from pydantic import ValidationError

    from profd.core.request import field_errors
    from profd.core.trigger_request import TriggerRequest

    items = load_trigger_file(path)
    out = []
    for i, body in enumerate(items, 1):
        where = str(path) if len(items) == 1 else f"{path} (trigger {i} of {len(items)})"
        try:
            TriggerRequest.model_validate(body)
        except ValidationError as exc:
            errs = "; ".join(f"{e.field or 'body'}: {e.message}" for e in field_errors(exc))
            raise CliError(f"{where}: {errs}; no trigger was posted", EXIT_USAGE) from None
        out.append((where, body))
    return out


def post_triggers(
    api: Any,
    checked: list[tuple[str, dict[str, Any]]],
    *,
    new_names_only: bool = False,
    replaces: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """POST each trigger (PUT, for one ``replaces`` names: name -> the trigger it changes);
    all or none: when the sidecar refuses one, those this call made are deleted again, those
    it changed get their old request back, and the error names the one refused.
    ``new_names_only``: a name already watched is refused before anything is posted.
    Returns the views."""
    names = [body.get("name") for _, body in checked]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise CliError(
            f"trigger name(s) {', '.join(map(str, twice))} given twice; none posted", EXIT_USAGE
        )
    if new_names_only:
        have = {t["name"]: t for t in api.get("/api/v1/triggers")["data"]}
        taken = [f"{n} ({have[n]['trigger_id']})" for n in names if n in have]
        if taken:
            raise CliError(
                f"already watching a trigger named {', '.join(taken)}: `profd watch --delete "
                "ID` first, or give another --name; none posted"
            )
    replaces = replaces or {}
    made: list[dict[str, Any]] = []
    changed: list[dict[str, Any]] = []  # the old views of the triggers changed so far
    for where, body in checked:
        old = replaces.get(body["name"])
        try:
            if old is None:
                made.append(api.post("/api/v1/triggers", body))
            else:
                changed.append(old)  # first: a PUT applied but not answered is undone too
                made.append(_put_trigger(api, old["trigger_id"], body))
        except CliError as exc:
            left = _undo(api, [v for v in made if v["name"] not in replaces], changed)
            kept = f"; could not undo {', '.join(left)}" if left else "; nothing was changed"
            raise CliError(f"{where}: {exc}{kept}", exc.exit_code) from None
    return made


def _put_trigger(api: Any, trigger_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return api.request("PUT", f"/api/v1/triggers/{quote(trigger_id, safe='')}", json=body)


def _undo(api: Any, made: list[dict[str, Any]], changed: list[dict[str, Any]]) -> list[str]:
    """Delete the triggers ``made``, put back the requests of those ``changed``; the ids
    that could not be, with why."""
    left = _delete_triggers(api, made)
    for old in changed:
        try:
            _put_trigger(api, old["trigger_id"], old["request"])
        except CliError as exc:
            left.append(f"{old['trigger_id']} ({exc})")
    return left


def _delete_triggers(api: Any, views: list[dict[str, Any]]) -> list[str]:
    """Delete each trigger (one already gone is fine); the ids that could not be, with why."""
    left = []
    for view in views:
        tid = view["trigger_id"]
        try:
            api.request("DELETE", f"/api/v1/triggers/{quote(tid, safe='')}")
        except CliError as exc:
            if exc.status != 404:
                left.append(f"{tid} ({exc})")
    return left


def load_trigger_file(path: Path) -> list[dict[str, Any]]:
    """A JSON file of one trigger (an object) or several (a list), as POST takes them."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read triggers from {path}: {exc}", EXIT_USAGE) from None
    items = data if isinstance(data, list) else [data]
    for i, item in enumerate(items, 1):
        if not isinstance(item, dict):
            where = (
                f" (item {i} of {len(items)}: {json.dumps(item)[:40]})" if len(items) > 1 else ""
            )
            raise CliError(f"{path}{where}: a trigger object, or a list of them", EXIT_USAGE)
    return items


def post_trigger_files(api: Any, files: list[Path]) -> list[str]:
    """``profd up --trigger FILE``: post each file's triggers. One whose name the
    coordinator already watches (it kept its triggers, or restored them from its state) is
    left as it is when the file says the same, and changed in place (PUT, same id) when the
    file changed it; a refused file changes nothing.
    Every file is checked before anything is posted. Returns a line per trigger."""
    from profd.core.trigger_request import TriggerRequest

    checked = [item for path in files for item in checked_triggers(path)]
    have = {t["name"]: t for t in api.get("/api/v1/triggers")["data"]}
    lines, todo, replaces = [], [], {}
    for where, body in checked:
        old = have.get(body["name"])
        if old is None:
            todo.append((where, body))
        elif TriggerRequest.model_validate(body).model_dump(mode="json") == old["request"]:
            lines.append(f"trigger {body['name']}: already watching")
        else:
            todo.append((where, body))
            replaces[body["name"]] = old
    for view in post_triggers(api, todo, replaces=replaces):
        verb = "changed (the file changed it), watching" if view["name"] in replaces else ""
        lines.append(f"trigger {view['name']}: {verb or 'watching'} ({view['trigger_id']})")
    return lines
