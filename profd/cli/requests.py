"""``profd profile``'s options turned into a session request (one window, verl configs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
import yaml

from profd.cli.common import comma_list

# -- profile --------------------------------------------------------------------------------
#: The request's window fields, and the options that set them.
WINDOW_KEYS = {"steps": "--steps", "next_steps": "--next-steps", "duration_s": "--duration"}


def check_window(
    steps: str | None, next_steps: int | None, duration: float | None, config: Path | None
) -> None:
    """At most one of --steps, --next-steps and --duration (bad usage, exit 2, otherwise)."""
    given = [
        opt
        for opt, value in zip(WINDOW_KEYS.values(), (steps, next_steps, duration), strict=True)
        if value is not None
    ]
    if len(given) > 1:
        raise typer.BadParameter(
            f"give one of --steps, --next-steps or --duration, not {' and '.join(given)}",
            param_hint=" / ".join(given),
        )
    if duration is not None and not 0 < duration <= 86_400:
        raise typer.BadParameter(
            f"seconds to profile, more than 0 and at most 86400, got {duration:g}",
            param_hint="--duration",
        )
    if not given and config is None:
        raise typer.BadParameter(
            "give one of --steps, --next-steps or --duration (or a --config that sets steps, "
            "next_steps or duration_s)",
            param_hint="--steps / --next-steps / --duration",
        )


def build_request(
    config: Path | None,
    tool: str | None,
    steps: str | None,
    next_steps: int | None,
    roles: list[str],
    ranks: str | None,
    all_ranks: bool,
    discrete: bool,
    contents: str | None,
    continuous: bool,
    duration: float | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if config is not None:
        from profd.driver.launch import resolve_interpolations
        from profd.driver.verl import looks_like_verl, request_from_verl

        try:
            loaded = resolve_interpolations(yaml.safe_load(config.read_text()) or {})
            if not isinstance(loaded, dict):
                raise ValueError(
                    f"config: must be a mapping (verl's global_profiler + <role>.profiler, or "
                    f"a session request), got {type(loaded).__name__}"
                )
            body = (
                request_from_verl(loaded).model_dump(mode="json", exclude_none=True)
                if looks_like_verl(loaded)
                else dict(loaded)
            )
        except OSError as exc:  # missing, a folder, unreadable: said, not a traceback
            raise typer.BadParameter(
                f"cannot read {config}: {exc.strerror or exc}", param_hint="--config"
            ) from None
        except (ValueError, yaml.YAMLError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--config") from None
    if tool:
        body["tool"] = tool
    # the window given on the command line replaces the one of --config
    for key, value in (
        ("steps", comma_list(steps, "--steps", as_int=True)),
        ("next_steps", next_steps),
        ("duration_s", duration),
    ):
        if value is not None:
            for other in WINDOW_KEYS:
                body.pop(other, None)
            body[key] = value
    if continuous:
        body["profile_continuous_steps"] = True
    block: dict[str, Any] = {}
    if all_ranks:
        block["all_ranks"] = True
    if ranks is not None:
        block["ranks"] = comma_list(ranks, "--ranks", as_int=True)
    if discrete:
        block["discrete"] = True
    if contents is not None:
        block["tool_config"] = {"torch": {"contents": [c for c in contents.split(",") if c]}}
    if roles or block:
        body.setdefault("roles", {})
        for role in roles or ["*"]:
            body["roles"][role] = {**body["roles"].get(role, {}), **block}
    return body
