"""The fast path's correlation ids are exactly the generic path's ``args.correlation``.

``gemm_c`` runs on [45, 60] ms, after its launch at 38 ms in ``generate``: with its id it
counts in ``generate``, without one at its own start, outside every stage. Its args are
replaced by ones that hold no id of its own, in ways a fast path can misread: an id only in
a nested object; one that is not an integer; none at all, with the next event's (the launch
at 45 ms) a few keys further on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gpu_traces import gpu_events, header, kineto_text

from profd.analysis.digest import digest_file


@pytest.mark.parametrize(
    "args",
    [
        pytest.param({"External id": 9, "meta": {"correlation": 4}}, id="nested"),
        pytest.param({"External id": 9, "correlation": 4.0}, id="not-an-integer"),
        pytest.param({"stream": 7}, id="the-next-events"),
    ],
)
def test_an_id_that_is_not_the_kernels_own_is_not_taken(
    tmp_path: Path, args: dict[str, Any]
) -> None:
    events = gpu_events(1)
    for e in events:
        if e["name"] == "gemm_c":
            e["args"] = args
    path = tmp_path / "trace.json"
    path.write_text(kineto_text(header(0, 1), events))
    fast, generic = digest_file(path), digest_file(path, force_generic=True)
    assert fast.error is None is generic.error
    assert fast.gpu is not None and fast.gpu == generic.gpu and fast.ops == generic.ops
    gemm_c = [op for op in fast.ops if op.name == "gemm_c"]
    assert [(op.stage, op.calls) for op in gemm_c] == [(None, 1)]
