"""Stacks of a live or hung job: reading a process's stack with py-spy, grouping ranks by stack.

``GET /api/v1/stacks`` and ``profd stacks`` show where every attached process's training
thread is right now. Two readers give the same frames (function qualified name, file, line,
innermost first):

* **py-spy**, run on the process's node (:func:`dump_with_py_spy`, a node task of the
  coordinator): it reads a process from outside, so it works while the training thread holds
  the GIL, and it can add native frames;
* **the agent**: its poller thread reads the training thread's frames with
  ``sys._current_frames`` (:mod:`profd.agent.stacks`); it needs no permission, and works while
  the training thread waits in C code that released the GIL (a collective, a lock, a queue).

:func:`group_stacks` puts ranks with identical stacks together, the odd ones first: in a hung
job, the rank that waits somewhere else is the one alone.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from profd.core.errors import RequestInvalid
from profd.core.protocol import StackFrame
from profd.core.request import field_errors

__all__ = [
    "MAX_FRAMES",
    "PY_SPY_TIMEOUT_S",
    "PySpyDump",
    "RankStack",
    "StackGroupData",
    "StackMethod",
    "StackQuery",
    "ThreadStack",
    "dump_with_py_spy",
    "find_py_spy",
    "group_stacks",
    "pick_thread",
    "threads_from_py_spy",
]

#: Deeper stacks are cut (innermost frames kept), by both readers alike.
MAX_FRAMES = 200
#: How long one ``py-spy dump`` may take.
PY_SPY_TIMEOUT_S = 10.0


class StackMethod(StrEnum):
    AUTO = "auto"  # py-spy where it can attach, else the agent
    PY_SPY = "py_spy"
    AGENT = "agent"


class StackQuery(BaseModel):
    """What ``GET /api/v1/stacks`` / ``profd stacks`` asks for."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: str | None = Field(None, min_length=1, description="Only this role's processes.")
    ranks: tuple[int, ...] | None = Field(None, description="Only these ranks.")
    job_id: str | None = Field(
        None, min_length=1, description="Only this Ray job's processes ('none': outside Ray)."
    )
    native: bool = Field(False, description="Native frames too (py-spy only).")
    method: StackMethod = Field(StackMethod.AUTO, description="Who reads the stacks.")
    timeout_s: float = Field(5.0, gt=0, le=60, description="How long to wait for answers.")

    @model_validator(mode="after")
    def _check(self) -> StackQuery:
        if self.ranks is not None and any(r < 0 for r in self.ranks):
            raise ValueError("ranks: every rank must be >= 0")
        if self.native and self.method is StackMethod.AGENT:
            raise ValueError("native: needs py-spy (method agent reads Python frames only)")
        return self

    @classmethod
    def parse(cls, **fields: object) -> StackQuery:
        """Validate, as :class:`~profd.core.errors.RequestInvalid` naming the field."""
        try:
            return cls.model_validate(fields)
        except ValidationError as exc:
            raise RequestInvalid.from_fields(field_errors(exc)) from None


def find_py_spy() -> str | None:
    """The py-spy executable: ``PROFD_PY_SPY`` if set (an operator's own build or wrapper),
    else the one beside this Python (``ray[default]`` installs it), else on ``PATH``."""
    forced = os.environ.get("PROFD_PY_SPY")
    if forced:
        return forced
    beside = Path(sys.executable).with_name("py-spy")
    if beside.exists():
        return str(beside)
    return shutil.which("py-spy")


@dataclass(frozen=True, slots=True)
class ThreadStack:
    """One thread of a process: its native id (when known), name and frames."""

    native_id: int | None
    name: str
    frames: tuple[StackFrame, ...]


#: Threads that never run the job's code: Ray's own, and profd's (``profd-*``).
_NOT_THE_JOB = frozenset({"PythonGCThread", "ray_print_logs", "ray_listen_error_messages"})


def _python_frames(t: ThreadStack) -> list[StackFrame]:
    return [f for f in t.frames if f.line > 0]  # native frames (--native) have no line


def _runs_the_job(t: ThreadStack) -> bool:
    if t.name.startswith("profd-") or t.name in _NOT_THE_JOB:
        return False
    py = _python_frames(t)
    # a Ray worker's main thread between tasks (tasks of threaded actors run on other threads)
    # (py-spy before 0.4 names functions without their class: both namings match)
    top = py[0] if py else None
    return top is not None and not (
        top.function.rsplit(".", 1)[-1] == "main_loop" and top.file.endswith("worker.py")
    )


def pick_thread(threads: Sequence[ThreadStack], attached: int | None) -> ThreadStack | None:
    """The thread whose stack stands for the process: the training thread.

    Marks do not record their thread (that would cost every mark), so both readers pick it
    alike from all the threads: the one that attached (``attached``: its native id) if it runs
    the job's code; else the thread running the job's code with the deepest stack (a Ray
    actor's calls run on pool threads, not on the thread that attached); else the one that
    attached, else the main thread, else none."""
    running = [t for t in threads if _runs_the_job(t)]
    for t in running:
        if attached is not None and t.native_id == attached:
            return t
    if running:
        return max(running, key=lambda t: (len(_python_frames(t)), -(t.native_id or 0)))
    for t in threads:
        if attached is not None and t.native_id == attached:
            return t
    return next((t for t in threads if t.name == "MainThread"), None)


