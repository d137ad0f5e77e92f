"""A relay's Unix socket: its node's agents make their relay calls over it, not through Ray.

The frames are :mod:`profd.core.relay_wire`'s. Each connection is served by its own task,
one call at a time (an agent's poller and reporter each connect), and a call is the relay's
own method (``register``, ``poll``, ``report``, ``clock_ns``, ``ping``), so a poll parks
exactly as a Ray call to the relay would. A connection that sends something other than a
frame, or comes from another user, is closed; the relay goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from profd.core.relay_wire import (
    AGENT_CALLS,
    HEADER_SIZE,
    WireError,
    body_size,
    check_peer,
    decode,
    encode,
    socket_pid,
)

__all__ = ["RelaySocketServer", "clear_stale_sockets", "serve"]

log = logging.getLogger(__name__)


class RelaySocketServer:
    """Serves ``relay``'s agent calls on the Unix socket ``path`` (made 0600)."""

    def __init__(self, relay: Any, path: Path) -> None:
        self.path = path
        self._relay = relay
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._warned: set[str] = set()
        self.calls = 0

    @property
    def connections(self) -> int:
        return len(self._conns)

    async def start(self) -> None:
        clear_stale_sockets(self.path.parent)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # this process's own, from a server closed uncleanly
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._conns):
                w.close()
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        refused = check_peer(sock) if sock is not None else None
        if refused:
            self._warn("peer", "relay socket %s: refused a connection (%s)", self.path, refused)
            writer.close()
            return
        self._conns.add(writer)
        try:
            while True:
                header = await reader.readexactly(HEADER_SIZE)
                call = decode(await reader.readexactly(body_size(header)))
                writer.write(encode(await self._answer(call)))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the agent went away (its process ended, or it moved to another link)
        except WireError as exc:
            self._warn("wire", "relay socket %s: closed a connection (%s)", self.path, exc)
        finally:
            self._conns.discard(writer)
            writer.close()

    async def _answer(self, call: Any) -> tuple[bool, Any]:
        if not (isinstance(call, tuple) and len(call) == 2 and isinstance(call[1], tuple)):
            return False, "a call is (method, args)"
        method, args = call
        if method not in AGENT_CALLS:
            return False, f"unknown call {method!r}"
        self.calls += 1
        try:
            return True, await getattr(self._relay, method)(*args)
        except Exception as exc:  # the relay's own failure (its coordinator unreachable...)
            return False, f"{type(exc).__name__}: {exc}"

    def _warn(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)


async def serve(relay: Any, node_id: str) -> RelaySocketServer | None:
    """Serve ``relay``'s agent calls on the socket of node ``node_id`` and this process;
    ``None`` when there can be none here (the directory refused, no Unix sockets): its
    agents then call it through Ray."""
    from profd.core.relay_wire import socket_dir, socket_path

    try:
        server = RelaySocketServer(relay, socket_path(socket_dir(), node_id, os.getpid()))
        await server.start()
    except Exception as exc:
        log.warning("relay of node %s: no Unix socket (%s); agents use Ray calls", node_id, exc)
        return None
    return server


def clear_stale_sockets(directory: Path) -> list[Path]:
    """Remove the sockets of relay processes that are gone (killed by ``profd down`` or
    restarted by Ray leave theirs behind); the paths removed."""
    removed = []
    for path in directory.glob("relay-*.sock"):
        pid = socket_pid(path)
        if pid is None or pid == os.getpid() or _alive(pid):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
