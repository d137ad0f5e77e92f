"""Bringing an engine's trace files into the session directory (reference §8.4, with fixes).

An engine writes one file per GPU worker (plus, for some versions, a front-end file) into its
own directory, named its own way. After a window:

1. :func:`wait_for_files` (in ``flush_wait.py``) waits until the files that appeared since
   the window started are complete: size and mtime unchanged for a settle interval and, for
   ``.gz``, a finished gzip stream. Engines flush slowly (minutes for large runs), so the
   wait has an overall timeout; what is still being written then is *reported*, never
   dropped or moved half-written.
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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from profd.core.protocol import IncompleteFile
from profd.rollout.flush_wait import (
    DirWatcher,
    FlushWait,
    WaitResult,
    gzip_complete,
    is_chrome_trace,
    is_side_file,
    is_trace_file,
    snapshot_dir,
    snapshot_stats,
    wait_for_files,
)
from profd.rollout.replicas import ReplicaParallelism

__all__ = [
    "DirWatcher",
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
_CHUNK = 1 << 20


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
    watcher: DirWatcher | None = None,
) -> tuple[WaitResult, RelocationResult]:
    """:func:`wait_for_files`, then :func:`relocate_files` on what is complete."""
    waited = wait_for_files(
        engine_dir, baseline, policy, expected, clock=clock, sleep=sleep, watcher=watcher
    )
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
