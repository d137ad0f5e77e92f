"""Service settings: read once, from ``PROFD_*`` environment variables and flags.

Precedence: explicit arguments (CLI flags) > ``PROFD_*`` environment > defaults. Settings wire
the service; what to profile is a :class:`profd.core.request.SessionRequest`, never a setting.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from profd.core.constants import DEFAULT_PORT, DEFAULT_SAVE_SUBDIR

__all__ = ["CoordinatorSettings", "ProfdSettings", "SidecarConfig"]


class CoordinatorSettings(BaseModel):
    """How the coordinator behaves; built by ``profd up`` / ``profd demo`` and passed in."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    save_root: str = Field(description="Absolute default save root; sessions go below it.")
    base_dir: str = Field(description="Directory relative save paths resolve against.")
    poll_timeout_s: float = Field(5.0, gt=0, description="Long-poll duration of agents.")
    heartbeat_timeout_s: float = Field(30.0, gt=0, description="Silence before an agent is lost.")
    align_timeout_s: float = Field(1.0, ge=0, description="Wait for fresh steps (next_steps).")
    align_lead_steps: int = Field(
        1, ge=0, description="Extra steps between the most advanced target and a next_steps window."
    )
    align_lead_s: float = Field(
        0.6,
        ge=0,
        description="And at least this long ahead, by the targets' live step times (fast "
        "steps get more lead steps: their plans must arrive before the window's first step).",
    )
    session_timeout_s: float = Field(86_400.0, gt=0, description="Upper bound of a session.")
    tick_s: float = Field(0.5, gt=0, description="Period of the coordinator's housekeeping.")
    liveness_check_s: float = Field(
        2.0,
        ge=0,
        description="How often the coordinator asks Ray's nodes whether each agent's process "
        "still runs (a dead worker is lost within this long, not after heartbeat_timeout_s); "
        "0 turns it off.",
    )
    state_dir: str | None = Field(None, description="Where the coordinator keeps its state.")
    stacks_py_spy: bool = Field(
        True,
        description="profd stacks may run py-spy on a node to read its processes (it attaches "
        "with ptrace for a moment); False: only the agents' own threads read stacks.",
    )
    gc_young_objects: int = Field(
        0,
        ge=0,
        description="The collector's first threshold (objects allocated between young "
        "collections) in the coordinator's own process: fewer, shorter pauses of every RPC "
        "with a fleet's state in its heap, at some memory (README: the fleet benchmark); the "
        "middle generation is then collected every 20 young collections (Python: 10). 0 "
        "leaves Python's pacing alone. It applies to the whole process that builds the "
        "coordinator: profd up's coordinator actor has its own (PROFD_GC_YOUNG_OBJECTS).",
    )
    relay_forward_min: int = Field(
        64,
        ge=0,
        description="With at least this many node relays to push plans to at once, the "
        "coordinator pushes to one relay of each group of about sqrt(n), which pushes to the "
        "others (profd.actors.relay_forward); 0 turns forwarding off.",
    )


class ProfdSettings(BaseSettings):
    """Settings read from ``PROFD_*`` environment variables."""

    model_config = SettingsConfigDict(env_prefix="PROFD_", frozen=True, extra="ignore")

    state_dir: Path = Field(Path.home() / ".profd", description="Per-user state directory.")
    host: str = Field("127.0.0.1", description="Sidecar bind address.")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="Sidecar port (0 = any free).")
    save_root: Path | None = Field(None, description="Default save root (./outputs/profile).")
    poll_timeout_s: float = 5.0
    heartbeat_timeout_s: float = 30.0
    align_timeout_s: float = 1.0
    align_lead_steps: int = 1
    align_lead_s: float = 0.6
    session_timeout_s: float = 86_400.0
    stacks_py_spy: bool = True
    relay_forward_min: int = 64
    gc_young_objects: int = 0

    def coordinator(self, cwd: Path | None = None) -> CoordinatorSettings:
        base = (cwd or Path.cwd()).resolve()
        root = self.save_root or base / DEFAULT_SAVE_SUBDIR
        root = root if root.is_absolute() else base / root
        return CoordinatorSettings(
            save_root=str(root),
            base_dir=str(base),
            poll_timeout_s=self.poll_timeout_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            align_timeout_s=self.align_timeout_s,
            align_lead_steps=self.align_lead_steps,
            align_lead_s=self.align_lead_s,
            session_timeout_s=self.session_timeout_s,
            state_dir=str(self.state_dir),
            stacks_py_spy=self.stacks_py_spy,
            relay_forward_min=self.relay_forward_min,
            gc_young_objects=self.gc_young_objects,
        )


def _is_port(text: str) -> bool:
    """Whether a Host header's port part is a TCP port (ASCII digits, at most 65535)."""
    return text.isascii() and text.isdigit() and int(text) <= 65535


