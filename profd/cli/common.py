"""What every command shares: the consoles, the common options, the sidecar client and
how a failure ends the command."""

from __future__ import annotations

import json
import sys
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
