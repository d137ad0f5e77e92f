"""Starting, finding and stopping the Ray cluster and profd's services on it (``profd up`` /
``profd down``, the demo): processes, the service record and the token.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from profd.core.constants import COORDINATOR_NAME, SIDECAR_NAME, STATE_FILE, TOKEN_FILE
from profd.core.ray_env import apply_loopback_env, call_coordinator
from profd.core.settings import CoordinatorSettings, SidecarConfig

__all__ = [
    "ServiceState",
    "Services",
    "Tenant",
    "cluster_pids",
    "cluster_tenants",
    "gcs_process",
    "load_state",
    "read_or_create_token",
    "read_token",
    "save_state",
    "start_local_ray",
    "start_services",
    "stop_local_ray",
    "stop_services",
]

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray_cli() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else (shutil.which("ray") or "ray")


def start_local_ray(num_cpus: int | None = None) -> tuple[str, str]:
    """``ray start --head`` on 127.0.0.1 in the background; return (address, temp dir).

    The cluster gets a temp dir of its own so :func:`stop_local_ray` can stop exactly this
    cluster and no other Ray the user runs on the machine.
    """
    apply_loopback_env()
    port = _free_port()
    temp_dir = f"/tmp/profd-ray-{os.getuid()}-{port}"
    cmd = [
        _ray_cli(),
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
    ]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        raise RuntimeError(f"`ray start` failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return f"127.0.0.1:{port}", temp_dir


def _pids_mentioning(marker: str) -> list[int]:
    """Processes with ``marker`` as a whole argument, an ``--option=marker`` value, or a path
    below it (Ray's processes name their temp dir so); not a substring of any argument, so a
    user's ``tail <marker>-logs`` is not taken for the cluster."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(_arg_is(arg, marker) for arg in args):
            pids.append(int(entry.name))
    return pids


def _arg_is(arg: str, marker: str) -> bool:
    value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
    return value == marker or value.startswith(marker + "/")


def gcs_process(temp_dir: str) -> int | None:
    """The running ``gcs_server`` of the local cluster using ``temp_dir``, if any."""
    for pid in _pids_mentioning(temp_dir):
        try:
            exe = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if exe.endswith(b"gcs_server") and _running(pid):
            return pid
    return None


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child nobody reaped yet: in a
    container whose init does not reap, the cluster's exited processes stay zombies)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc."""
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the name (field 2) may hold spaces and parentheses: the ppid follows the last ')'
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def ray_client_servers(address: str) -> list[int]:
    """The Ray client server of the cluster whose GCS is at ``address``: ``ray start`` leaves
    it as an orphan that names neither the temp dir nor a parent of the cluster's, only the
    GCS (``--address=...``); a user's job naming the address is not one."""
    return [
        pid for pid in _pids_mentioning(address) if b"ray.util.client.server" in _cmdline_bytes(pid)
    ]


def _cmdline_bytes(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def cluster_pids(temp_dir: str, address: str | None = None) -> list[int]:
    """Every process of the local cluster that uses ``temp_dir``: those naming it on their
    command line and all their descendants, and its Ray client server (given its GCS
    ``address``). Ray renames some of its processes (``ray::DashboardAgent``,
    ``ray::RuntimeEnvAgent``, workers), so the command line alone misses them; they are
    children of the raylet."""
    roots = _pids_mentioning(temp_dir) + (ray_client_servers(address) if address else [])
    children = _children()
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in seen or pid == os.getpid():
            continue
        seen.add(pid)
        todo.extend(children.get(pid, ()))
    return sorted(seen)


def stop_local_ray(temp_dir: str | None, timeout: float = 3.0, address: str | None = None) -> int:
    """Stop the cluster started by :func:`start_local_ray` — every process of it, Ray's
    renamed agents and workers included; return how many processes were signalled. What
    has not exited ``timeout`` after SIGTERM gets SIGKILL (Ray's GCS ignores SIGTERM for
    a long while, and a cluster being torn down has nothing left to save)."""
    if not temp_dir or not Path("/proc").is_dir():
        subprocess.run([_ray_cli(), "stop"], capture_output=True, text=True, env=os.environ.copy())
        return -1
    pids = cluster_pids(temp_dir, address)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


@dataclass(frozen=True)
class Tenant:
    """Something on a Ray cluster that is not profd: a live driver, or a live actor."""

    kind: str  # "driver" | "actor"
    job_id: str
    pid: int | None
    what: str  # the driver's command line, or the actor's class and name
    #: An actor whose job has ended (a detached one it left: nothing runs it any more).
    job_ended: bool = False

    def describe(self) -> str:
        pid = f"pid {self.pid}" if self.pid else "pid unknown"
        left = ", left by that job, which has ended (detached)" if self.job_ended else ""
        return f"{self.kind} of job {self.job_id} ({pid}{left}): {self.what}"


def is_profd_actor(name: str) -> bool:
    """The coordinator, the sidecar, or a node relay (started by a job's agents, detached,
    stopped by ``profd down`` with the rest)."""
    from profd.actors.relay import RELAY_PREFIX

    return name in (COORDINATOR_NAME, SIDECAR_NAME) or name.startswith(RELAY_PREFIX)


def cluster_tenants() -> list[Tenant]:
    """Live drivers and actors of the joined cluster other than profd's own (this process's
    job, the coordinator, the sidecar and the node relays). Read from Ray's GCS tables, which
    need no dashboard."""
    import ray
    from ray._private import state as ray_state  # the GCS tables; no public API without a dashboard

    me = ray.get_runtime_context().get_job_id()
    out = []
    live = set()
    for job in ray_state.jobs():
        if job.get("IsDead"):
            continue
        live.add(str(job.get("JobID")))
        if job.get("JobID") == me:
            continue
        entry = str(job.get("Entrypoint") or "").strip() or "(no command line)"
        out.append(Tenant("driver", str(job.get("JobID")), job.get("DriverPid"), entry))
    for actor in ray_state.actors().values():
        if actor.get("State") == "DEAD" or is_profd_actor(actor.get("Name") or ""):
            continue
        name = actor.get("Name") or ""
        what = f"{actor.get('ActorClassName')}" + (f" named {name!r}" if name else "")
        job = str(actor.get("JobID"))
        out.append(Tenant("actor", job, actor.get("Pid") or None, what, job not in live))
    return out


@dataclass
class ServiceState:
    """What ``profd up`` started, kept in the state directory for later commands."""

    url: str
    host: str
    port: int
    ray_address: str | None
    started_ray: bool
    save_root: str
    coordinator_created: bool = True
    sidecar_created: bool = True
    #: Temp dir of the local Ray that `profd up` started (identifies its processes).
    ray_temp_dir: str | None = None
    #: ``RAY_AUTH_MODE`` `profd up` joined with (a token-auth cluster): `down` joins the same way.
    ray_auth_mode: str | None = None
    #: The coordinator's settings, so `profd up` recreates a lost coordinator as it was.
    coordinator: dict[str, Any] | None = None
    #: The sidecar's settings less its token, so `profd up` restarts a lost sidecar as it was.
    sidecar: dict[str, Any] | None = None


@dataclass
class Services:
    """Handles of the running services (keep them referenced: a non-detached actor without
    references is garbage-collected by Ray)."""

    coordinator: Any
    sidecar: Any
    address: dict[str, Any]
    coordinator_created: bool
    sidecar_created: bool
    #: Sessions a newly created coordinator restored from its state directory.
    coordinator_restored: int = 0


def start_services(
    coordinator: CoordinatorSettings, sidecar: SidecarConfig, *, detached: bool = True
) -> Services:
    """Start (or find) the coordinator and the sidecar."""
    import ray

    from profd.actors import get_or_create_coordinator, get_or_create_sidecar

    coord, coord_new = get_or_create_coordinator(coordinator, detached=detached)
    restored = 0
    if coord_new:
        status = call_coordinator(coord, "status", timeout=60)
        restored = sum(status.sessions_by_state.values())
    handle, side_new = get_or_create_sidecar(sidecar, detached=detached)
    address = ray.get(handle.address.remote())
    return Services(coord, handle, address, coord_new, side_new, restored)


def stop_services() -> list[str]:
    """Stop the sidecar, the coordinator and the node relays; the names of what was stopped."""
    from profd.actors import kill_named, kill_relays
    from profd.core.ray_env import find_actor

    stopped = [SIDECAR_NAME] if kill_named(SIDECAR_NAME) else []  # no change comes in now
    coordinator = find_actor(COORDINATOR_NAME)
    if coordinator is not None:  # its last queued rows reach the disk before it is killed
        try:
            if not call_coordinator(coordinator, "flush_state", 10.0, timeout=15.0):
                log.warning("profd down: the coordinator's last state rows were not written")
        except Exception as exc:  # a coordinator that does not answer is stopped all the same
            log.warning("profd down: could not flush the coordinator's state (%s)", exc)
    if kill_named(COORDINATOR_NAME):
        stopped.append(COORDINATOR_NAME)
    return stopped + kill_relays()


def _private(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)


def read_or_create_token(state_dir: Path) -> tuple[str, Path]:
    """The sidecar token, created readable by the owner only on first use."""
    path = state_dir / TOKEN_FILE
    _private(path)
    if path.exists():
        if path.stat().st_mode & 0o077:  # loosened since (a copy, a umask): tighten again
            log.warning("profd: %s was readable by others; made it owner-only", path)
            os.chmod(path, 0o600)
        return path.read_text().strip(), path
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, path


def read_token(state_dir: Path) -> str | None:
    path = state_dir / TOKEN_FILE
    return path.read_text().strip() if path.exists() else None


def save_state(state_dir: Path, state: ServiceState) -> Path:
    path = state_dir / STATE_FILE
    _private(path)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(state), f, indent=2)
    os.replace(tmp, path)
    return path


def load_state(state_dir: Path) -> ServiceState | None:
    path = state_dir / STATE_FILE
    if not path.exists():
        return None
    try:
        return ServiceState(**json.loads(path.read_text()))
    except (ValueError, TypeError):
        return None
