"""Waiting for an engine's files to be complete after a window (reference §8.4).

An engine writes its files after ``/stop_profile``, slowly for large runs. A file is complete
when its size and mtime were unchanged for a settle interval and, for ``.gz``, its gzip
stream ends. :func:`wait_for_files` waits for the files that appeared since the window
started (or, for side files rewritten in place, changed since), with an overall timeout;
what is still being written then is *reported*, never dropped. Which files are traces, side
files or an engine's temporaries is decided here too. No Ray or torch import.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from profd.core.clock_hints import WINDOWS_FILE
from profd.core.protocol import IncompleteFile

__all__ = [
    "Baseline",
    "DirWatcher",
    "FlushWait",
    "WaitResult",
    "gzip_complete",
    "is_chrome_trace",
    "is_side_file",
    "is_temp",
    "is_trace_file",
    "snapshot_dir",
    "snapshot_stats",
    "wait_for_files",
]

_TEMP_SUFFIXES = (".tmp", ".part", ".partial", ".swp")
#: What an engine writes that is a trace: Chrome traces and (SGLang) memory snapshots.
_TRACE_SUFFIXES = (".json", ".json.gz", ".pickle")
_CHUNK = 1 << 20


class FlushWait(BaseModel):
    """How long to wait for an engine's files after ``/stop_profile``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    settle_s: float = Field(2.0, gt=0, description="A file is stable after this long unchanged.")
    gz_settle_s: float = Field(
        0.5,
        gt=0,
        description="A .gz file whose gzip stream has ended is complete after this long "
        "unchanged (its end says the writer is done; with check_gzip only).",
    )
    poll_s: float = Field(0.25, gt=0, description="Interval between directory scans.")
    timeout_s: float = Field(
        1800.0, gt=0, description="Give up after this long; unfinished files are reported."
    )
    first_file_timeout_s: float = Field(
        120.0, gt=0, description="Stop waiting when no file at all has appeared by then."
    )
    peer_grace_s: float = Field(
        60.0,
        gt=0,
        description="Once the files seen are complete, how long to wait for missing peers.",
    )
    check_gzip: StrictBool = Field(True, description="A .gz file must end its gzip stream.")

    @model_validator(mode="after")
    def _order(self) -> FlushWait:
        if self.poll_s > self.settle_s:
            raise ValueError(f"poll_s: must be <= settle_s ({self.settle_s}), got {self.poll_s}")
        if self.timeout_s < self.settle_s:
            raise ValueError(
                f"timeout_s: must be >= settle_s ({self.settle_s}), got {self.timeout_s}"
            )
        return self


@dataclass(frozen=True, slots=True)
class WaitResult:
    complete: tuple[Path, ...]
    incomplete: tuple[IncompleteFile, ...]
    waited_s: float
    timed_out: bool
    #: Why the wait ended (for the session's reason / warnings).
    note: str = ""


# -- which files -----------------------------------------------------------------------------


def is_trace_file(name: str) -> bool:
    """Whether an engine file is a trace (else a side file such as ``*.profiler_out.txt``)."""
    return name.lower().endswith(_TRACE_SUFFIXES)


def is_chrome_trace(name: str) -> bool:
    """A timeline, one per GPU worker (what the wait expects and ranks are found by); SGLang's
    ``-memory.pickle`` snapshots are traces too, but extra ones."""
    return name.lower().endswith((".json", ".json.gz"))


def is_side_file(name: str) -> bool:
    """Neither a trace nor an engine's temporary file (a trace still being written)."""
    return not is_trace_file(name) and not is_temp(name)


def is_temp(name: str) -> bool:
    return name.startswith(".") or name.lower().endswith(_TEMP_SUFFIXES)


# -- waiting --------------------------------------------------------------------------------


Baseline = frozenset[str] | Mapping[str, tuple[int, int]]


