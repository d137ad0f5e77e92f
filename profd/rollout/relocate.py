"""Bringing an engine's trace files into the session directory (reference §8.4, with fixes).

An engine writes one file per GPU worker (plus, for some versions, a front-end file) into its
own directory, named its own way. After a window:

1. :func:`wait_for_files` waits until the files that appeared since the window started are
   complete: size and mtime unchanged for a settle interval and, for ``.gz``, a finished gzip
   stream. Engines flush slowly (minutes for large runs), so the wait has an overall timeout;
   what is still being written then is *reported*, never dropped or moved half-written.
2. :func:`relocate_files` names each complete file by replica and, when the engine's per-GPU
   rank can be read unambiguously from the name, by global GPU rank:
   ``rollout-replica<n>-globalrank<g>_<engine file>``, else ``rollout-replica<n>_<engine file>``.
   Files of requested global ranks (or every file, without a keep set) go up into the session
   directory; tp peers go to ``<session>/rollout-replica<n>/`` under the engine's own name.
   Files are published with ``os.link`` (or an exclusive create), so nothing is overwritten;
   a taken name gets the next free ``_part<N>``.
3. Files that are not traces (vLLM's ``*.profiler_out.txt`` tables, anything but a Chrome
   trace or a memory snapshot) are kept beside the replica's files in
   ``<session>/rollout-replica<n>/`` under their own name, and are never indexed, counted or
   expected as traces.

Unlike verl, vLLM replicas with dp or pp above 1 are ambiguous too (verl §13 item 11): vLLM's
``-rank-<k>`` is the worker's rank inside one data-parallel engine, not the GPU's offset in the
replica. No Ray or torch import.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from profd.core.protocol import IncompleteFile
from profd.rollout.replicas import ReplicaParallelism

__all__ = [
    "FlushWait",
    "IncompleteFile",
    "LocalRank",
    "RelocatedFile",
    "RelocationResult",
    "WaitResult",
    "collect_engine_files",
    "gzip_complete",
    "is_chrome_trace",
    "is_side_file",
    "is_trace_file",
    "read_local_rank",
    "relocate_files",
    "replica_subdir_name",
    "rollout_trace_name",
    "snapshot_dir",
    "snapshot_stats",
    "wait_for_files",
]

log = logging.getLogger(__name__)

# SGLang's EP part is derived from the tp rank (tp_rank // (tp / ep)), so only DP and PP make
# TP-<k> ambiguous.
_MULTI_DIM = re.compile(r"(?:^|[-_.])(?:DP|PP)-\d+", re.IGNORECASE)
_SGLANG_TP = re.compile(r"(?:^|[-_.])TP-(\d+)", re.IGNORECASE)
_VLLM_RANK = re.compile(r"(?:^|[-_.])rank[-_]?(\d+)", re.IGNORECASE)
# vLLM's worker suffix where it can name every group (MoE models):
# dp<d>_pp<p>_tp<t>_dcp<c>_ep<e>_rank<g>; dcp and ep split the tp GPUs, so do not add any.
_VLLM_COORDS = re.compile(
    r"(?:^|[-_.])dp(?P<dp>\d+)_pp(?P<pp>\d+)_tp(?P<tp>\d+)_dcp\d+_ep\d+_rank\d+(?:[-_.]|$)",
    re.IGNORECASE,
)
#: Compound extensions kept at the end when a ``_part<N>`` is inserted.
_EXTS = (
    ".pt.trace.json.gz",
    ".pt.trace.json",
    ".trace.json.gz",
    ".trace.json",
    ".json.gz",
    ".json",
    ".pickle",
    ".txt",
    ".gz",
)
_TEMP_SUFFIXES = (".tmp", ".part", ".partial", ".swp")
#: What an engine writes that is a trace: Chrome traces and (SGLang) memory snapshots.
_TRACE_SUFFIXES = (".json", ".json.gz", ".pickle")
_CHUNK = 1 << 20


class FlushWait(BaseModel):
    """How long to wait for an engine's files after ``/stop_profile``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    settle_s: float = Field(2.0, gt=0, description="A file is stable after this long unchanged.")
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
class LocalRank:
    """The engine's per-GPU rank read from a file name, or ``None`` with the reason."""

    rank: int | None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RelocatedFile:
    """One engine file after relocation. ``surfaced``: it went up into the session directory
    (else it is a peer kept in the replica sub-directory)."""

    source_name: str
    path: str
    replica: int
    global_rank: int | None
    local_rank: int | None
    bytes: int
    surfaced: bool
    #: Why no global rank was read (empty when it was).
    rank_note: str = ""


