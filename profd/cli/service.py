"""``profd up``: the coordinator and the sidecar on a Ray cluster (``profd down`` is in
:mod:`profd.cli.service_down`)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from profd.cli.service_down import down
from profd.core.settings import ProfdSettings

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


@dataclass(frozen=True)
class SidecarFlags:
    """The sidecar flags of one `profd up`, as given (None / empty: not given)."""

    host: str | None = None
    port: int | None = None
    allow_hook_commands: bool = False
    allow_save_root: tuple[Path, ...] = ()
    allow_upload_prefix: tuple[str, ...] = ()
    allow_host: tuple[str, ...] = ()

    @property
    def given(self) -> bool:
        return self != SidecarFlags()

    def named(self, running_port: int | None = None) -> list[str]:
        """The flags given, by their names (a --port the sidecar already has, or 0, any
        free one, left out)."""
        unset = SidecarFlags()
        names = [
            "--" + f.name.replace("_", "-")
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(unset, f.name)
        ]
        return [n for n in names if not (n == "--port" and self.port in (0, running_port))]


def _sidecar_config(
    settings: ProfdSettings, coord: Any, token: str, flags: SidecarFlags, previous: Any
) -> Any:
    """How `profd up` serves the sidecar: the token, and where sessions may write; on the
    recorded cluster with no flags given, as the earlier `profd up` recorded it."""
    from profd.core.settings import SidecarConfig

    if previous is not None and previous.sidecar and not flags.given:
        return SidecarConfig(**{**previous.sidecar, "token": token})
    return SidecarConfig(
        host=flags.host or settings.host,
        port=settings.port if flags.port is None else flags.port,
        token=token,
        allow_hook_commands=flags.allow_hook_commands,
        save_roots=(
            coord.save_root,
            *(str(p.expanduser().resolve()) for p in flags.allow_save_root),
        ),
        upload_prefixes=tuple(
            p if "://" in p else str(Path(p).expanduser().resolve())
            for p in flags.allow_upload_prefix
        ),
        base_dir=coord.base_dir,
        allowed_hosts=flags.allow_host,
        freeze_gc=True,  # the sidecar actor's process serves nothing else
    )


AllowHostOpt = Annotated[
    list[str],
    typer.Option(
        "--allow-host",
        help="Host name the sidecar also answers to (repeatable; loopback names and the bind "
        "address always; '*' turns the Host check off, for a trusted proxy only).",
    ),
]


def up(
    address: Annotated[
        str | None,
        typer.Option(
            help="Ray address to join ('auto' = the cluster this node knows); default: the "
            "cluster recorded by an earlier `profd up` while it runs, else a new local Ray."
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
    allow_host: AllowHostOpt = [],  # noqa: B006
    num_cpus: Annotated[int | None, typer.Option(help="CPUs of a local Ray started here.")] = None,
    trigger: Annotated[
        list[Path],
        typer.Option(help="Watch with the trigger(s) of this JSON file (see `profd watch`)."),
    ] = [],  # noqa: B006
) -> None:
    """Start the coordinator and the sidecar (and a local Ray when no cluster is known).

    Run again after a crash, it brings back what is missing on the cluster it recorded: a
    sidecar that died, a coordinator killed for good (restored from its state), never a
    second cluster while the recorded one runs."""
    from profd.cli.ray_cluster import load_state, read_or_create_token, save_state

    flags = SidecarFlags(
        host,
        port,
        allow_hook_commands,
        tuple(allow_save_root),
        tuple(allow_upload_prefix),
        tuple(allow_host),
    )
    settings = _settings()
    _check_trigger_files(trigger)  # before anything starts: a bad file starts nothing
    previous = load_state(settings.state_dir)
    health = _health(previous.url) if previous is not None else None
    if previous is not None and health is not None and health.get("coordinator"):
        unused = {"--address": address, "--num-cpus": num_cpus, "--save-root": save_root}
        _already_up(settings, previous, unused, flags, trigger)
        return
    target, started_ray, temp_dir = _choose_cluster(previous, address, num_cpus)
    token, token_path = read_or_create_token(settings.state_dir)
    if health is None:  # the recorded sidecar does not answer (or there is no record)
        _replace_unknown_sidecar(token_path)
    recorded = previous if target.rejoined else None
    coord = _coordinator_settings(settings, recorded, save_root)
    sidecar = _sidecar_config(settings, coord, token, flags, recorded)
    services = _start(coord, sidecar, started_ray and not target.rejoined, temp_dir)
    state = _service_state(services, target.address, started_ray, temp_dir, coord, sidecar)
    save_state(settings.state_dir, state)
    _forget_last(settings.state_dir)
    _report_up(services.address["url"], token_path, coord.save_root, sidecar, services)
    if services.sidecar_created and recorded is not None and not flags.given:
        console.print("  (sidecar restarted with the flags the earlier `profd up` recorded)")
    if trigger:
        _watch(services.address["url"], token, trigger)
    _report_join(state.ray_address)


def _already_up(
    settings: Any, previous: Any, unused: dict[str, Any], flags: SidecarFlags, trigger: list[Path]
) -> None:
    """profd runs: say which flags it did not take; post the triggers (the one thing a
    running profd takes, over HTTP)."""
    from profd.cli.ray_cluster import read_or_create_token

    ignored = [k for k, v in unused.items() if v is not None]
    _say_already_up(previous, ignored + flags.named(_port_of(previous.url)))
    if trigger:
        token, _ = read_or_create_token(settings.state_dir)
        _watch(previous.url, token, trigger)


def _port_of(url: str) -> int | None:
    from urllib.parse import urlsplit

    try:
        return urlsplit(url).port
    except ValueError:
        return None


def _say_already_up(previous: Any, ignored: list[str]) -> None:
    console.print(f"profd is already up at [cyan]{previous.url}[/cyan] (nothing to start)")
    if ignored:
        err_console.print(
            f"  not applied to the running profd: {', '.join(ignored)}; `profd down "
            "--keep-ray`, then `profd up` with them"
        )
    _report_join(previous.ray_address)


def _check_trigger_files(files: list[Path]) -> None:
    from profd.cli.client import CliError
    from profd.cli.watch_view import checked_triggers

    try:
        for path in files:
            checked_triggers(path)
    except CliError as exc:
        raise typer.BadParameter(str(exc), param_hint="--trigger") from None


def _watch(url: str, token: str, files: list[Path]) -> None:
    from profd.cli.client import ApiClient, CliError
    from profd.cli.watch_view import post_trigger_files

    try:
        for line in post_trigger_files(ApiClient(url, token), files):
            console.print(f"  {line}")
    except CliError as exc:  # profd is up; say what was not watched, and fail
        err_console.print(f"--trigger: {exc} (profd itself is up)", style="red", markup=False)
        raise typer.Exit(1) from None


def _forget_last(state_dir: Path) -> None:
    """profd runs again: the address of an earlier one stopped is no longer news."""
    from profd.cli.client import LAST_FILE

    (state_dir / LAST_FILE).unlink(missing_ok=True)


def _start(coord: Any, sidecar: Any, ray_is_ours: bool, temp_dir: str | None) -> Any:
    """Start the services; on failure, say why and stop the Ray this `profd up` started."""
    from profd.cli.ray_cluster import start_services, stop_local_ray

    try:
        return start_services(coord, sidecar, detached=True)
    except Exception as exc:
        err_console.print(f"[red]profd up failed:[/red] {_root_cause(exc)}")
        if ray_is_ours:  # leave no cluster of ours behind
            import ray

            ray.shutdown()
            stop_local_ray(temp_dir)
            err_console.print("  stopped the local Ray this `profd up` had started")
        raise typer.Exit(1) from None


def _root_cause(exc: BaseException) -> str:
    """The message of the profd error inside a Ray actor-creation failure."""
    from profd.actors.store import StateDirInUse

    text = str(exc)
    cause = getattr(exc, "cause", None) or exc.__cause__
    if isinstance(cause, StateDirInUse):
        return str(cause)
    marker = "StateDirInUse: "
    if marker in text:
        return text[text.index(marker) + len(marker) :].strip().splitlines()[0]
    return text.strip().splitlines()[-1] if text.strip() else type(exc).__name__


@dataclass(frozen=True)
class _Target:
    """The Ray `profd up` uses, and whether it is the one its state file recorded."""

    address: str
    rejoined: bool


def _choose_cluster(
    previous: Any, address: str | None, num_cpus: int | None
) -> tuple[_Target, bool, str | None]:
    """Which Ray to use: the one asked for; else the recorded one while it runs; else a new
    local head (after clearing what is left of a recorded local one that stopped)."""
    from profd.cli.ray_cluster import stop_local_ray
    from profd.core.ray_env import connect_ray, current_address, gcs_reachable

    recorded = previous.ray_address if previous is not None else None
    if recorded and address in (None, recorded):
        if gcs_reachable(recorded, timeout=2.0):
            console.print(f"Rejoining the Ray cluster recorded in the state file: {recorded}")
            connect_ray(recorded, quiet=True)
            return _Target(recorded, True), previous.started_ray, previous.ray_temp_dir
        if address == recorded:
            err_console.print(f"[red]no Ray cluster answers at {recorded}[/red]")
            raise typer.Exit(1)
        if previous.started_ray and previous.ray_temp_dir:
            from profd.cli.ray_cluster import gcs_process

            gcs = gcs_process(previous.ray_temp_dir)
            if gcs is not None:  # not gone: only not answering (overloaded, paused)
                err_console.print(
                    f"[red]refused:[/red] the Ray recorded in the state file ({recorded}) does "
                    f"not answer, but its GCS process (pid {gcs}) runs: profd starts no second "
                    "cluster beside it. Wait and run `profd up` again, or `profd down "
                    "--stop-ray` to stop it."
                )
                raise typer.Exit(1)
        console.print(f"The Ray cluster recorded in the state file ({recorded}) is gone.")
        if previous.started_ray and previous.ray_temp_dir:
            left = stop_local_ray(previous.ray_temp_dir, timeout=5, address=previous.ray_address)
            if left > 0:
                console.print(f"  stopped {left} process(es) left over from it")
    target, started, temp_dir = _join_or_start_ray(address, num_cpus)
    if recorded and current_address() == recorded:  # `auto` or another name for the recorded Ray
        return _Target(recorded, True), previous.started_ray, previous.ray_temp_dir
    return _Target(target, False), started, temp_dir


def _coordinator_settings(settings: ProfdSettings, recorded: Any, save_root: Path | None) -> Any:
    """The coordinator's settings: --save-root given, else as recorded for the cluster
    rejoined, else from the environment."""
    from profd.core.settings import CoordinatorSettings

    if save_root is not None:
        return ProfdSettings(save_root=save_root).coordinator()
    if recorded is not None and recorded.coordinator:
        return CoordinatorSettings(**recorded.coordinator)
    return settings.coordinator()


def _service_state(
    services: Any,
    address: str,
    started_ray: bool,
    temp_dir: str | None,
    coord: Any,
    sidecar: Any,
) -> Any:
    """What `down` and the other commands need to find what `up` started."""
    from profd.cli.ray_cluster import ServiceState
    from profd.core.ray_env import current_address

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
        coordinator=coord.model_dump(mode="json"),
        # the port it got (a restarted sidecar keeps its URL); never the token in this file
        sidecar=sidecar.model_dump(mode="json", exclude={"token"}) | {"port": addr["port"]},
    )


def _report_up(url: str, token_path: Path, save_root: str, sidecar: Any, services: Any) -> None:
    console.print(f"profd is up: sidecar [cyan]{url}[/cyan]")
    console.print(f"  token file: {token_path} (owner-only)")
    console.print(f"  traces under: {save_root}")
    if not sidecar.loopback:
        console.print(f"  beyond loopback ({sidecar.host}): every route needs the token")
    if not services.coordinator_created:
        console.print("  (the running coordinator was kept)")
    elif services.coordinator_restored:
        console.print(
            f"  coordinator restored from its state: {services.coordinator_restored} "
            "session(s); live ones resume as their agents come back"
        )
    if not services.sidecar_created:
        console.print("  (the running sidecar was kept)")


def _report_join(ray_address: str | None) -> None:
    if not ray_address:
        return
    console.print(
        f'  jobs join this Ray cluster with [cyan]ray.init(address="{ray_address}")[/cyan] '
        f"or RAY_ADDRESS={ray_address}",
        soft_wrap=True,  # one line, to copy as it is
    )
    console.print(
        "  (address 'auto' takes the cluster this machine started last: on a shared machine "
        "that may be another one — give the address)"
    )


def _replace_unknown_sidecar(token_path: Path) -> None:
    """A sidecar running without this state directory's record (the file was lost, or it was
    started from elsewhere) has a token and flags this `up` cannot know: start it afresh so
    the token file and the flags given now are the ones it uses. The coordinator is kept."""
    from profd.actors import kill_named
    from profd.cli.ray_cluster import SIDECAR_NAME

    if kill_named(SIDECAR_NAME):
        console.print(
            f"  a sidecar without a record in this state directory was running: replaced it "
            f"so it uses the token in {token_path} and these flags"
        )


def _join_or_start_ray(address: str | None, num_cpus: int | None) -> tuple[str, bool, str | None]:
    """Join ``address``, or start a local Ray head when none is given."""
    from profd.cli.ray_cluster import start_local_ray
    from profd.core.ray_env import connect_ray

    temp_dir = None
    started = address is None
    if address is None:
        console.print("Starting a local Ray head on 127.0.0.1 ...")
        address, temp_dir = start_local_ray(num_cpus)
    connect_ray(address, quiet=True)
    return address, started, temp_dir


def _health(url: str) -> dict[str, Any] | None:
    """The sidecar's /healthz answer, or None when it does not answer."""
    import httpx

    try:
        r = httpx.get(f"{url}/healthz", timeout=2)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        return dict(r.json())
    except ValueError:
        return None


def register(app: typer.Typer) -> None:
    app.command()(up)
    app.command()(down)
