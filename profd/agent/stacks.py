"""The agent's own reading of its training thread's stack (``profd stacks`` without py-spy).

The poller thread answers a stack request: it reads every thread's current frame with
``sys._current_frames`` and picks the training thread as py-spy's reader does
(:func:`profd.core.stacks.pick_thread`), so both give the same groups. Reading needs the GIL,
which a thread waiting in C code (a collective, a lock, a queue, a sleep) has released; a
thread spinning in C with the GIL held cannot be read this way (py-spy can).
"""

from __future__ import annotations

import sys
import threading
from types import FrameType

from profd.core.protocol import StackFrame, StackSample
from profd.core.stacks import MAX_FRAMES, ThreadStack, pick_thread

__all__ = ["read_stack"]


def _frames(frame: FrameType | None) -> tuple[StackFrame, ...]:
    out: list[StackFrame] = []
    while frame is not None and len(out) < MAX_FRAMES:
        code = frame.f_code
        name = getattr(code, "co_qualname", code.co_name)  # what py-spy shows on 3.11+
        out.append(StackFrame(name, code.co_filename, frame.f_lineno or 0))
        frame = frame.f_back
    return tuple(out)


def read_stack(request: int, attached: int | None) -> StackSample:
    """Answer stack request ``request``: the training thread's frames, innermost first.
    ``attached``: the native id of the thread that attached the agent."""
    me = threading.get_ident()
    known = {t.ident: t for t in threading.enumerate()}
    threads = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        t = known.get(ident)
        threads.append(ThreadStack(t.native_id if t else None, t.name if t else "", _frames(frame)))
    chosen = pick_thread(threads, attached)
    if chosen is None:
        return StackSample(request, (), error="no thread of the job is running")
    return StackSample(request, chosen.frames, thread=chosen.name)