@dataclass(frozen=True, slots=True)
class WaitResult:
    complete: tuple[Path, ...]
    incomplete: tuple[IncompleteFile, ...]
    waited_s: float
    timed_out: bool
    #: Why the wait ended (for the session's reason / warnings).
    note: str = ""


@dataclass(frozen=True, slots=True)
class RelocationResult:
    moved: tuple[RelocatedFile, ...] = ()
    kept_in_subdir: tuple[RelocatedFile, ...] = ()
    incomplete: tuple[IncompleteFile, ...] = ()
    warnings: tuple[str, ...] = field(default=())
    #: Files that are not traces, kept in the replica sub-directory (paths).
    side_files: tuple[str, ...] = ()

    @property
    def files(self) -> tuple[RelocatedFile, ...]:
        return self.moved + self.kept_in_subdir


# -- names ----------------------------------------------------------------------------------


def read_local_rank(name: str, parallelism: ReplicaParallelism) -> LocalRank:
    """The GPU's offset inside its replica, read from an engine file name.

    vLLM names MoE workers by every group (``dp<d>_pp<p>_tp<t>_dcp<c>_ep<e>_rank<g>``), which
    gives the offset for any layout. SGLang writes ``TP-<k>`` (and ``DP-``/``PP-``/``EP-`` when
    those are on; ``EP-`` follows from the tp rank and leaves ``TP-<k>`` the offset); vLLM writes
    ``rank-<k>`` (``rank<k>``, ``rank_<k>``); each token must start the name or follow ``-``,
    ``_`` or ``.``. The rank is only trusted when it is the single rank token in the name and
    the replica is tp-only.
    """
    coords = _VLLM_COORDS.findall(name)
    if len(coords) == 1:
        return _from_coords(*(int(v) for v in coords[0]), parallelism)
    if _MULTI_DIM.search(name):
        return LocalRank(None, "the name carries a DP/PP marker")
    found = {int(k) for k in _SGLANG_TP.findall(name)}
    if not found:
        found = {int(k) for k in _VLLM_RANK.findall(name)}
    if not found:
        return LocalRank(None, "no engine rank in the name")
    if len(found) > 1:
        return LocalRank(None, f"several engine ranks in the name ({sorted(found)})")
    if parallelism.dp > 1 or parallelism.pp > 1:
        return LocalRank(
            None,
            f"the replica has dp={parallelism.dp}, pp={parallelism.pp}: the engine's rank in "
            f"the name is not the GPU's offset in the replica",
        )
    (k,) = found
    if k >= parallelism.world_size:
        return LocalRank(
            None, f"engine rank {k} is outside the replica ({parallelism.world_size} GPUs)"
        )
    return LocalRank(k)


def _from_coords(dp: int, pp: int, tp: int, par: ReplicaParallelism) -> LocalRank:
    """The GPU's offset from vLLM's explicit dp / pp / tp ranks (dp-major, then pp, then tp)."""
    if dp >= par.dp or pp >= par.pp or tp >= par.tp:
        return LocalRank(
            None,
            f"dp{dp}_pp{pp}_tp{tp} is outside the replica (dp={par.dp}, pp={par.pp}, tp={par.tp})",
        )
    return LocalRank((dp * par.pp + pp) * par.tp + tp)


def rollout_trace_name(replica: int, name: str, global_rank: int | None = None) -> str:
    if global_rank is None:
        return f"rollout-replica{replica}_{name}"
    return f"rollout-replica{replica}-globalrank{global_rank}_{name}"


def replica_subdir_name(replica: int) -> str:
    return f"rollout-replica{replica}"


def _split_ext(name: str) -> tuple[str, str]:
    lower = name.lower()
    for ext in _EXTS:
        if lower.endswith(ext) and len(name) > len(ext):
            return name[: -len(ext)], name[-len(ext) :]
    stem, dot, ext = name.rpartition(".")
    return (stem, dot + ext) if stem else (name, "")


def is_trace_file(name: str) -> bool:
    """Whether an engine file is a trace (else a side file such as ``*.profiler_out.txt``)."""
    return name.lower().endswith(_TRACE_SUFFIXES)