class SidecarConfig(BaseModel):
    """How the HTTP sidecar is served."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="Bind address; loopback unless told otherwise.")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="Port (0 = any free port).")
    token: str | None = Field(None, description="Bearer token required to change anything.")
    allow_hook_commands: bool = Field(
        False, description="Accept finish_hook_cmd over HTTP (off unless the operator allows)."
    )
    ray_address: str | None = Field(None, description="Ray address when run outside Ray.")
    save_roots: tuple[str, ...] = Field(
        (),
        description="Directories a save_path given over HTTP must resolve under (symlinks and "
        "'..' followed); empty = the coordinator's save root only.",
    )
    upload_prefixes: tuple[str, ...] = Field(
        (),
        description="URI prefixes an upload_uri given over HTTP must start with; empty = "
        "upload_uri is refused over HTTP.",
    )
    base_dir: str | None = Field(
        None,
        description="The coordinator's base directory, against which relative save paths "
        "resolve; unset = a relative save_path is refused over HTTP.",
    )
    max_body_bytes: int = Field(
        1 << 20, gt=0, description="Largest request body accepted; larger gets 413."
    )
    max_window_steps: int = Field(
        10_000,
        gt=0,
        description="Most steps one session may cover over HTTP (next_steps, or the number of "
        "steps listed); larger gets 422 (the coordinator materialises the window).",
    )
    read_cache_s: float = Field(
        0.1,
        ge=0,
        le=5,
        description="Reads of the coordinator (status, listings, a session) are shared by the "
        "requests that arrive within this long: a hundred polling dashboards cost the "
        "coordinator a few calls a second. Any change made through this sidecar clears it; "
        "0 turns it off.",
    )
    freeze_gc: bool = Field(
        False,
        description="Once started, move the objects that exist (imports, the app) to the "
        "collector's permanent generation (gc.freeze), so full collections do not pause "
        "requests for tens of milliseconds; for a process that serves only the sidecar "
        "(`profd up` turns it on).",
    )

    allowed_hosts: tuple[str, ...] = Field(
        (),
        description="Extra names the sidecar answers to in a request's Host header (a guard "
        "against DNS rebinding: a web page a local user opens cannot read the sidecar through "
        "a name of its own). Always answered: the loopback names (localhost, 127.0.0.1 and any "
        "127.x.y.z, ::1 / [::1]) and the bind address `host`; bound to every interface "
        "(0.0.0.0 or ::) that means the loopback names, this machine's host name and fully "
        "qualified name (socket.gethostname() / getfqdn()) and any IP-address literal (a "
        "rebinding page sends its own DNS name, never an address), not every Host. Names "
        "match case-insensitively, with or without a ':port' suffix (IPv6 in brackets); one "
        "name per entry, no scheme, path or wildcard (add each form, e.g. 'profd' and "
        "'profd.ns.svc.cluster.local'). '*' turns the check off: only behind a trusted "
        "reverse proxy that checks Host itself. Anything else gets 400. "
        "`profd up --allow-host NAME` (repeatable).",
    )

    @staticmethod
    def host_name(value: str) -> str | None:
        """A Host header value (or an ``allowed_hosts`` entry, or a bind address) as the name
        it names: lower case, no ``:port``, no IPv6 brackets, no trailing dot; ``None`` when it
        is not one (unclosed bracket, a port that is not a number from 0 to 65535, nothing
        left)."""
        v = value.strip().lower()
        if v.startswith("["):
            end = v.find("]")
            name, rest = v[1:end], v[end + 1 :]
            if end < 0 or ":" not in name or (rest and not (rest[0] == ":" and _is_port(rest[1:]))):
                return None
        elif v.count(":") == 1:
            name, port = v.split(":")
            if not _is_port(port):
                return None
        else:  # a name, or an IPv6 address without brackets (an entry or a bind address)
            name = v
        name = name.removesuffix(".")
        return name or None

    @staticmethod
    def host_is_wildcard(host: str) -> bool:
        """Whether a bind address means every interface (``0.0.0.0``, ``::`` or empty)."""
        return host.strip().strip("[]") in ("", "0.0.0.0", "::")

    @staticmethod
    def host_is_loopback(host: str) -> bool:
        """Whether a bind address only accepts connections from this machine."""
        import ipaddress

        name = host.strip().strip("[]").lower()
        if name in ("localhost", "localhost.", "ip6-localhost"):
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False  # any other host name may be reachable from outside

    @property
    def loopback(self) -> bool:
        """Bound to loopback: reads are open; beyond it every route needs the token."""
        return self.host_is_loopback(self.host)

    @field_validator("allowed_hosts", mode="after")
    @classmethod
    def _host_names(cls, entries: tuple[str, ...]) -> tuple[str, ...]:
        out: list[str] = []
        for entry in entries:
            problem = cls._host_entry_problem(entry)
            if problem:
                raise ValueError(
                    f"allowed_hosts entry {entry!r}: {problem} (one host name per "
                    "`profd up --allow-host NAME`, e.g. --allow-host profd.example.com)"
                )
            name = "*" if entry == "*" else cls.host_name(entry)
            if name not in out:
                out.append(name)  # type: ignore[arg-type]  (checked above)
        return tuple(out)

    @staticmethod
    def _host_entry_problem(entry: str) -> str | None:
        """What is wrong with one ``allowed_hosts`` entry, or ``None``."""
        if entry == "*":
            return None
        if not entry.strip():
            return "must not be empty"
        if any(c.isspace() for c in entry):
            return "must not contain spaces"
        if "://" in entry:
            return "is a URL: give the host name only, without a scheme"
        if any(c in entry for c in "/?#@\\"):
            return "must be a host name only, without a path, query or user"
        if "," in entry:
            return "holds several names: give one per entry"
        if "*" in entry:
            return "must not hold wildcards ('*' alone turns the check off)"
        if SidecarConfig.host_name(entry) is None:
            return "is not a host name (a ':port' suffix must be a number; IPv6 in brackets)"
        return None

    @model_validator(mode="after")
    def _token_beyond_loopback(self) -> SidecarConfig:
        if not self.token and not self.loopback:
            raise ValueError(
                f"host: binding {self.host} (beyond loopback) needs a token; every route then "
                "requires it"
            )
        return self
