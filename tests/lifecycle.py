"""End-to-end lifecycle harness: a real ``profd up`` (CLI subprocess, its own state directory
and its own local Ray) and the user's job (``examples/single_controller.py``) in its own
process, as a user runs them. Ray operations on that cluster (killing an actor) run in a
short-lived driver process of their own: the test process already belongs to another Ray."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from helpers import wait_until

ROOT = Path(__file__).resolve().parents[1]
PROFD = [sys.executable, "-m", "profd.cli.main"]
EXAMPLE = ROOT / "examples" / "single_controller.py"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def profd_ray_pids() -> set[int]:
    """Processes of any local Ray that `profd up` started (their temp dir names it)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and "/tmp/profd-ray-" in _cmdline(int(entry.name)):
            out.add(int(entry.name))
    return out


class Home:
    """One operator's `profd` as the CLI sees it: its own HOME and state directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state_dir = root / "state"
        self.env = dict(
            os.environ,
            HOME=str(root),
            PROFD_STATE_DIR=str(self.state_dir),
            COLUMNS="200",
            TERM="dumb",
        )
        self.temp_dirs: set[str] = set()

    def cli(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        r = subprocess.run(
            [*PROFD, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.root,
        )
        if self.state_file.exists():
            temp = self.state().get("ray_temp_dir")
            if temp:
                self.temp_dirs.add(temp)
        return r

    def up(self, *args: str) -> subprocess.CompletedProcess:
        r = self.cli("up", "--port", "0", "--num-cpus", "2", *args)
        assert r.returncode == 0, r.stdout + r.stderr
        return r

    @property
    def state_file(self) -> Path:
        return self.state_dir / "sidecar.json"

    def state(self) -> dict[str, Any]:
        return json.loads(self.state_file.read_text())

    @property
    def url(self) -> str:
        return self.state()["url"]

    @property
    def token(self) -> str:
        return (self.state_dir / "token").read_text().strip()

    def http(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}", **kw.pop("headers", {})}
        return httpx.request(method, self.url + path, headers=headers, timeout=30, **kw)

    def health(self) -> dict[str, Any] | None:
        try:
            r = httpx.get(self.url + "/healthz", timeout=3)
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    def agents(self) -> list[dict[str, Any]]:
        return self.http("GET", "/api/v1/agents").json()["data"]

    def ray(self, code: str, timeout: float = 120) -> str:
        """Run ``code`` in a fresh driver joined to this home's cluster (``ray`` imported)."""
        address = self.state()["ray_address"]
        script = (
            "import ray\n"
            f"ray.init(address={address!r}, namespace='profd', log_to_driver=False)\n"
            + textwrap.dedent(code)
        )
        r = subprocess.run(
            [sys.executable, "-c", script],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout

    def kill_actor(self, name: str) -> None:
        self.ray(f"ray.kill(ray.get_actor({name!r}), no_restart=True)\n")

    def close(self) -> None:
        """Leave nothing running: `profd down --stop-ray`, then any process of a Ray it
        started (a test may have broken the cluster)."""
        with contextlib.suppress(Exception):
            if self.state_file.exists():
                self.cli("down", "--stop-ray", timeout=120)
        from profd.cli.ray_cluster import stop_local_ray

        for temp in self.temp_dirs:
            stop_local_ray(temp, timeout=5)
            shutil.rmtree(temp, ignore_errors=True)  # Ray's logs and sockets of that cluster


class Job:
    """The user's single-controller job in its own process, printing one line per step."""

    def __init__(
        self,
        home: Home,
        address: str,
        steps: int = 100_000,
        step_seconds: float = 0.1,
        env: dict[str, str] | None = None,
    ) -> None:
        self.log = home.root / f"job-{time.monotonic_ns()}.log"
        self._err = self.log.open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(EXAMPLE),
                "--address",
                address,
                "--steps",
                str(steps),
                "--step-seconds",
                str(step_seconds),
                "--progress",
            ],
            env={**home.env, **(env or {})},
            cwd=home.root,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
        )
        self.steps: list[tuple[int, float, float]] = []  # (step, seconds, arrival)
        self.result: dict[str, Any] | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                d = json.loads(line)
                if "seconds" in d:
                    self.steps.append((d["step"], d["seconds"], time.monotonic()))
                else:
                    self.result = d

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def step(self) -> int:
        return self.steps[-1][0] if self.steps else 0

    def wait_step(self, n: int, timeout: float = 120) -> None:
        def reached() -> bool:
            if self.proc.poll() is not None and self.step < n:
                raise AssertionError(f"the job exited ({self.proc.returncode}): {self.stderr()}")
            return self.step >= n

        wait_until(reached, timeout, what=f"job at step {n}")

    def since(self, step: int) -> list[tuple[int, float, float]]:
        return [s for s in self.steps if s[0] > step]

    def stderr(self) -> str:
        self._err.flush()
        return self.log.read_text()[-4000:]

    def kill(self) -> None:
        """End the job at once: after its GCS died, Ray's own excepthook blocks a Ctrl-C'd
        driver on the GCS for a minute (seen with py-spy: ``GlobalState.add_worker``)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._err.close()

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._err.close()
