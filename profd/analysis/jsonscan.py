"""Streaming access to Chrome / Kineto trace JSON, without ever holding a file parsed at once.

A trace is ``{..header.., "traceEvents": [ {event}, {event}, ... ], ..more header..}`` (or the
bare-array form ``[ {event}, ... ]``). :class:`TraceStream` decompresses a file block by block
(gzip is recognised by its magic bytes, not the extension; multi-member gzip works) and hands
out the ``traceEvents`` array in runs, in one of two ways:

* :meth:`TraceStream.raw_segments` (or :meth:`~TraceStream.raw_runs`) — runs of JSON *text*,
  cut just before a ``"ph"`` key, so the fields of an event head (``"ph"`` … ``"dur"``) are
  never split between two runs. Used by the regular-expression fast path, which checks
  itself (see :mod:`profd.analysis.scan`).
* :meth:`TraceStream.event_lists` — runs of parsed events (orjson). A cut is accepted only if
  the run parses as a JSON array: a cut inside a string or inside a nested value cannot, so a
  parse that succeeds proves the cut is an event boundary.

Either way the header (every top-level key except ``traceEvents``) is in :attr:`header` once
the run generator is exhausted. Memory stays at a few segments, whatever the file size.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

__all__ = ["SEGMENT_BYTES", "TraceReadError", "TraceStream", "iter_blocks", "json_size_hint"]

GZIP_MAGIC = b"\x1f\x8b"
READ_BYTES = 1 << 20
#: Decompressed text handed on at a time. Small runs stay in the CPU cache between the
#: decompressor and the scanner, which is measurably faster than one big buffer.
SEGMENT_BYTES = 512 << 10
#: Give up looking for ``"traceEvents"`` after this much header text (not a trace).
MAX_PREFIX_BYTES = 64 << 20

_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_BOUNDARY = re.compile(rb"\}\s*,\s*\{")
_ARRAY_END = re.compile(rb"\}\s*\]")
_WS = b" \t\r\n"


class TraceReadError(ValueError):
    """A file that cannot be read as a Chrome trace (the reason says why)."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{Path(path).name}: {reason}")
        self.path = str(path)
        self.reason = reason


def json_size_hint(path: Path | str) -> int:
    """Uncompressed size: gzip's ISIZE trailer (exact below 4 GiB, one member), else the size."""
    p = Path(path)
    size = p.stat().st_size
    try:
        with open(p, "rb") as f:
            if f.read(2) != GZIP_MAGIC or size < 18:
                return size
            f.seek(-4, 2)
            return int(struct.unpack("<I", f.read(4))[0])
    except OSError:
        return size


def iter_blocks(path: Path | str, out_bytes: int = SEGMENT_BYTES) -> Iterator[bytes]:
    """Decompressed content of ``path`` in blocks of at most ``out_bytes``."""
    with open(path, "rb") as f:
        magic = f.read(2)
        f.seek(0)
        if magic != GZIP_MAGIC:
            while block := f.read(out_bytes):
                yield block
            return
        yield from _gunzip(f, path, out_bytes)


def _gunzip(f: Any, path: Path | str, out_bytes: int) -> Iterator[bytes]:
    d = zlib.decompressobj(31)
    pending = b""
    try:
        while True:
            src = d.unconsumed_tail or pending or f.read(READ_BYTES)
            pending = b""
            if not src:
                tail = d.flush()
                if tail:
                    yield tail
                if not d.eof:
                    raise TraceReadError(path, "truncated gzip data")
                return
            out = d.decompress(src, out_bytes)
            if out:
                yield out
            if d.eof:
                # Another gzip member may follow (concatenated .gz files are valid gzip).
                rest = d.unused_data + f.read(READ_BYTES)
                if not rest.strip(b"\0"):
                    return
                d = zlib.decompressobj(31)
                pending = rest
    except zlib.error as exc:
        raise TraceReadError(path, f"corrupt gzip data ({exc})") from None