def threads_from_py_spy(dump: object) -> list[ThreadStack]:
    """The threads of ``py-spy dump --json`` output (a list of threads)."""
    if not isinstance(dump, list):
        raise ValueError("py-spy dump: expected a JSON list of threads")
    out = []
    for t in dump:
        if not isinstance(t, dict):
            continue
        frames = tuple(
            StackFrame(
                str(f.get("name", "?")), str(f.get("filename", "?")), int(f.get("line") or 0)
            )
            for f in (t.get("frames") or ())[:MAX_FRAMES]
        )
        native = t.get("os_thread_id")
        out.append(
            ThreadStack(
                native if isinstance(native, int) else None, t.get("thread_name") or "", frames
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class PySpyDump:
    """One process read by py-spy: its frames, or why py-spy could not read it."""

    pid: int
    #: The native id of the thread asked for (the one that attached).
    thread_id: int | None = None
    frames: tuple[StackFrame, ...] | None = None
    thread: str = ""
    error: str | None = None


def _refusal(stderr: str, code: int) -> str:
    """py-spy's reason, without its Rust backtrace."""
    said = []
    for line in stderr.splitlines():
        if line.startswith("Stack backtrace"):
            break
        if line.strip() and line.strip() != "Caused by:":
            said.append(line.strip())
    return "py-spy: " + ("; ".join(said[:4]) if said else f"exit {code}")


def _dump_process(exe: str, pid: int, native: bool) -> list[ThreadStack] | str:
    """One ``py-spy dump`` of a process: its threads, or why py-spy could not read it."""
    cmd = [exe, "dump", "--json", "--pid", str(pid)]
    if native:
        cmd.append("--native")
    try:
        out = subprocess.run(
            cmd, capture_output=True, timeout=PY_SPY_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return f"py-spy did not answer within {PY_SPY_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return f"py-spy could not run: {exc}"
    if out.returncode != 0:
        return _refusal(out.stderr.decode(errors="replace"), out.returncode)
    try:
        return threads_from_py_spy(orjson.loads(out.stdout))
    except (orjson.JSONDecodeError, ValueError, TypeError) as exc:
        return f"py-spy's output could not be read: {exc}"


def dump_with_py_spy(
    processes: Sequence[tuple[int, int | None]], native: bool = False
) -> list[PySpyDump]:
    """Read each ``(pid, thread id)`` of this node with ``py-spy dump``: one dump per process
    (two cannot suspend one process at once), a few processes at a time. Runs on the
    processes' node; never raises: a process py-spy cannot read says why."""
    exe = find_py_spy()
    pids = sorted({pid for pid, _ in processes})
    if exe is None:
        dumps: dict[int, list[ThreadStack] | str] = dict.fromkeys(
            pids, "py-spy is not installed on this node"
        )
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(pids) or 1)) as pool:
            dumps = dict(
                zip(pids, pool.map(lambda p: _dump_process(exe, p, native), pids), strict=True)
            )
    out = []
    for pid, tid in processes:
        threads = dumps[pid]
        if isinstance(threads, str):
            out.append(PySpyDump(pid, tid, error=threads))
            continue
        chosen = pick_thread(threads, tid)
        if chosen is None:
            out.append(PySpyDump(pid, tid, error="py-spy found no thread of the job"))
        else:
            out.append(PySpyDump(pid, tid, frames=chosen.frames, thread=chosen.name))
    return out


@dataclass(frozen=True, slots=True)
class RankStack:
    """One attached process's stack, as grouped: who it is and how it was read."""

    role: str
    rank: int
    pid: int
    node: str
    method: str
    frames: tuple[StackFrame, ...]
    thread: str = ""


@dataclass(frozen=True, slots=True)
class StackGroupData:
    frames: tuple[StackFrame, ...]
    ranks: tuple[RankStack, ...]


def group_stacks(stacks: Iterable[RankStack]) -> list[StackGroupData]:
    """Ranks with identical stacks together; the smallest groups (the odd ones) first, then
    by their first (role, rank). Within a group, ranks are in (role, rank) order."""
    by_frames: dict[tuple[StackFrame, ...], list[RankStack]] = {}
    for s in stacks:
        by_frames.setdefault(s.frames, []).append(s)
    groups = [
        StackGroupData(frames, tuple(sorted(members, key=lambda m: (m.role, m.rank, m.pid))))
        for frames, members in by_frames.items()
    ]
    groups.sort(key=lambda g: (len(g.ranks), g.ranks[0].role, g.ranks[0].rank))
    return groups