def snapshot_stats(directory: str | Path) -> dict[str, tuple[int, int]]:
    """Name → (size, mtime ns) of the files in ``directory`` now: a window's baseline. A side
    file the engine rewrites in place under the same name (vLLM's ``*.profiler_out.txt``)
    counts as new once it changed; a trace (named anew by every export) never does."""
    out: dict[str, tuple[int, int]] = {}
    try:
        with os.scandir(directory) as it:
            for e in it:
                try:
                    if e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        out[e.name] = (st.st_size, st.st_mtime_ns)
                except FileNotFoundError:
                    continue
    except (FileNotFoundError, NotADirectoryError):
        pass
    return out


def snapshot_dir(directory: str | Path) -> frozenset[str]:
    """Names of the files in ``directory`` now (empty when it does not exist)."""
    try:
        with os.scandir(directory) as it:
            return frozenset(e.name for e in it if e.is_file(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return frozenset()


def gzip_complete(path: str | Path) -> bool:
    """Whether ``path`` holds a gzip stream that reaches its end (decompresses in chunks)."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                d.decompress(chunk)
                if d.eof:
                    return True
    except (OSError, zlib.error):
        return False
    return d.eof


@dataclass
class _Seen:
    size: int
    mtime_ns: int
    changed_at: float
    gzip_ok: bool | None = None


class DirWatcher:
    """Tracks the new files of one directory between scans (one window's files).

    :meth:`freeze` fixes which files are the window's: the engine's next window starts,
    and the files that appear from then on are that one's (a replica starts its next
    window while this one's files settle). Scans may run on another thread."""

    def __init__(self, directory: Path, baseline: Baseline, check_gzip: bool) -> None:
        self.directory = directory
        self.baseline = baseline
        self._stats = baseline if isinstance(baseline, Mapping) else {}
        self.check_gzip = check_gzip
        self.seen: dict[str, _Seen] = {}
        self.last_new_at: float | None = None
        self.frozen = False
        #: Files that changed after the freeze (rewritten in place): the next window's now.
        self.given_up: list[str] = []
        self._lock = threading.Lock()

    def freeze(self, now: float) -> None:
        """Scan once more, then take no new file; those it holds are whole (only the watcher
        of a window whose engine wrote its files before its stop returned is frozen)."""
        with self._lock:
            self._scan(now)
            self.frozen = True

    def _is_new(self, name: str, st: os.stat_result) -> bool:
        if name == WINDOWS_FILE:  # profd's own (an earlier window's collection writes it)
            return False
        if name not in self.baseline:
            return True
        before = self._stats.get(name)
        return (
            before is not None
            and not is_trace_file(name)
            and before != (st.st_size, st.st_mtime_ns)
        )

    def scan(self, now: float) -> dict[str, _Seen]:
        """Look again; the files it holds now (a copy: :meth:`freeze` may run meanwhile)."""
        with self._lock:
            self._scan(now)
            return dict(self.seen)

    def _scan(self, now: float) -> None:
        current: dict[str, os.stat_result] = {}
        try:
            with os.scandir(self.directory) as it:
                for e in it:
                    if not e.is_file(follow_symlinks=False):
                        continue
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if self._is_new(e.name, st):
                        current[e.name] = st
        except (FileNotFoundError, NotADirectoryError):
            pass
        for name in list(self.seen):
            if name not in current:
                del self.seen[name]  # renamed or removed by the engine (a temporary file)
        for name, st in current.items():
            old = self.seen.get(name)
            if old is None:
                if self.frozen:
                    continue  # the next window's
                self.seen[name] = _Seen(st.st_size, st.st_mtime_ns, now)
                self.last_new_at = now
            elif (old.size, old.mtime_ns) != (st.st_size, st.st_mtime_ns):
                if self.frozen:
                    # whole at the freeze, so rewritten in place (vLLM's side file) by the
                    # next window: its content is that window's now, never this one's
                    del self.seen[name]
                    self.given_up.append(name)
                    continue
                self.seen[name] = _Seen(st.st_size, st.st_mtime_ns, now)

    def status(self, name: str, s: _Seen, now: float, settle_s: float, gz_settle_s: float) -> str:
        """``""`` when ``name`` (as ``s`` saw it) is complete, else why not. A gzip file's
        ended stream is the writer's own word that it is done: a shorter quiet time does
        then."""
        if is_temp(name):
            return "the engine's temporary file (still being written)"
        quiet = now - s.changed_at
        gz = self.check_gzip and name.lower().endswith(".gz")
        # frozen: the engine's stop returned with its files written (only such a window's
        # watcher is frozen) and its next window started; no quiet time to wait out
        if not self.frozen and quiet < (min(settle_s, gz_settle_s) if gz else settle_s):
            return f"still changing ({s.size} bytes, last change {quiet:.1f}s before the end)"
        if gz:
            if s.gzip_ok is None:
                s.gzip_ok = gzip_complete(self.directory / name)
            if not s.gzip_ok:
                return f"gzip stream not finished ({s.size} bytes)"
        return ""


def wait_for_files(
    directory: str | Path,
    baseline: Iterable[str] | Mapping[str, tuple[int, int]],
    policy: FlushWait,
    expected: int | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    watcher: DirWatcher | None = None,
) -> WaitResult:
    """Wait until the files new in ``directory`` (not in ``baseline``, or side files changed
    since a :func:`snapshot_stats` baseline) are complete. ``watcher``: one made (and
    maybe frozen) already for that directory and baseline.

    Ends when every file seen is complete and either ``expected`` traces exist (side files
    are waited for but not counted) or no new file
    appeared for ``peer_grace_s``; or when no file at all appeared within
    ``first_file_timeout_s``; or at ``timeout_s``, returning what is complete and reporting
    the rest.
    """
    base = baseline if isinstance(baseline, Mapping) else frozenset(baseline)
    w = watcher or DirWatcher(Path(directory), base, policy.check_gzip)
    start = clock()
    while True:
        now = clock()
        frozen = w.frozen  # (read first: a freeze's last scan is in what follows)
        seen = w.scan(now)
        status = {
            n: w.status(n, seen[n], now, policy.settle_s, policy.gz_settle_s) for n in sorted(seen)
        }
        complete = [n for n, why in status.items() if not why]
        elapsed = now - start
        note = ""
        traces = sum(is_chrome_trace(n) for n in status)
        if status and len(complete) == len(status):
            if expected is None or traces >= expected:
                return _result(w, seen, complete, status, elapsed, False, note)
            if frozen or now - (w.last_new_at or start) >= policy.peer_grace_s:
                note = f"{traces} of {expected} expected trace file(s) appeared"
                if frozen:
                    note += " before the engine's next window started"
                return _result(w, seen, complete, status, elapsed, False, note)
        elif not status and (frozen or elapsed >= policy.first_file_timeout_s):
            note = (
                "no file appeared before the engine's next window started"
                if frozen
                else f"no file appeared within {policy.first_file_timeout_s:g}s"
            )
            return _result(w, seen, [], status, elapsed, False, note)
        if elapsed >= policy.timeout_s:
            note = f"files still incomplete after {policy.timeout_s:g}s"
            return _result(w, seen, complete, status, elapsed, True, note)
        sleep(policy.poll_s)


def _result(
    w: DirWatcher,
    seen: dict[str, _Seen],
    complete: list[str],
    status: dict[str, str],
    elapsed: float,
    timed_out: bool,
    note: str,
) -> WaitResult:
    incomplete = tuple(
        IncompleteFile(str(w.directory / n), why, seen[n].size) for n, why in status.items() if why
    )
    return WaitResult(
        complete=tuple(w.directory / n for n in complete),
        incomplete=incomplete,
        waited_s=round(elapsed, 3),
        timed_out=timed_out,
        note=note,
    )
