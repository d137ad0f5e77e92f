"""What every command shares: the consoles, the common options, the sidecar client and
how a failure ends the command."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.console import Console

from profd.cli.client import ApiClient, CliError, default_url
from profd.core.settings import ProfdSettings

console = Console()


err_console = Console(stderr=True)


UrlOpt = Annotated[
    str | None, typer.Option("--url", help="Sidecar URL (default: from `profd up`).")
]


JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


def load_settings() -> ProfdSettings:
    return ProfdSettings()


def sidecar_client(url: str | None, timeout: float = 30.0) -> ApiClient:
    settings = load_settings()
    return ApiClient.from_state(
        url, settings.state_dir, default=default_url(settings.host, settings.port), timeout=timeout
    )


def fail(exc: CliError) -> None:
    err_console.print(f"[red]error:[/red] {exc}")
    raise typer.Exit(exc.exit_code)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


#: The most numbers one ``a-b`` run may stand for (a typo like ``1-1000000`` is refused).
MAX_RUN = 100_000


def finite(param: typer.CallbackParam, value: float | None) -> float | None:
    """A float option's value, refused when it is not a finite number (``nan``, ``inf``):
    a bound compares false with NaN, and JSON has neither."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"must be a finite number, got {value}", param=param)
    return value


def finite_from(
    low: float, high: float | None = None, above: bool = False
) -> Callable[[typer.CallbackParam, float], float]:
    """:func:`finite`, at least ``low`` (more than it with ``above``) and at most ``high``
    (a click ``min`` lets NaN through)."""

    def check(param: typer.CallbackParam, value: float) -> float:
        value = finite(param, value)  # type: ignore[assignment]
        if value < low or (above and value == low):
            rule = f"more than {low:g}" if above else f"at least {low:g}"
            raise typer.BadParameter(f"must be {rule}, got {value:g}", param=param)
        if high is not None and value > high:
            raise typer.BadParameter(f"must be at most {high:g}, got {value:g}", param=param)
        return value

    return check


def comma_list(text: str | None, name: str, as_int: bool = False) -> list[Any] | None:
    """A comma-separated option's items (``None`` when not given); ``as_int``: integers,
    where ``a-b`` stands for ``a`` to ``b`` (``--steps 120-123,130``). A bad value is a
    usage error naming the option."""
    if text is None:
        return None
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        raise typer.BadParameter("expected a comma-separated list", param_hint=name)
    if not all(items):  # "1,,2" or "1,2,": a slip, not a list of two
        raise typer.BadParameter(f"an empty item in {text!r}", param_hint=name)
    if not as_int:
        return items
    out: list[int] = []
    for item in items:
        if item.startswith("-") and item[1:].isdigit():
            raise typer.BadParameter(f"numbers here are >= 0, got {item!r}", param_hint=name)
        first, sep, last = item.partition("-")
        try:
            if not sep:
                out.append(int(item))
                continue
            lo, hi = int(first), int(last)
        except ValueError:
            where = "" if item == text.strip() else f" in {text!r}"
            raise typer.BadParameter(
                f"expected comma-separated integers or runs like 3-5, got {item!r}{where}",
                param_hint=name,
            ) from None
        if hi < lo:
            raise typer.BadParameter(f"a run goes up (3-5), got {item!r}", param_hint=name)
        if hi - lo >= MAX_RUN:
            raise typer.BadParameter(
                f"a run stands for at most {MAX_RUN:,} numbers, got {item!r}", param_hint=name
            )
        out.extend(range(lo, hi + 1))
    return out
