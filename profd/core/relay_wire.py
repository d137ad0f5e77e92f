"""The node-local hop between an agent and its node's relay: a Unix socket.

A Ray actor call costs each side about a millisecond of CPU here whatever it carries; a
node's agents long-poll their relay all the time, so that hop goes over a Unix socket the
relay serves instead (:mod:`profd.actors.relay_socket`, :class:`profd.agent.relay_link.SocketLink`).

Frames: a 4-byte big-endian length, then a pickle. A call is ``(method, args)``; its answer
``(True, value)`` or ``(False, "what went wrong")``. One call at a time on a connection (an
agent's poller and reporter threads each hold their own).

Only the user who runs the relay can connect: the socket lives in a directory of its own
(mode 0700, checked, never followed through a link), the file is 0600, and the relay checks
each peer's uid (``SO_PEERCRED``) where the platform has it. Unpickling resolves only
profd's message types (dataclasses, enums and pydantic models of ``profd.``), never a
function, so a frame cannot run code.

No Ray import.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import socket
import stat
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from profd.core.protocol import fast_pickle

__all__ = [
    "AGENT_CALLS",
    "MAX_FRAME",
    "RelayHello",
    "WireError",
    "check_peer",
    "decode",
    "encode",
    "recv_frame",
    "socket_dir",
    "socket_path",
]

#: The relay calls an agent may make over the socket (the CoordinatorLink calls and ping).
AGENT_CALLS = frozenset({"register", "poll", "report", "clock_ns", "ping"})
#: The largest frame either side accepts (an agent's batch is at most 1,000 events).
MAX_FRAME = 64 * 1024 * 1024
_HEADER = struct.Struct("!I")
#: Ray node ids are 56 hex characters; a socket path must stay under ~100 bytes.
_NODE_CHARS = 16


class WireError(Exception):
    """A frame that is not one (too large, cut short, or not a profd message)."""


@fast_pickle
@dataclass(frozen=True, slots=True)
class RelayHello:
    """A relay's answer to ``ping``: where its agents reach it without Ray (``None``: only
    through Ray calls; a relay of an older profd answers ``"ok"``)."""

    socket_path: str | None = None


def encode(obj: Any) -> bytes:
    """One frame: length, then the pickle."""
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if len(body) > MAX_FRAME:
        raise WireError(f"a frame of {len(body)} bytes is over {MAX_FRAME}")
    return _HEADER.pack(len(body)) + body


def body_size(header: bytes) -> int:
    """The length a frame's 4-byte header announces (checked against :data:`MAX_FRAME`)."""
    (n,) = _HEADER.unpack(header)
    if n > MAX_FRAME:
        raise WireError(f"a frame of {n} bytes is over {MAX_FRAME}")
    return n


HEADER_SIZE = _HEADER.size


#: The message types resolved so far, by (module, name): every frame names a few.
_resolved: dict[tuple[str, str], type] = {}


class _Messages(pickle.Unpickler):
    """Resolves profd's message types only: a dataclass, enum or pydantic model defined in a
    ``profd.`` module (constructing one runs no code of the sender's choosing)."""

    def find_class(self, module: str, name: str) -> Any:
        cls = _resolved.get((module, name))
        if cls is not None:
            return cls
        if module == "profd" or module.startswith("profd."):
            obj = super().find_class(module, name)
            if isinstance(obj, type) and _is_message(obj):
                _resolved[(module, name)] = obj
                return obj
        raise WireError(f"{module}.{name} is not a profd message type")


def _is_message(cls: type) -> bool:
    if dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum):
        return True
    try:
        from pydantic import BaseModel
    except ImportError:  # pragma: no cover - pydantic is a dependency
        return False
    return issubclass(cls, BaseModel)


def decode(body: bytes) -> Any:
    """A frame's pickle, with :class:`_Messages`' restrictions."""
    try:
        return _Messages(io.BytesIO(body)).load()
    except WireError:
        raise
    except Exception as exc:  # truncated or garbled
        raise WireError(f"not a frame: {type(exc).__name__}: {exc}") from exc


def recv_frame(sock: socket.socket) -> Any:
    """Read one frame from a blocking socket (its own timeout applies)."""
    n = body_size(_recv_exactly(sock, HEADER_SIZE))
    return decode(_recv_exactly(sock, n))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError("the relay closed the connection")
        got += k
    return bytes(buf)


def socket_dir() -> Path:
    """The directory relays put their sockets in: ``PROFD_RELAY_SOCKET_DIR``, else
    ``<tmp>/profd-<uid>``; made 0700 when missing. Raises ``PermissionError`` when it is a
    link, not a directory, another user's, or open to others (nothing is served there)."""
    configured = os.environ.get("PROFD_RELAY_SOCKET_DIR")
    path = Path(configured) if configured else Path(tempfile.gettempdir()) / f"profd-{os.getuid()}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{path} is not a directory")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not {os.getuid()}")
    if st.st_mode & 0o077:
        raise PermissionError(f"{path} is open to other users (mode {st.st_mode & 0o777:o})")
    return path


def socket_path(directory: Path, node_id: str, pid: int) -> Path:
    """A relay's socket: its node and process (a relay Ray restarts gets a new one)."""
    return directory / f"relay-{node_id[:_NODE_CHARS]}-{pid}.sock"


def socket_pid(path: Path) -> int | None:
    """The relay process a socket file names (``None``: not a relay socket)."""
    stem = path.name
    if not (stem.startswith("relay-") and stem.endswith(".sock")):
        return None
    tail = stem[: -len(".sock")].rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def check_peer(sock: socket.socket) -> str | None:
    """Why the process at the other end of a Unix socket may not talk to this one (another
    user), or ``None``. Where ``SO_PEERCRED`` is missing the directory's mode decides."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return None if uid == os.getuid() else f"peer uid {uid} is not {os.getuid()}"