class TraceStream:
    """One trace file, read once, front to back (see the module docstring)."""

    def __init__(self, path: Path | str, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.path = Path(path)
        self.segment_bytes = max(4096, int(segment_bytes))
        #: Top-level keys other than ``traceEvents``; filled when the runs are exhausted.
        self.header: dict[str, Any] = {}
        #: The JSON text before the events array (the header of a Kineto trace).
        self.prefix = b""
        #: Decompressed bytes seen so far.
        self.json_bytes = 0
        self._blocks: Iterator[bytes] | None = None
        self._eof = False

    # -- shared -------------------------------------------------------------------------
    def _next_block(self) -> bytes | None:
        if self._eof:
            return None
        assert self._blocks is not None
        block = next(self._blocks, None)
        if block is None:
            self._eof = True
            return None
        self.json_bytes += len(block)
        return block

    def _more(self, buf: bytearray) -> bool:
        """Append the next block to ``buf``; False at the end of the file."""
        block = self._next_block()
        if block is None:
            return False
        buf += block
        return True

    def _open_array(self) -> bytearray:
        """Read up to the ``[`` that opens the events; return the text after it."""
        self._blocks = iter_blocks(self.path, self.segment_bytes)
        self._eof = False
        self.json_bytes = 0
        buf = bytearray()
        scan = 0
        while True:
            lead = buf.lstrip(_WS)
            if lead[:1] == b"[":  # the bare-array form
                start = len(buf) - len(lead) + 1
                break
            if lead[:1] not in (b"", b"{"):
                raise TraceReadError(self.path, "not JSON: a trace starts with '{' or '['")
            start = self._top_level_key(buf, scan)
            if start is not None:
                break
            scan = max(0, len(buf) - 64)  # the key may straddle two blocks
            if len(buf) > MAX_PREFIX_BYTES or not self._more(buf):
                raise TraceReadError(self.path, "no traceEvents array: not a Chrome trace")
        self.prefix = bytes(buf[:start])
        return buf[start:]

    @staticmethod
    def _top_level_key(buf: bytearray, scan: int) -> int | None:
        """Where the top-level ``"traceEvents": [`` ends, if it is in ``buf``.

        A match is top-level exactly when the text before it, closed with ``]}``, parses: a
        key nested deeper leaves a brace open, one inside a string leaves the string open.
        """
        for m in _EVENTS_KEY.finditer(buf, scan):
            try:
                head = orjson.loads(bytes(buf[: m.end()]) + b"]}")
            except orjson.JSONDecodeError:
                continue
            if isinstance(head, dict) and head.get("traceEvents") == []:
                return m.end()
        return None

    def quick_header(self) -> dict[str, Any]:
        """The header keys that come *before* the events (all of them, for Kineto traces)."""
        if self.prefix.lstrip(_WS)[:1] != b"{":
            return {}
        try:
            head = orjson.loads(self.prefix + b"]}")
        except orjson.JSONDecodeError:
            return {}
        head.pop("traceEvents", None)
        return head

    def _finish_header(self, suffix: bytes) -> bool:
        """Parse prefix + ``]`` + suffix; True when that is a trace whose events were cut out."""
        try:
            doc = orjson.loads(self.prefix + b"]" + suffix)
        except orjson.JSONDecodeError:
            return False
        if isinstance(doc, list):
            if doc:
                return False
            self.header = {}
            return True
        if not isinstance(doc, dict) or doc.get("traceEvents") != []:
            return False
        doc.pop("traceEvents")
        self.header = doc
        return True

    # -- text runs (fast path) --------------------------------------------------------------
    def raw_segments(self) -> Iterator[bytes | memoryview]:
        """Runs of event-array text, each cut just before a ``"ph"`` key."""
        for run in self.raw_runs():
            for text, start, end in run:
                yield memoryview(text)[start:end] if end - start < len(text) else text

    def raw_runs(self) -> Iterator[list[tuple[bytes, int, int]]]:
        """:meth:`raw_segments`, one read block at a time, as pieces ``(text, start, end)``
        to scan in place (``re`` and ``bytes.count`` take a start and an end): the event cut
        at the start of a block is joined to its beginning (a small copy), the rest of the
        block is not copied (a fresh 512 KiB buffer per block costs page faults on top)."""
        carry = bytes(self._open_array())
        while (block := self._next_block()) is not None:
            first = block.find(b'"ph"')
            if first < 0:  # no event starts in this block
                carry += block
                continue
            last = block.rfind(b'"ph"')
            edge = carry + block[:first]
            yield [(edge, 0, len(edge)), (block, first, last)]
            carry = block[last:]
        for rest in self._raw_final(carry):
            yield [(rest, 0, len(rest))]

    def _raw_final(self, rest: bytes) -> Iterator[bytes]:
        """The last event(s) and the closing ``]``: find where the array really ends."""
        stripped = rest.strip(_WS)
        if stripped[:1] in (b"", b"]") and self._finish_header(stripped[1:]):
            return  # no event left: the array was empty or ended at the cut
        # ``rest`` is the last event(s) and the suffix: small. The first "}]" after which the
        # document closes properly is the end of the array (an earlier one, inside an event,
        # would leave that event's braces unbalanced).
        for m in _ARRAY_END.finditer(rest):
            if self._finish_header(rest[m.end() :]):
                yield rest[: m.start() + 1]
                return
        if self.prefix.lstrip(_WS)[:1] == b"[":  # bare arrays may omit the closing bracket
            self.header = {}
            yield stripped.rstrip(_WS).rstrip(b",")
            return
        raise TraceReadError(self.path, "the traceEvents array never closes (truncated file?)")

    # -- parsed runs (generic path) -----------------------------------------------------------
    def event_lists(self) -> Iterator[list[Any]]:
        """Runs of parsed events, cut only where the run parses as a JSON array."""
        buf = self._open_array()
        pos = 0
        while True:
            while len(buf) - pos < self.segment_bytes and self._more(buf):
                pass
            while pos < len(buf) and buf[pos] in _WS:
                pos += 1
            if pos < len(buf) and buf[pos] == 0x5D:  # "]": the array ends here
                self._closing(bytearray(buf[pos + 1 :]))
                return
            found = self._next_cut(buf, pos)
            if found is None:
                yield from self._parsed_final(bytes(buf[pos:]))
                return
            events, nxt = found
            yield events
            del buf[:nxt]
            pos = 0

    def _next_cut(self, buf: bytearray, pos: int) -> tuple[list[Any], int] | None:
        search = pos + self.segment_bytes
        while True:
            m = _BOUNDARY.search(buf, min(search, len(buf)))
            if m is None:
                if self._more(buf):
                    continue
                return None
            cut = m.start() + 1
            try:
                events = orjson.loads(b"[" + bytes(buf[pos:cut]) + b"]")
            except orjson.JSONDecodeError:
                search = cut  # the "}, {" was inside a string or a nested value
                continue
            return events, m.end() - 1

    def _closing(self, suffix: bytearray) -> None:
        while self._more(suffix):
            pass
        if not self._finish_header(bytes(suffix)) and self.prefix.lstrip(_WS)[:1] != b"[":
            raise TraceReadError(self.path, "invalid JSON after the traceEvents array")

    def _parsed_final(self, rest: bytes) -> Iterator[list[Any]]:
        for m in _ARRAY_END.finditer(rest):
            try:
                events = orjson.loads(b"[" + rest[: m.start() + 1] + b"]")
            except orjson.JSONDecodeError:
                continue
            if not self._finish_header(rest[m.end() :]):
                break
            yield events
            return
        if self.prefix.lstrip(_WS)[:1] == b"[":
            body = rest.rstrip(_WS).rstrip(b",")
            try:
                events = orjson.loads(b"[" + body + b"]")
            except orjson.JSONDecodeError:
                raise TraceReadError(self.path, "invalid JSON in the event array") from None
            self.header = {}
            yield events
            return
        raise TraceReadError(self.path, "invalid JSON or truncated traceEvents array")