def is_chrome_trace(name: str) -> bool:
    """A timeline, one per GPU worker (what the wait expects and ranks are found by); SGLang's
    ``-memory.pickle`` snapshots are traces too, but extra ones."""
    return name.lower().endswith((".json", ".json.gz"))


def is_side_file(name: str) -> bool:
    """Neither a trace nor an engine's temporary file (a trace still being written)."""
    return not is_trace_file(name) and not _is_temp(name)


def _is_temp(name: str) -> bool:
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


class _Watcher:
    """Tracks the new files of one directory between scans."""

    def __init__(self, directory: Path, baseline: Baseline, check_gzip: bool) -> None:
        self.directory = directory
        self.baseline = baseline
        self._stats = baseline if isinstance(baseline, Mapping) else {}
        self.check_gzip = check_gzip
        self.seen: dict[str, _Seen] = {}
        self.last_new_at: float | None = None

    def _is_new(self, name: str, st: os.stat_result) -> bool:
        if name not in self.baseline:
            return True
        before = self._stats.get(name)
        return (
            before is not None
            and not is_trace_file(name)
            and before != (st.st_size, st.st_mtime_ns)
        )

    def scan(self, now: float) -> None:
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
                self.seen[name] = _Seen(st.st_size, st.st_mtime_ns, now)
                self.last_new_at = now
            elif (old.size, old.mtime_ns) != (st.st_size, st.st_mtime_ns):
                self.seen[name] = _Seen(st.st_size, st.st_mtime_ns, now)

    def status(self, name: str, now: float, settle_s: float) -> str:
        """``""`` when complete, else why not."""
        s = self.seen[name]
        if _is_temp(name):
            return "the engine's temporary file (still being written)"
        quiet = now - s.changed_at
        if quiet < settle_s:
            return f"still changing ({s.size} bytes, last change {quiet:.1f}s before the end)"
        if self.check_gzip and name.lower().endswith(".gz"):
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
) -> WaitResult:
    """Wait until the files new in ``directory`` (not in ``baseline``, or side files changed
    since a :func:`snapshot_stats` baseline) are complete.

    Ends when every file seen is complete and either ``expected`` traces exist (side files
    are waited for but not counted) or no new file
    appeared for ``peer_grace_s``; or when no file at all appeared within
    ``first_file_timeout_s``; or at ``timeout_s``, returning what is complete and reporting
    the rest.
    """
    base = baseline if isinstance(baseline, Mapping) else frozenset(baseline)
    w = _Watcher(Path(directory), base, policy.check_gzip)
    start = clock()
    while True:
        now = clock()
        w.scan(now)
        status = {n: w.status(n, now, policy.settle_s) for n in sorted(w.seen)}
        complete = [n for n, why in status.items() if not why]
        elapsed = now - start
        note = ""
        traces = sum(is_chrome_trace(n) for n in status)
        if status and len(complete) == len(status):
            if expected is None or traces >= expected:
                return _result(w, complete, status, elapsed, False, note)
            if now - (w.last_new_at or start) >= policy.peer_grace_s:
                note = f"{traces} of {expected} expected trace file(s) appeared"
                return _result(w, complete, status, elapsed, False, note)
        elif not status and elapsed >= policy.first_file_timeout_s:
            note = f"no file appeared within {policy.first_file_timeout_s:g}s"
            return _result(w, [], status, elapsed, False, note)
        if elapsed >= policy.timeout_s:
            note = f"files still incomplete after {policy.timeout_s:g}s"
            return _result(w, complete, status, elapsed, True, note)
        sleep(policy.poll_s)


def _result(
    w: _Watcher,
    complete: list[str],
    status: dict[str, str],
    elapsed: float,
    timed_out: bool,
    note: str,
) -> WaitResult:
    incomplete = tuple(
        IncompleteFile(str(w.directory / n), why, w.seen[n].size)
        for n, why in status.items()
        if why
    )
    return WaitResult(
        complete=tuple(w.directory / n for n in complete),
        incomplete=incomplete,
        waited_s=round(elapsed, 3),
        timed_out=timed_out,
        note=note,
    )


# -- moving ---------------------------------------------------------------------------------


