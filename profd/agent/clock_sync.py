"""How far this process's clock is from the coordinator's, so traces of many nodes share one
clock (``merge`` and ``summarize`` add the offset to each file's wall clock).

Each sample asks the coordinator for its wall clock between two local readings; the sample
with the shortest round trip bounds the offset best (the answer was read somewhere inside the
round trip, so the error is at most half of it). Pure: no Ray, no torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ClockEstimate", "estimate_offset"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ClockEstimate:
    """Add ``offset_ns`` to this process's wall clock to get the coordinator's, give or take
    ``rtt_ns / 2``; measured at ``measured_at_ns`` (local wall clock)."""

    offset_ns: int
    rtt_ns: int
    measured_at_ns: int
    samples: int

    def metadata(self) -> dict[str, Any]:
        """The ``profd.clock`` block of a trace's metadata."""
        return {
            "reference": "coordinator",
            "offset_us": self.offset_ns / 1000.0,
            "uncertainty_us": self.rtt_ns / 2000.0,
            "measured_at_ns": self.measured_at_ns,
            "samples": self.samples,
        }


def estimate_offset(
    ask: Callable[[], int], samples: int = 5, now_ns: Callable[[], int] = time.time_ns
) -> ClockEstimate | None:
    """Best of ``samples`` round trips of ``ask`` (the coordinator's ``time.time_ns()``);
    None when no sample got an answer (the caller keeps its previous estimate)."""
    if samples < 1:
        raise ValueError(f"samples: must be >= 1, got {samples}")
    best: tuple[int, int, int] | None = None  # (rtt, offset, measured at)
    got = 0
    for _ in range(samples):
        before = now_ns()
        remote = ask()
        after = now_ns()
        if isinstance(remote, bool) or not isinstance(remote, int) or after < before:
            continue
        got += 1
        rtt = after - before
        sample = (rtt, remote - (before + after) // 2, after)
        if best is None or sample[0] < best[0]:
            best = sample
    if best is None:
        return None
    return ClockEstimate(offset_ns=best[1], rtt_ns=best[0], measured_at_ns=best[2], samples=got)
