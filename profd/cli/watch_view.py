"""``profd watch``: triggers that profile a slow rank by themselves (POST / GET / DELETE
``/api/v1/triggers``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

import typer
from rich.table import Table

from profd.cli.client import CliError
from profd.cli.common import JsonOpt, UrlOpt, console, fail, print_json, sidecar_client

__all__ = ["describe", "print_triggers", "trigger_body", "watch"]


def trigger_body(
    role: str,
    factor: float | None,
    stage: str | None,
    next_steps: int,
    options: dict[str, Any],
    kind: str | None = None,
) -> dict[str, Any]:
    """The POST /api/v1/triggers body of the command line's options. ``kind``: straggler or
    oom (else step_time, or stage_time with a stage); only the fields a kind uses are sent."""
    kind = kind or ("stage_time" if stage else "step_time")
    when: dict[str, Any] = {"kind": kind, "role": role}
    if kind in ("step_time", "stage_time"):
        when.update(
            factor=factor, stage=stage, baseline_steps=options["baseline_steps"],
            min_ms=options["min_ms"], for_steps=options["for_steps"],
        )  # fmt: skip
        mark = f"stage-{stage}" if stage else "step"
        default_name = f"{role}-{mark}-x{factor:g}"
    elif kind == "straggler":
        when.update(stage=stage, min_ms=options["min_ms"], for_steps=options["for_steps"])
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
    if kind == "straggler":
        return f"{when['role']} stage {when['stage']} ends late vs its peers"
    if kind == "oom":
        return f"{when['role']}: CUDA out of memory"
    mark = f"stage {when['stage']}" if when.get("stage") else "step"
    return f"{when['role']} {mark} > {when['factor']:g} x median of {when['baseline_steps']}"


def _last(f: dict[str, Any]) -> str:
    ev = f["evidence"]
    head = f"{f['state']} {f['session_id'] or ''}: rank {ev['rank']} "
    if ev.get("kind") == "straggler" or "late_s" in ev:
        return head + f"{ev.get('late_s', 0) * 1000:.0f} ms late (step {ev.get('step')})"
    if ev.get("kind") == "oom":
        return head + "out of memory"
    return head + f"{ev['observed_s'] * 1000:.0f} ms vs {ev['baseline_s'] * 1000:.0f} ms"


def print_triggers(triggers: list[dict[str, Any]]) -> None:
    table = Table(title="Triggers", title_justify="left")
    for col in ("trigger", "name", "when", "fired", "suppressed", "last firing"):
        table.add_column(col, overflow="fold", no_wrap=col == "trigger")  # ids stay whole
    for t in triggers:
        when = describe(t["request"]["when"])
        quiet = ", ".join(f"{k} {v}" for k, v in sorted(t["suppressed"].items())) or "-"
        last = _last(t["firings"][0]) if t["firings"] else "-"
        table.add_row(t["trigger_id"], t["name"], when, str(t["fired"]), quiet, last)
    console.print(table)
    for t in triggers:
        if t.get("idle_reason"):  # a sidecar of an older profd does not say
            console.print(f"{t['trigger_id']} ({t['name']}) judges nothing: {t['idle_reason']}")


def watch(
    role: Annotated[str | None, typer.Option(help="Role whose ranks are watched.")] = None,
    step_time: Annotated[
        float | None, typer.Option(help="Fire when a rank's step takes this x the median.")
    ] = None,
    stage_time: Annotated[
        float | None, typer.Option(help="Fire when a rank's --stage takes this x the median.")
    ] = None,
    stage: Annotated[
        str | None, typer.Option(help="The stage of --stage-time or --straggler.")
    ] = None,
    straggler: Annotated[
        bool, typer.Option(help="Fire when a rank's --stage ends late against its peers'.")
    ] = False,
    oom: Annotated[bool, typer.Option(help="Fire when a rank runs out of CUDA memory.")] = False,
    next_steps: Annotated[int, typer.Option(help="Steps profiled when it fires.")] = 2,
    baseline_steps: Annotated[int, typer.Option(help="Durations per rank in the median.")] = 20,
    min_ms: Annotated[float, typer.Option(help="Never fire below this duration.")] = 0.0,
    for_steps: Annotated[int, typer.Option(help="Slow durations in a row needed.")] = 1,
    cooldown_s: Annotated[float, typer.Option("--cooldown", help="Quiet seconds after.")] = 300,
    max_per_hour: Annotated[int, typer.Option(help="Firings in any 60 minutes.")] = 4,
    max_disk_mb: Annotated[float, typer.Option(help="Trace budget of its sessions.")] = 1024,
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

    profd watch --role actor --step-time 2.0;
    profd watch --role actor --stage update_actor --stage-time 1.5 --min-ms 500;
    profd watch --role actor --stage update_actor --straggler --min-ms 50;
    profd watch --role actor --oom; profd watch --list; profd watch --delete TRIGGER_ID."""
    try:
        api = sidecar_client(url)
        if list_:
            triggers = api.get("/api/v1/triggers")["data"]
            print_json(triggers) if as_json else print_triggers(triggers)
            return
        if delete is not None:
            view = api.request("DELETE", f"/api/v1/triggers/{quote(delete, safe='')}")
            print_json(view) if as_json else console.print(f"deleted {view['trigger_id']}")
            return
        bodies = _bodies(role, step_time, stage_time, stage, next_steps, from_file, locals())
        made = [api.post("/api/v1/triggers", b) for b in bodies]
    except CliError as exc:
        fail(exc)
    if as_json:
        print_json(made if len(made) != 1 else made[0])
        return
    for view in made:
        console.print(f"watching: {view['trigger_id']} ({view['name']})")