def _publish(src: Path, dest_dir: Path, name: str) -> Path:
    """Give ``src`` the name ``name`` (or the next free ``_part<N>``) in ``dest_dir`` without
    replacing any file, then remove ``src``."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    stem, ext = _split_ext(name)
    index = 0
    while True:
        candidate = dest_dir / (name if index == 0 else f"{stem}_part{index}{ext}")
        if candidate == src:
            return src
        try:
            os.link(src, candidate)
        except FileExistsError:
            index += 1
            continue
        except OSError:
            # Another filesystem, or one without hard links: exclusive create, then copy.
            try:
                _copy_exclusive(src, candidate)
            except FileExistsError:
                index += 1
                continue
        try:
            src.unlink()
        except OSError as exc:  # published; a leftover source is only untidy
            log.warning("could not remove %s after publishing it as %s: %s", src, candidate, exc)
        return candidate


def _copy_exclusive(src: Path, dst: Path) -> None:
    try:
        with open(dst, "xb") as out, open(src, "rb") as fin:
            shutil.copyfileobj(fin, out, _CHUNK)
        shutil.copystat(src, dst)
    except FileExistsError:
        raise
    except BaseException:
        dst.unlink(missing_ok=True)
        raise


def relocate_files(
    files: Iterable[str | Path],
    *,
    replica: int,
    parallelism: ReplicaParallelism,
    session_dir: str | Path,
    keep_global_ranks: Iterable[int] | None = None,
    move: bool = True,
) -> RelocationResult:
    """Name and move complete engine files (see the module docstring).

    ``keep_global_ranks`` may hold ranks of other replicas; only this replica's matter.
    With ``move=False`` files stay where they are and are only classified.
    """
    keep = None if keep_global_ranks is None else frozenset(int(g) for g in keep_global_ranks)
    session = Path(session_dir)
    subdir = session / replica_subdir_name(replica)
    base = replica * parallelism.world_size
    moved: list[RelocatedFile] = []
    kept: list[RelocatedFile] = []
    side: list[str] = []
    warnings: list[str] = []
    for src in sorted((Path(f) for f in files), key=lambda p: p.name):
        if not is_trace_file(src.name):
            side.append(str(_keep_side_file(src, subdir, replica, warnings) if move else src))
            continue
        local = read_local_rank(src.name, parallelism)
        g = None if local.rank is None else base + local.rank
        surfaced = keep is None or g is None or g in keep
        if surfaced:
            dest_dir, dest_name = session, rollout_trace_name(replica, src.name, g)
        else:
            dest_dir, dest_name = subdir, src.name
        path = src
        if move:
            try:
                path = _publish(src, dest_dir, dest_name)
            except OSError as exc:
                warnings.append(f"relocating {src.name} failed ({exc}); it stays at {src}")
                log.warning("replica %d: relocating %s failed: %s", replica, src, exc)
        try:
            size = path.stat().st_size
        except OSError:
            size = 0
        rec = RelocatedFile(
            source_name=src.name,
            path=str(path),
            replica=replica,
            global_rank=g,
            local_rank=local.rank,
            bytes=size,
            surfaced=surfaced,
            rank_note=local.reason,
        )
        (moved if surfaced else kept).append(rec)
    return RelocationResult(tuple(moved), tuple(kept), (), tuple(warnings), tuple(side))


def _keep_side_file(src: Path, subdir: Path, replica: int, warnings: list[str]) -> Path:
    try:
        return _publish(src, subdir, src.name)
    except OSError as exc:
        warnings.append(f"moving side file {src.name} failed ({exc}); it stays at {src}")
        log.warning("replica %d: moving side file %s failed: %s", replica, src, exc)
        return src


def collect_engine_files(
    engine_dir: str | Path,
    baseline: Iterable[str] | Mapping[str, tuple[int, int]],
    *,
    replica: int,
    parallelism: ReplicaParallelism,
    session_dir: str | Path,
    keep_global_ranks: Iterable[int] | None,
    policy: FlushWait,
    expected: int | None = None,
    move: bool = True,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[WaitResult, RelocationResult]:
    """:func:`wait_for_files`, then :func:`relocate_files` on what is complete."""
    waited = wait_for_files(engine_dir, baseline, policy, expected, clock=clock, sleep=sleep)
    moved = relocate_files(
        waited.complete,
        replica=replica,
        parallelism=parallelism,
        session_dir=session_dir,
        keep_global_ranks=keep_global_ranks,
        move=move,
    )
    warnings = list(moved.warnings)
    if waited.note:
        warnings.append(f"replica {replica}: {waited.note}")
    result = RelocationResult(
        moved.moved, moved.kept_in_subdir, waited.incomplete, tuple(warnings), moved.side_files
    )
    return waited, result
