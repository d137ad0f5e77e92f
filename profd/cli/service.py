"""``profd up`` / ``profd down``: the coordinator and the sidecar on a Ray cluster."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from profd.settings import ProfdSettings

__all__ = ["down", "register", "up"]

console = Console()
err_console = Console(stderr=True)


def _settings() -> ProfdSettings:
    return ProfdSettings()


AllowSaveRootOpt = Annotated[
    list[Path],
    typer.Option(
        "--allow-save-root",
        help="Directory a save_path over HTTP may resolve under (repeatable; the save root "
        "is always allowed).",
    ),
]
AllowUploadOpt = Annotated[
    list[str],
    typer.Option(
        "--allow-upload-prefix",
        help="URI prefix an upload_uri over HTTP may start with, e.g. s3://bucket/traces "
        "(repeatable; none by default: upload_uri is refused over HTTP).",
    ),
]


def _sidecar_config(
    settings: ProfdSettings,
    coord: Any,
    token: str,
    host: str | None,
    port: int | None,
    allow_hook_commands: bool,
    allow_save_root: list[Path],
    allow_upload_prefix: list[str],
) -> Any:
    """How `profd up` serves the sidecar: the token, and where sessions may write."""
    from profd.settings import SidecarConfig

    return SidecarConfig(
        host=host or settings.host,
        port=settings.port if port is None else port,
        token=token,
        allow_hook_commands=allow_hook_commands,
        save_roots=(coord.save_root, *(str(p.expanduser().resolve()) for p in allow_save_root)),
        upload_prefixes=tuple(
            p if "://" in p else str(Path(p).expanduser().resolve()) for p in allow_upload_prefix
        ),
        base_dir=coord.base_dir,
        freeze_gc=True,  # the sidecar actor's process serves nothing else
    )


def up(
    address: Annotated[
        str | None,
        typer.Option(
            help="Ray address to join ('auto' = local cluster); default: start a local Ray."
        ),
    ] = None,
    host: Annotated[str | None, typer.Option(help="Sidecar bind address.")] = None,
    port: Annotated[int | None, typer.Option(help="Sidecar port.")] = None,
    save_root: Annotated[Path | None, typer.Option(help="Default save root.")] = None,
    allow_hook_commands: Annotated[
        bool, typer.Option(help="Accept finish_hook_cmd over HTTP.")
    ] = False,
    allow_save_root: AllowSaveRootOpt = [],  # noqa: B006
    allow_upload_prefix: AllowUploadOpt = [],  # noqa: B006
    num_cpus: Annotated[int | None, typer.Option(help="CPUs of a local Ray started here.")] = None,
) -> None:
    """Start the coordinator and the sidecar (and a local Ray when no --address is given)."""
    from profd.cluster import (
        load_state,
        read_or_create_token,
        save_state,
        start_services,
    )

    settings = _settings()
    previous = load_state(settings.state_dir)
    if previous is not None and _reachable(previous.url):
        console.print(f"profd is already up at [cyan]{previous.url}[/cyan] (nothing to do)")
        return
    address, started_ray, temp_dir = _join_or_start_ray(address, num_cpus)
    token, token_path = read_or_create_token(settings.state_dir)
    _replace_unknown_sidecar(token_path)
    coord = (
        settings.coordinator()
        if save_root is None
        else ProfdSettings(save_root=save_root).coordinator()
    )
    sidecar = _sidecar_config(
        settings,
        coord,
        token,
        host,
        port,
        allow_hook_commands,
        allow_save_root,
        allow_upload_prefix,
    )
    services = start_services(coord, sidecar, detached=True)
    save_state(settings.state_dir, _service_state(services, address, started_ray, temp_dir, coord))
    _report_up(services.address["url"], token_path, coord.save_root, sidecar, services)


def _service_state(
    services: Any, address: str, started_ray: bool, temp_dir: str | None, coord: Any
) -> Any:
    """What `down` and the other commands need to find what `up` started."""
    from profd.cluster import ServiceState, current_address

    addr = services.address
    return ServiceState(
        url=addr["url"],
        host=addr["host"],
        port=addr["port"],
        ray_address=current_address() or address,  # resolved: `down` must find this cluster
        started_ray=started_ray,
        save_root=coord.save_root,
        coordinator_created=services.coordinator_created,
        sidecar_created=services.sidecar_created,
        ray_temp_dir=temp_dir,
        ray_auth_mode=os.environ.get("RAY_AUTH_MODE"),
    )


def _report_up(url: str, token_path: Path, save_root: str, sidecar: Any, services: Any) -> None:
    console.print(f"profd is up: sidecar [cyan]{url}[/cyan]")
    console.print(f"  token file: {token_path} (owner-only)")
    console.print(f"  traces under: {save_root}")
    if not sidecar.loopback:
        console.print(f"  beyond loopback ({sidecar.host}): every route needs the token")
    if not (services.coordinator_created and services.sidecar_created):
        console.print("  (an existing coordinator / sidecar was reused)")


def _replace_unknown_sidecar(token_path: Path) -> None:
    """A sidecar running without this state directory's record (the file was lost, or it was
    started from elsewhere) has a token and flags this `up` cannot know: start it afresh so
    the token file and the flags given now are the ones it uses. The coordinator is kept."""
    from profd.actors import kill_named
    from profd.cluster import SIDECAR_NAME

    if kill_named(SIDECAR_NAME):
        console.print(
            f"  a sidecar without a record in this state directory was running: replaced it "
            f"so it uses the token in {token_path} and these flags"
        )


def _join_or_start_ray(address: str | None, num_cpus: int | None) -> tuple[str, bool, str | None]:
    """Join ``address``, or start a local Ray head when none is given."""
    from profd.cluster import connect_ray, start_local_ray

    temp_dir = None
    started = address is None
    if address is None:
        console.print("Starting a local Ray head on 127.0.0.1 ...")
        address, temp_dir = start_local_ray(num_cpus)
    connect_ray(address)
    return address, started, temp_dir


def _reachable(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def down(
    address: Annotated[
        str | None, typer.Option(help="Ray address (default: from `profd up`).")
    ] = None,
) -> None:
    """Stop the sidecar and the coordinator (and the local Ray `profd up` started)."""
    from profd.cluster import STATE_FILE, connect_ray, load_state, stop_local_ray, stop_services

    settings = _settings()
    state = load_state(settings.state_dir)
    target = address or (state.ray_address if state else None)
    if target is None and state is None:
        console.print(f"profd is not up (no state in {settings.state_dir})")
        return
    if state is not None and state.ray_auth_mode and "RAY_AUTH_MODE" not in os.environ:
        # before Ray is imported: a token-auth cluster refuses a driver without it
        os.environ["RAY_AUTH_MODE"] = state.ray_auth_mode
    try:
        connect_ray(target)
        stopped = stop_services()
    except Exception as exc:  # the cluster may already be gone
        stopped = []
        err_console.print(f"could not reach Ray at {target} ({exc}); cleaning up local state")
    if state is not None and state.started_ray:
        import ray

        ray.shutdown()  # disconnect first, so the driver does not echo the cluster's shutdown
        stop_local_ray(state.ray_temp_dir)
        stopped.append("local ray")
    (settings.state_dir / STATE_FILE).unlink(missing_ok=True)
    console.print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))


def register(app: typer.Typer) -> None:
    app.command()(up)
    app.command()(down)
