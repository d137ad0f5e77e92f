"""``profd down``: stop the sidecar and the coordinator, and the local Ray ``profd up``
started when it runs nothing else; refuse (stopping nothing) when profd cannot tell."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from profd.cli.common import console, err_console, load_settings

__all__ = ["down"]


def down(
    address: Annotated[
        str | None, typer.Option(help="Ray address (default: from `profd up`).")
    ] = None,
    stop_ray: Annotated[
        bool,
        typer.Option(
            "--stop-ray",
            help="Also stop the local Ray `profd up` started even though other drivers or "
            "actors run on it (they die with it).",
        ),
    ] = False,
    keep_ray: Annotated[
        bool,
        typer.Option("--keep-ray", help="Stop profd's services only; leave the local Ray running."),
    ] = False,
) -> None:
    """Stop the sidecar and the coordinator, and the local Ray `profd up` started when it runs
    nothing else (a Ray that also runs a job is left alone unless --stop-ray says so)."""
    from profd.cli.ray_cluster import load_state

    if stop_ray and keep_ray:
        err_console.print("--stop-ray and --keep-ray contradict each other")
        raise typer.Exit(2)
    settings = load_settings()
    state = load_state(settings.state_dir)
    target = address or (state.ray_address if state else None)
    if target is None and state is None:
        from profd.cli.client import load_last

        last = load_last(settings.state_dir)
        where = f"; last at {last.url}" if last is not None else ""
        console.print(f"profd is not up (no state in {settings.state_dir}{where})")
        return
    owns_ray = state is not None and state.started_ray and (address in (None, state.ray_address))
    if stop_ray and not owns_ray:
        err_console.print(
            f"profd did not start the Ray at {target}: it never stops it (use `ray stop` on "
            "its nodes)"
        )
        raise typer.Exit(2)
    reachable = _join_for_down(state, target, refuse=owns_ray and not stop_ray)
    if reachable and owns_ray and not keep_ray and not stop_ray:
        _refuse_if_tenants(target)
    stopped = _stop_services() if reachable else []
    if owns_ray and not keep_ray:
        stopped += _stop_ray(state)
    keep_record = owns_ray and keep_ray and reachable
    if not keep_record:
        _forget(settings.state_dir, state)
    else:  # `profd up` rejoins the recorded Ray; until then commands say profd was stopped
        _note_stopped(settings.state_dir, state)
    console.print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    if keep_record:
        console.print(
            f"  the local Ray at {target} keeps running (recorded: `profd up` rejoins it, "
            "`profd down` stops it once it runs nothing else)"
        )


def _note_stopped(state_dir: Path, state: Any) -> None:
    from profd.cli.client import record_last

    try:
        record_last(state_dir, state.url, state.ray_address)
    except OSError as exc:  # only a nicer message later: never fail `down` over it
        err_console.print(f"could not note the last address in {state_dir} ({exc})")


def _forget(state_dir: Path, state: Any) -> None:
    """Remove the record of the services `profd down` stopped, keeping where they were (the
    sidecar's URL), so `profd status` can name it instead of the default port."""
    from profd.cli.ray_cluster import STATE_FILE

    if state is not None:
        _note_stopped(state_dir, state)
    (state_dir / STATE_FILE).unlink(missing_ok=True)


def _join_for_down(state: Any, target: str | None, *, refuse: bool) -> bool:
    """Join the cluster `down` acts on; False when it is gone. When the join fails but a Ray
    this `profd up` started still runs, profd cannot see what runs there: with ``refuse``
    it stops nothing (exit 1) rather than stop a cluster that may hold the user's job."""
    from profd.core.ray_env import connect_ray

    if state is not None and state.ray_auth_mode and "RAY_AUTH_MODE" not in os.environ:
        # before Ray is imported: a token-auth cluster refuses a driver without it
        os.environ["RAY_AUTH_MODE"] = state.ray_auth_mode
    try:
        connect_ray(target, quiet=True)
        return True
    except Exception as exc:  # the cluster may already be gone
        if refuse and _still_running(state):
            err_console.print(
                f"[red]refused:[/red] could not join the Ray at {target} ({exc}), but it still "
                "runs, so profd cannot tell what else does: nothing was stopped. Fix the join "
                "(RAY_AUTH_MODE, Ray version) and run `profd down` again, or `profd down "
                "--stop-ray` to stop it and everything on it."
            )
            raise typer.Exit(1) from None
        err_console.print(f"could not reach Ray at {target} ({exc}); cleaning up local state")
        return False


def _still_running(state: Any) -> bool:
    from profd.cli.ray_cluster import gcs_process
    from profd.core.ray_env import gcs_reachable

    if state.ray_temp_dir and gcs_process(state.ray_temp_dir) is not None:
        return True
    return bool(state.ray_address) and gcs_reachable(state.ray_address, timeout=2.0)


def _refuse_if_tenants(target: str | None) -> None:
    """Refuse (exit 1, nothing stopped) while the Ray profd started runs something else."""
    from profd.cli.ray_cluster import cluster_tenants

    try:
        tenants = cluster_tenants()
    except Exception as exc:  # cannot tell: assume the worst
        err_console.print(
            f"[red]refused:[/red] could not list what else runs on the Ray at {target} ({exc})"
        )
        raise typer.Exit(1) from None
    if not tenants:
        return
    err_console.print(
        f"[red]refused:[/red] the Ray at {target} that `profd up` started also runs "
        f"{len(tenants)} thing(s) that are not profd:"
    )
    for t in tenants[:20]:
        err_console.print(f"  - {t.describe()}")
    if len(tenants) > 20:
        err_console.print(f"  ... and {len(tenants) - 20} more")
    err_console.print(
        "Stop them first (end the job's driver; `ray.kill` detached actors), then run "
        "`profd down` again. Or: `profd down --keep-ray` stops profd only and leaves Ray "
        "running; `profd down --stop-ray` stops Ray too, and everything on it. Nothing was "
        "stopped."
    )
    raise typer.Exit(1)


def _stop_services() -> list[str]:
    from profd.cli.ray_cluster import stop_services

    try:
        return stop_services()
    except Exception as exc:
        err_console.print(f"could not stop profd's actors ({exc})")
        return []


def _stop_ray(state: Any) -> list[str]:
    import ray

    from profd.cli.ray_cluster import stop_local_ray

    ray.shutdown()  # disconnect first, so the driver does not echo the cluster's shutdown
    stop_local_ray(state.ray_temp_dir, address=state.ray_address)
    return ["local ray"]
