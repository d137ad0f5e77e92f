"""Writing trace files: compress off the training thread, publish without ever overwriting.

Files are written under a temporary name and then *linked* to their final name; ``os.link``
fails when the name exists, so two writers can never replace each other's trace. On a
collision the next free ``_part<N>`` name is taken (the ``_part`` suffix of the grammar).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
import zlib
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "TRACE_EXT",
    "file_size",
    "free_name",
    "gzip_file",
    "link_new",
    "publish_unique",
    "read_chunk",
    "temp_path",
]

log = logging.getLogger(__name__)

TRACE_EXT = ".json.gz"
_CHUNK = 1 << 20


def temp_path(save_dir: Path, stem: str, ext: str) -> Path:
    """A hidden, process-unique temporary path next to the final file."""
    return save_dir / f".{stem}.{os.getpid()}.{uuid.uuid4().hex[:12]}{ext}.tmp"


def gzip_file(
    src: Path,
    dst: Path,
    level: int = 6,
    find: Sequence[re.Pattern[bytes]] = (),
    replace: Sequence[tuple[bytes, bytes]] = (),
) -> tuple[bool, ...]:
    """gzip ``src`` into ``dst`` in 1 MiB chunks; return whether each of ``find`` matched
    anywhere.

    Level 6 is about 13x faster than the level 9 torch uses for ``.json.gz`` and within about
    10 % of its size on Kineto JSON. ``find`` is searched on the way (chunks overlap by 256
    bytes so a match across a chunk boundary is not missed), each pattern until it matches.
    ``replace``: ``(old, new)`` pairs; each swaps every ``old`` for ``new`` on the way, across
    chunk boundaries too, in order (a pair sees what the pairs before it left).
    """
    comp = zlib.compressobj(level, zlib.DEFLATED, 31)  # wbits 31 = gzip container
    found = [False] * len(find)
    tail = b""
    pending = [b""] * len(replace)  # per pair: the held-back tail that may begin its ``old``
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(_CHUNK):
            if not all(found):
                text = tail + chunk
                found = [f or p.search(text) is not None for p, f in zip(find, found, strict=True)]
                tail = chunk[-256:]
            for i, (old, new) in enumerate(replace):
                chunk, pending[i] = _swap(pending[i] + chunk, old, new)
            fout.write(comp.compress(chunk))
        rest = b""  # at the end each pair's tail, then what the pairs before it let out
        for i, (old, new) in enumerate(replace):
            out, held = _swap(pending[i] + rest, old, new)
            rest = out + held
        fout.write(comp.compress(rest))
        fout.write(comp.flush())
    return tuple(found)


def _swap(buf: bytes, old: bytes, new: bytes) -> tuple[bytes, bytes]:
    """``buf`` with every whole ``old`` swapped, and the tail that may begin one (held back)."""
    out: list[bytes] = []
    start = 0
    while (at := buf.find(old, start)) != -1:
        out += (buf[start:at], new)
        start = at + len(old)
    # no whole match starts at or after ``start``: only the last len(old)-1 bytes can begin one
    cut = max(start, len(buf) - len(old) + 1)
    out.append(buf[start:cut])
    return b"".join(out), buf[cut:]


def free_name(
    save_dir: Path, stem: str, suffix: str, ext: str = TRACE_EXT, index: int = 0
) -> tuple[Path, int]:
    """The first name from ``index`` on (``_part<N>`` after the first) that no file has yet."""
    while True:
        extra = f"_part{index}" if index else ""
        candidate = save_dir / f"{stem}{suffix}{extra}{ext}"
        if not os.path.lexists(candidate):
            return candidate, index
        index += 1


def link_new(tmp: Path, final: Path) -> bool:
    """Give ``tmp`` the name ``final`` unless a file has it; ``tmp`` is removed on success."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        return False
    except OSError:
        # Filesystems without hard links: exclusive create, then copy.
        try:
            with open(final, "xb") as out, open(tmp, "rb") as src:
                shutil.copyfileobj(src, out, _CHUNK)
        except FileExistsError:
            return False
    tmp.unlink(missing_ok=True)
    return True


def publish_unique(tmp: Path, save_dir: Path, stem: str, suffix: str, ext: str = TRACE_EXT) -> Path:
    """Give ``tmp`` its final name without replacing any existing file; remove ``tmp``."""
    save_dir.mkdir(parents=True, exist_ok=True)
    index = 0
    while True:
        candidate, index = free_name(save_dir, stem, suffix, ext, index)
        if link_new(tmp, candidate):
            return candidate
        index += 1  # taken between the look and the link


def file_size(path: str) -> int | None:
    """Size of a file on this node, or ``None`` when it is not there (runs on its node)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def read_chunk(path: str, offset: int, size: int) -> bytes:
    """``size`` bytes of a file from ``offset`` (runs on the node that holds the file)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)
