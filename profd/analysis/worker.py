"""A process that runs analysis calls sent to it: ``python -m profd.analysis.worker``.

The sidecar's summary worker (``profd.api.summaries``). It is started as a plain interpreter
on this module, not by ``multiprocessing``: a spawned child imports its parent's main module
again, and inside a Ray actor that is Ray's worker script (seconds of imports, and Ray's
memory, before the first summary). This one imports only what the calls need.

Each request on stdin and each answer on stdout is one frame: an 8-byte big-endian length,
then a pickle. A request is ``(function, args, kwargs)``; the answer ``(True, value)`` or
``(False, exception)``. The process lowers its own priority by :data:`NICE` at start, and ends
when stdin closes (its sidecar stopped or died). Both ends are processes of the same user;
the pipe is private to them.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
from typing import IO, Any

__all__ = ["HEADER", "NICE", "encode", "main"]

#: How much lower the worker's CPU priority is than its parent's (``nice``).
NICE = 10
#: A frame's length prefix.
HEADER = struct.Struct("!Q")


def encode(obj: Any) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def _read(stream: IO[bytes], n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _answer(request: bytes) -> bytes:
    try:
        fn, args, kwargs = pickle.loads(request)
        return encode((True, fn(*args, **kwargs)))
    except Exception as exc:
        try:
            return encode((False, exc))
        except Exception:  # an exception that does not pickle: its text
            return encode((False, RuntimeError(f"{type(exc).__name__}: {exc}")))


def main() -> int:
    # The frames own fd 1; anything else printed (a library's warning) goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        os.nice(NICE)
    except OSError:  # not allowed here: the same priority, still off the sidecar's GIL
        pass
    stdin = sys.stdin.buffer
    while True:
        header = _read(stdin, HEADER.size)
        if header is None:
            return 0
        request = _read(stdin, HEADER.unpack(header)[0])
        if request is None:
            return 0
        out.write(_answer(request))
        out.flush()


if __name__ == "__main__":
    sys.exit(main())
