"""Engine adapters over real HTTP on 127.0.0.1 (fake vLLM / SGLang servers) and in-process
engines: the requests the engines receive, and every failure as a typed EngineError."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from profd.rollout.engine_args import EngineProfileOptions, vllm_launch_settings
from profd.rollout.engines import (
    EngineError,
    EngineErrorKind,
    EngineTimeouts,
    EngineWindow,
    InProcessEngine,
    SglangHttpEngine,
    VllmHttpEngine,
)
from profd.testing.fake_engines import FakeSglangServer, FakeVllmServer, read_trace

from helpers import free_port

OPTS = EngineProfileOptions()
QUICK = EngineTimeouts(connect_s=1.0, start_s=5.0, stop_s=0.5)


def window(tmp_path, **kw) -> EngineWindow:
    return EngineWindow(str(tmp_path / "out"), EngineProfileOptions(**kw))


def vllm_fake(tmp_path, version: str = "0.13.0", **kw) -> FakeVllmServer:
    launch = vllm_launch_settings(OPTS, str(tmp_path / "vllm"), version)
    return FakeVllmServer.from_launch(launch, tp=2, **kw)


def test_vllm_start_and_stop_post_without_body_and_write_per_rank_files(tmp_path) -> None:
    with vllm_fake(tmp_path) as fake:
        eng = VllmHttpEngine(fake.url)
        assert eng.start(window(tmp_path)) == []
        fake.advance(3)
        assert eng.stop() == []
        eng.close()
    assert fake.requests == [("POST", "/start_profile", None), ("POST", "/stop_profile", None)]
    names = sorted(p.name for p in (tmp_path / "vllm").iterdir())
    assert [n.split(".")[0] for n in names] == ["rank0", "rank1"]
    assert all(n.endswith(".pt.trace.json.gz") for n in names)


def test_vllm_0_32_gets_the_window_in_the_start_body_and_refuses_a_second_start(
    tmp_path,
) -> None:
    with vllm_fake(tmp_path, version="0.32.0") as fake:
        eng = VllmHttpEngine(fake.url)
        assert eng.server_version() == (0, 32, 0)  # read from GET /version
        eng.start(window(tmp_path, profile_token_start=2, profile_token_end=5))
        with pytest.raises(EngineError, match="HTTP 409") as err:
            eng.start(window(tmp_path))  # one window at a time, as vLLM says
        assert err.value.kind is EngineErrorKind.REFUSED
        fake.advance(8)  # the window stops itself after max_iterations and writes
        assert eng.stop() == []
        names = sorted(p.name for p in (tmp_path / "vllm").iterdir())
        eng.start(window(tmp_path))  # stopped: a new window may begin
        eng.stop()
    # tokens [2, 5): iterations 3..5 (iteration t + 1 produces response token t)
    assert fake.requests[0][2] == {"delay_iterations": 3, "max_iterations": 3}
    traces = [n for n in names if n.endswith(".pt.trace.json.gz")]
    assert [n.split(".")[0] for n in traces] == ["rank0", "rank1"]
    assert sorted(set(names) - set(traces)) == ["rank0.profiler_out.txt", "rank1.profiler_out.txt"]
    doc = read_trace(tmp_path / "vllm" / traces[0])
    assert doc["fake_engine"]["iterations"] == [2, 3, 4] and doc["vllm_version"] == "0.32.0"


def test_vllm_without_profiling_configured_has_no_route(tmp_path) -> None:
    with FakeVllmServer(tp=1) as fake:
        raw = httpx.post(f"{fake.url}/start_profile")
        assert raw.status_code == 404  # as vLLM: the route is not registered
        with pytest.raises(EngineError) as err:
            VllmHttpEngine(fake.url).start(window(tmp_path))
    assert err.value.kind is EngineErrorKind.REFUSED
    assert "HTTP 404" in err.value.reason and "launched without profiling" in err.value.reason


def test_vllm_start_refused_carries_the_servers_answer(tmp_path) -> None:
    with vllm_fake(tmp_path, refuse_start=True) as fake, pytest.raises(EngineError) as err:
        VllmHttpEngine(fake.url).start(window(tmp_path))
    assert err.value.kind is EngineErrorKind.REFUSED
    assert "HTTP 500: Internal Server Error" in err.value.reason


def test_endpoint_down_is_unreachable(tmp_path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for eng in (VllmHttpEngine(url, QUICK), SglangHttpEngine(url, QUICK)):
        with pytest.raises(EngineError) as err:
            eng.start(window(tmp_path))
        assert err.value.kind is EngineErrorKind.UNREACHABLE and url in err.value.reason


def test_stop_that_hangs_times_out(tmp_path) -> None:
    with vllm_fake(tmp_path, stop_hangs=True) as fake:
        eng = VllmHttpEngine(fake.url, QUICK)
        eng.start(window(tmp_path))
        t0 = time.monotonic()
        with pytest.raises(EngineError) as err:
            eng.stop()
        assert time.monotonic() - t0 < 3
    assert err.value.kind is EngineErrorKind.TIMEOUT
    assert "/stop_profile did not answer within 0.5s" in err.value.reason


def test_sglang_start_sends_the_body_and_stop_writes_tp_files(tmp_path) -> None:
    with FakeSglangServer(tp=2) as fake:
        eng = SglangHttpEngine(fake.url)
        w = window(tmp_path, contents=("cuda", "shapes"))
        assert eng.start(w) == []
        fake.advance(2)
        assert eng.stop() == []
    method, path, body = fake.requests[0]
    assert (method, path) == ("POST", "/start_profile")
    assert body == {
        "output_dir": w.output_dir,
        "activities": ["CPU", "GPU"],
        "with_stack": False,
        "record_shapes": True,
    }
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(names) == 2 and names[0].endswith("-TP-0.trace.json.gz") and "-TP-1." in names[1]


def test_sglang_with_an_api_key_sends_it_and_without_is_refused(tmp_path) -> None:
    with FakeSglangServer(tp=1, api_key="admin-k") as fake:
        with pytest.raises(EngineError, match="HTTP 401") as err:
            SglangHttpEngine(fake.url).start(window(tmp_path))
        assert err.value.kind is EngineErrorKind.REFUSED
        eng = SglangHttpEngine(fake.url, api_key="admin-k")
        eng.start(window(tmp_path))
        fake.advance(1)
        assert eng.stop() == []
    assert len(list((tmp_path / "out").iterdir())) == 1
    with pytest.raises(ValueError, match="api_key"):
        SglangHttpEngine("http://127.0.0.1:1", api_key=" k")


def test_sglang_profile_v2_server_gets_no_request(tmp_path) -> None:
    with FakeSglangServer(tp=1) as fake:
        eng = SglangHttpEngine(fake.url, server_env={"SGLANG_PROFILE_V2": "true"})
        with pytest.raises(EngineError, match="SGLANG_PROFILE_V2") as err:
            eng.start(window(tmp_path))
    assert err.value.kind is EngineErrorKind.REFUSED and fake.requests == []


def test_sglang_refusal_while_profiling(tmp_path) -> None:
    with FakeSglangServer(tp=1) as fake:
        eng = SglangHttpEngine(fake.url)
        eng.start(window(tmp_path))
        with pytest.raises(EngineError) as err:
            eng.start(window(tmp_path))
        assert err.value.kind is EngineErrorKind.REFUSED and "HTTP 500" in err.value.reason
        eng.stop()
        with pytest.raises(EngineError, match="refused /stop_profile: HTTP 500"):
            eng.stop()  # not in progress any more: SGLang refuses


def test_sglang_stop_after_num_steps_is_not_an_error(tmp_path) -> None:
    with FakeSglangServer(tp=1) as fake:
        eng = SglangHttpEngine(fake.url)
        eng.start(window(tmp_path, profile_token_end=2))
        fake.advance(5)  # the engine stops by itself after num_steps and writes its file
        assert len(list((tmp_path / "out").iterdir())) == 1
        warnings = eng.stop()
    assert "already stopped after num_steps" in warnings[0]


def test_base_url_must_be_http() -> None:
    with pytest.raises(ValueError, match="base_url"):
        VllmHttpEngine("127.0.0.1:8000")


class Engine:
    def __init__(self, fail: str | None = None, hang: threading.Event | None = None) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.fail = fail
        self.hang = hang

    def start_profile(self, **kw):
        self.calls.append(("start", kw))
        if self.fail:
            raise RuntimeError(self.fail)

    def stop_profile(self):
        self.calls.append(("stop", {}))
        if self.hang is not None:
            self.hang.wait(10)


class AsyncEngine:
    def __init__(self) -> None:
        self.loops: list[object] = []

    async def start_profile(self, **kw):
        self.loops.append(asyncio.get_running_loop())

    async def stop_profile(self):
        self.loops.append(asyncio.get_running_loop())


def test_in_process_vllm_and_sglang_flavors(tmp_path) -> None:
    e = Engine()
    InProcessEngine(e, "vllm").start(window(tmp_path, profile_token_end=3))
    InProcessEngine(e, "sglang").start(window(tmp_path, contents=("stack",), profile_token_end=3))
    assert e.calls[0] == ("start", {})
    kw = e.calls[1][1]
    assert kw["num_steps"] == 3 and kw["with_stack"] and kw["output_dir"] == str(tmp_path / "out")


def test_in_process_async_methods_run_on_the_given_loop(tmp_path) -> None:
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        e = AsyncEngine()
        eng = InProcessEngine(e, loop=loop)
        eng.start(window(tmp_path))
        eng.stop()
        assert e.loops == [loop, loop]
        InProcessEngine(e).start(window(tmp_path))  # no loop given: a private one
        assert e.loops[-1] is not loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)


def test_in_process_failures_are_typed(tmp_path) -> None:
    with pytest.raises(EngineError) as err:
        InProcessEngine(Engine(fail="busy")).start(window(tmp_path))
    assert err.value.kind is EngineErrorKind.REFUSED and "RuntimeError: busy" in err.value.reason
    release = threading.Event()
    eng = InProcessEngine(Engine(hang=release), timeouts=QUICK)
    with pytest.raises(EngineError) as err:
        eng.stop()
    release.set()
    assert err.value.kind is EngineErrorKind.TIMEOUT
    with pytest.raises(ValueError, match="engine: object has no start_profile"):
        InProcessEngine(object())
    with pytest.raises(ValueError, match="flavor"):
        InProcessEngine(Engine(), "trtllm")  # type: ignore[arg-type]


def test_vllm_version_unreadable_is_asked_again_and_falls_back_to_the_launch(tmp_path) -> None:
    answers = iter([503, 200])
    bodies: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/version":
            status = next(answers, 200)
            return httpx.Response(status, json={"version": "0.32.0"})
        bodies.append(request.content)
        return httpx.Response(200)

    win = window(tmp_path, profile_token_start=1, profile_token_end=3)
    eng = VllmHttpEngine("http://vllm.test", QUICK, transport=httpx.MockTransport(handler))
    warned = eng.start(win)  # /version answered 503: no body, and the session is told
    assert bodies == [b""] and any("window was not sent" in w for w in warned)
    assert eng.start(win) == [] and json.loads(bodies[1]) == {
        "delay_iterations": 2,
        "max_iterations": 2,
    }  # asked again: 0.32, the body goes
    down = iter([503])
    eng2 = VllmHttpEngine(
        "http://vllm.test",
        QUICK,
        transport=httpx.MockTransport(
            lambda r: httpx.Response(next(down, 503)) if r.url.path == "/version" else handler(r)
        ),
    )
    eng2.launch_version = (0, 32, 0)  # what the rollout agent tells it from the launch
    assert eng2.start(win) == [] and json.loads(bodies[2])["delay_iterations"] == 2
