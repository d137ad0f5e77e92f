"""The fake vLLM against what a real vLLM 0.32 did on this machine (tests/fixtures/vllm/,
recorded by the engine suite's probe): the same files for the same launch settings and start
bodies, the same header keys, the same answers to bad and repeated requests. Wherever the
fake plays vLLM in a test, it plays the recorded engine."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import httpx
import pytest

from profd.testing.fake_engines import FakeVllmServer, read_trace

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
RECORDED = json.loads((FIXTURES / "profiling_windows.json").read_text())
RUNS = RECORDED["runs"]


def shape(name: str) -> str:
    """A file name with its time stamp and host/pid replaced, as both engines vary them."""
    name = re.sub(r"\d{16,}", "<ns>", name)
    return re.sub(r"(^|_)[A-Za-z0-9.-]+_\d+\.async_llm", r"\1<host>_<pid>.async_llm", name)


def recorded_window(run: str, label: str) -> dict:
    (w,) = [w for w in RECORDED["windows"] if w["run"] == run and w["label"].startswith(label)]
    files = w["files"]
    return {**w, "files": ast.literal_eval(files) if isinstance(files, str) else files}


def fake_for(run: str, tmp_path: Path) -> FakeVllmServer:
    config = {**RUNS[run]["config_keys"], "torch_profiler_dir": str(tmp_path / "d")}
    return FakeVllmServer(tp=1, profiler_config=config, version="0.32.0")


def window(fake: FakeVllmServer, body: dict | None, iterations: int) -> list[Path]:
    before = set((Path(fake.launch["dir"])).glob("*"))
    start = httpx.post(f"{fake.url}/start_profile", json=body) if body else None
    if start is None:
        start = httpx.post(f"{fake.url}/start_profile")
    assert start.status_code == 200, start.text
    fake.advance(iterations)
    assert httpx.post(f"{fake.url}/stop_profile").status_code == 200
    return sorted(set(Path(fake.launch["dir"]).glob("*")) - before)


@pytest.mark.parametrize(
    ("run", "label", "sides_new"),
    # W4 re-wrote W1's side files in place (the probe left them there), so only its traces
    # were new; profd moves side files out, so each of its windows writes them anew
    [("A2", "W1", True), ("B", "W1", True), ("A2", "W3", True), ("A2", "W4", False)],
)
def test_the_fake_writes_the_files_the_real_engine_wrote(tmp_path, run, label, sides_new) -> None:
    real = recorded_window(run, label)
    with fake_for(run, tmp_path) as fake:
        made = window(fake, real["start_body"], iterations=30)
    names = [p.name for p in made if sides_new or p.name.endswith(".json.gz")]
    assert sorted(map(shape, names)) == sorted(shape(n) for n in real["files"])
    # the worker trace records the very iterations the real one did (its window's max)
    body = real["start_body"] or {}
    limit = body.get("max_iterations", RUNS[run]["config_keys"].get("max_iterations", 0))
    if limit and "singles" in real["label"]:
        (worker,) = [p for p in made if "rank0." in p.name and p.name.endswith(".json.gz")]
        real_worker = next(v for n, v in real["files"].items() if "rank0." in n and ".json" in n)
        real_iterations = singles_iterations(real_worker["execute_annotations"])
        assert len(real_iterations) == limit
        # the fake lists iteration i as index i - 1 (the response token it produces)
        assert read_trace(worker)["fake_engine"]["iterations"] == [i - 1 for i in real_iterations]


def singles_iterations(names: list[str]) -> list[int]:
    """Which iterations (from 1) a window of one-token requests recorded: request k's prefill
    (``execute_context_1(k)_...``) is iteration 2k - 1, the empty one after it 2k
    (FACTS.md (b))."""
    for j, name in enumerate(names):
        m = re.match(r"execute_context_1\((\d+)\)_generation_0\(0\)$", name)
        if m:
            first = 2 * int(m[1]) - 1 - j
            return list(range(first, first + len(names)))
    raise AssertionError(f"no prefill among {names}")


@pytest.mark.parametrize("fixture", ["worker_header.json", "worker_header_nostack.json"])
def test_the_fake_worker_header_has_the_real_keys(tmp_path, fixture) -> None:
    real = json.loads((FIXTURES / fixture).read_text())["header"]
    run = "A" if "with_stack" in real else "A2"
    with fake_for(run, tmp_path) as fake:
        made = window(fake, None, iterations=10)
    (worker,) = [p for p in made if p.name.startswith("rank0.") and p.name.endswith(".gz")]
    doc = read_trace(worker)
    assert set(real) <= set(doc), set(real) - set(doc)
    assert ("with_stack" in doc) == ("with_stack" in real)
    assert doc["vllm_version"] == real["vllm_version"] == "0.32.0"
    assert doc["distributedInfo"]["rank"] == real["distributedInfo"]["rank"] == 0


def test_the_fake_answers_bad_and_repeated_starts_as_the_real_engine(tmp_path) -> None:
    rec = RUNS["A2"]
    with fake_for("A2", tmp_path) as fake:
        url = fake.url
        stop = httpx.post(f"{url}/stop_profile")  # no window: a plain 200
        assert (stop.status_code, stop.text) == (
            rec["stop_without_start"]["status"],
            rec["stop_without_start"]["text"],
        )
        for case, body in (
            ("neg_delay", {"delay_iterations": -1}),
            ("bad_prefix", {"profile_prefix": "-bad"}),
            ("string_delay", {"delay_iterations": "3"}),
            ("unknown_key", {"what": 1}),
        ):
            got = httpx.post(f"{url}/start_profile", json=body)
            want = rec["bad_body"][case]
            assert got.status_code == want["status"], case
            if case in ("neg_delay", "bad_prefix"):
                assert (
                    got.json()["error"]["message"] == json.loads(want["text"])["error"]["message"]
                )
            if got.status_code == 200:
                httpx.post(f"{url}/stop_profile")
        first, second = (httpx.post(f"{url}/start_profile") for _ in range(2))
        assert [first.status_code, second.status_code] == [
            s["status"] for s in rec["double_start"][:2]
        ]
        assert second.json() == json.loads(rec["double_start"][1]["text"])
        fake.advance(10)  # the launch window (max 5) stops the workers by itself ...
        again = httpx.post(f"{url}/start_profile")  # ... and still a start is refused
        assert again.status_code == rec["start_after_autostop"][1]["status"] == 409
        assert httpx.post(f"{url}/stop_profile").status_code == 200
        assert httpx.post(f"{url}/start_profile").status_code == 200
