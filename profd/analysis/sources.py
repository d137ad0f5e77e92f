"""Which files of a session directory are traces, and whose track each one is.

Identity comes from the trace itself when profd wrote it (``profd`` and ``distributedInfo``
keys), else from the file name: profd's stem grammar (:func:`profd.core.naming.parse_trace_name`)
or a relocated rollout-engine file (``rollout-replica<n>[-globalrank<g>]_<engine name>``).
A file that matches neither is still a track, labelled by its file name — nothing found in
the directory is dropped without saying so.

Pure functions; no Ray, torch or numpy.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from profd.core.naming import PAR_KEYS, parse_trace_name

__all__ = [
    "TrackIdentity",
    "discover",
    "identify",
    "is_trace_name",
    "topology_text",
]

TRACE_SUFFIXES = (".json", ".json.gz")
_ROLLOUT = re.compile(
    r"^rollout-replica(?P<replica>\d+)(?:-globalrank(?P<grank>\d+))?_(?P<rest>.+)$"
)
ROLLOUT_ROLE = "rollout"


def is_trace_name(name: str) -> bool:
    """A visible ``.json`` / ``.json.gz`` file (profd's temporaries are hidden ``.tmp`` files)."""
    return not name.startswith(".") and name.endswith(TRACE_SUFFIXES)


def discover(directory: Path | str) -> list[Path]:
    """Trace files directly inside ``directory`` (the session layout is flat), sorted by name."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"path: {root} is not a directory")
    return sorted(p for p in root.iterdir() if p.is_file() and is_trace_name(p.name))


def topology_text(topology: Mapping[str, Any] | None) -> str:
    """``tp0-dp1``: the parallel coordinates in the file-name order, then any others."""
    topo = dict(topology or {})
    keys = [k for k in PAR_KEYS if k in topo] + sorted(k for k in topo if k not in PAR_KEYS)
    return "-".join(f"{k}{topo[k]}" for k in keys)


@dataclass(frozen=True, slots=True)
class TrackIdentity:
    """Whose timeline a file belongs to. Files with the same :attr:`key` share one track."""

    key: str
    kind: str  # "rank" (profd / grammar), "rollout", or "file"
    role: str | None
    rank: int | None
    world_size: int | None = None
    topology: dict[str, int] = field(default_factory=dict)
    hostname: str | None = None
    node_id: str | None = None
    replica: int | None = None
    session_id: str | None = None
    step: int | None = None
    scope: str | None = None
    from_metadata: bool = False

    @property
    def label(self) -> str:
        """``actor_rollout_ref rank 0 (tp0-dp1) @host``, ``rollout replica 1 globalrank 4``."""
        if self.kind == "rollout":
            text = f"{ROLLOUT_ROLE} replica {self.replica}"
            if self.rank is not None:
                text += f" globalrank {self.rank}"
        elif self.kind == "rank":
            text = f"{self.role} rank {self.rank}" if self.role else f"rank {self.rank}"
            topo = topology_text(self.topology)
            if topo:
                text += f" ({topo})"
        else:
            text = self.key.split(":", 1)[1]
        if self.hostname:
            text += f" @{self.hostname}"
        return text


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _step(value: str | None) -> int | None:
    """A file name's step field: digits, or something else (a sanitized label) -> None."""
    return int(value) if value and value.isdigit() else None


def identify(name: str, header: Mapping[str, Any] | None = None) -> TrackIdentity:
    """The track of file ``name``, from its header when profd wrote it, else from the name."""
    header = header or {}
    meta = header.get("profd") if isinstance(header.get("profd"), dict) else None
    dist = header.get("distributedInfo") if isinstance(header.get("distributedInfo"), dict) else {}
    host = header.get("host_name") if isinstance(header.get("host_name"), str) else None
    rollout = _ROLLOUT.match(name)
    if meta is not None and _int(meta.get("rank")) is not None:
        role = str(meta.get("role") or "")
        rank = _int(meta.get("rank"))
        topo = {
            str(k): int(v) for k, v in (meta.get("topology") or {}).items() if _int(v) is not None
        }
        return TrackIdentity(
            key=f"rank:{role}:{rank}",
            kind="rank",
            role=role or None,
            rank=rank,
            world_size=_int(meta.get("world_size")) or _int(dist.get("world_size")),
            topology=topo,
            hostname=meta.get("hostname") or host,
            node_id=meta.get("node_id"),
            session_id=meta.get("session_id"),
            step=_int(meta.get("step")),
            scope=meta.get("scope"),
            from_metadata=True,
        )
    if rollout is not None:
        replica = int(rollout.group("replica"))
        grank = _int(rollout.group("grank"))
        if grank is None:
            grank = _int(dist.get("rank"))
        key = f"rollout:{replica}:{'' if grank is None else grank}"
        return TrackIdentity(
            key=key, kind="rollout", role=ROLLOUT_ROLE, rank=grank, replica=replica, hostname=host
        )
    parts = parse_trace_name(name)
    if parts is not None:
        role = parts.head[0] if parts.head else None
        scope = parts.head[1] if len(parts.head) > 1 else None
        return TrackIdentity(
            key=f"rank:{role or ''}:{parts.rank}",
            kind="rank",
            role=role,
            rank=parts.rank,
            world_size=parts.world_size or _int(dist.get("world_size")),
            topology=dict(parts.parallel),
            hostname=host,
            step=_step(parts.step),
            scope=scope,
        )
    rank = _int(dist.get("rank"))
    return TrackIdentity(key=f"file:{name}", kind="file", role=None, rank=rank, hostname=host)