def _bodies(
    role: str | None,
    step_time: float | None,
    stage_time: float | None,
    stage: str | None,
    next_steps: int,
    from_file: Path | None,
    opts: dict[str, Any],
) -> list[dict[str, Any]]:
    if from_file is not None:
        return load_trigger_file(from_file)
    kinds = [k for k, on in (("step_time", step_time is not None),
             ("stage_time", stage_time is not None), ("straggler", opts["straggler"]),
             ("oom", opts["oom"])) if on]  # fmt: skip
    if role is None or len(kinds) != 1:
        raise typer.BadParameter(
            "give --role and one of --step-time, --stage-time, --straggler or --oom"
        )
    (kind,) = kinds
    if kind in ("stage_time", "straggler") and stage is None:
        raise typer.BadParameter(f"--{kind.replace('_', '-')} needs --stage", param_hint="--stage")
    if kind in ("straggler", "oom"):
        return [trigger_body(role, None, stage, next_steps, opts, kind=kind)]
    factor = step_time if step_time is not None else stage_time
    return [trigger_body(role, factor, stage if stage_time else None, next_steps, opts)]


def load_trigger_file(path: Path) -> list[dict[str, Any]]:
    """A JSON file of one trigger (an object) or several (a list), as POST takes them."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read triggers from {path}: {exc}") from None
    items = data if isinstance(data, list) else [data]
    if not all(isinstance(i, dict) for i in items):
        raise CliError(f"{path}: a trigger object, or a list of them")
    return items


def post_trigger_files(api: Any, files: list[Path]) -> list[str]:
    """``profd up --trigger FILE``: post each file's triggers. One whose name the
    coordinator already watches (it kept its triggers, or restored them from its state) is
    left as it is when the file says the same, and replaced when the file changed it.
    Returns a line per trigger."""
    from pydantic import ValidationError

    from profd.core.trigger_request import TriggerRequest

    have = {t["name"]: t for t in api.get("/api/v1/triggers")["data"]}
    lines = []
    for path in files:
        for body in load_trigger_file(path):
            old = have.get(body.get("name"))
            verb = "watching"
            if old is not None:
                try:
                    same = (
                        TriggerRequest.model_validate(body).model_dump(mode="json")
                        == old["request"]
                    )
                except ValidationError:
                    same = False  # the POST below says what is wrong with it
                if same:
                    lines.append(f"trigger {body['name']}: already watching")
                    continue
                api.request("DELETE", f"/api/v1/triggers/{quote(old['trigger_id'], safe='')}")
                verb = f"replaced {old['trigger_id']} (the file changed it), watching"
            view = api.post("/api/v1/triggers", body)
            have[view["name"]] = view
            lines.append(f"trigger {view['name']}: {verb} ({view['trigger_id']})")
    return lines
