"""Contents and token window → vLLM launch settings and SGLang request bodies, warnings as data."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from profd.core.request import NpuToolConfig, TorchToolConfig
from profd.rollout.engine_args import (
    EngineProfileOptions,
    TokenWindow,
    parse_vllm_version,
    sglang_env_refusal,
    sglang_start_request,
    vllm_launch_settings,
    vllm_start_body,
    vllm_window_warnings,
)


def opts(**kw) -> EngineProfileOptions:
    return EngineProfileOptions(**kw)


def test_token_window_maps_to_vllm_iterations_and_sglang_steps() -> None:
    # vLLM counts iterations from 1 and starts at the delay-th; iteration t + 1 gives token t
    # (measured on vLLM 0.32, tests/fixtures/vllm/FACTS.md): tokens [10, 25) = iterations 11..25
    w = TokenWindow(10, 25)
    assert (w.delay_iterations, w.max_iterations, w.num_steps) == (11, 15, 15)
    open_end = TokenWindow(10, None)
    assert (open_end.delay_iterations, open_end.max_iterations, open_end.num_steps) == (11, 0, None)
    assert TokenWindow(0, 3).delay_iterations == 1  # token 0 is the first iteration
    no_start = TokenWindow(None, 7)
    assert (no_start.delay_iterations, no_start.max_iterations, no_start.num_steps) == (0, 7, 7)
    assert not TokenWindow().is_set and TokenWindow(0, None).is_set


@given(start=st.none() | st.integers(0, 10_000), length=st.none() | st.integers(1, 10_000))
def test_window_covers_exactly_the_requested_tokens(start, length) -> None:
    end = None if length is None else (start or 0) + length
    w = opts(profile_token_start=start, profile_token_end=end).window
    # the first iteration recorded is the one giving token `start` (iteration start + 1)
    assert w.delay_iterations == (0 if start is None else start + 1)
    first_token = max(w.delay_iterations, 1) - 1
    assert first_token == (start or 0)
    if end is None:
        assert w.max_iterations == 0 and w.num_steps is None  # 0 / None = until stop
    else:
        assert first_token + w.max_iterations == end and w.num_steps == length


def test_bad_options_fail_naming_the_field() -> None:
    with pytest.raises(ValueError, match="profile_token_end: must be > profile_token_start"):
        opts(profile_token_start=5, profile_token_end=5)
    # 0 would reach the engines as "no limit": refused rather than silently unbounded.
    with pytest.raises(ValueError, match="profile_token_end"):
        opts(profile_token_end=0)
    with pytest.raises(ValueError, match=r"contents\.1"):
        opts(contents=("cuda", "module"))
    with pytest.raises(ValueError, match="tool: rollout engines profile with torch or npu"):
        EngineProfileOptions.from_tool_config("nsys", None)


def test_from_tool_config_reads_models_and_plain_dicts() -> None:
    t = EngineProfileOptions.from_tool_config(
        "torch", TorchToolConfig(contents=("stack",), profile_token_start=1, profile_token_end=4)
    )
    assert t.contents == ("stack",) and t.window == TokenWindow(1, 4) and t.with_stack
    n = EngineProfileOptions.from_tool_config(
        "npu", {"contents": ["module", "npu"], "level": "level1"}
    )
    assert n.tool == "npu" and n.with_stack and n.with_device
    assert EngineProfileOptions.from_tool_config("npu", NpuToolConfig()).contents == ()
    with pytest.raises(ValueError, match="profile_token_end"):
        EngineProfileOptions.from_tool_config(
            "torch", {"profile_token_start": 3, "profile_token_end": 2}
        )


def test_vllm_new_versions_get_a_profiler_config_and_no_env() -> None:
    o = opts(
        contents=("cuda", "stack", "shapes", "memory"), profile_token_start=4, profile_token_end=10
    )
    s = vllm_launch_settings(o, "/traces/r0", "0.13.0")
    assert s.uses_profiler_config and s.supports_window and s.env == {}
    cfg = s.profiler_config
    assert cfg == {
        "profiler": "torch",
        "torch_profiler_dir": "/traces/r0",
        "torch_profiler_with_stack": True,
        "torch_profiler_record_shapes": True,
        "torch_profiler_with_memory": True,
        "delay_iterations": 5,
        "max_iterations": 6,
        "ignore_frontend": True,
    }
    assert s.engine_kwargs() == {"profiler_config": cfg}
    flag, value = s.cli_args()
    assert flag == "--profiler-config" and json.loads(value) == cfg
    assert s.warnings == ()
    assert vllm_launch_settings(o, "/t", "0.17.1+cu128").uses_profiler_config
    assert vllm_launch_settings(o, "/t", "0.13.0rc1").uses_profiler_config


def test_vllm_0_12_uses_env_with_iteration_window() -> None:
    o = opts(contents=("stack",), profile_token_start=2, profile_token_end=5)
    s = vllm_launch_settings(o, "/traces/r1", "0.12.0")
    assert not s.uses_profiler_config and s.engine_kwargs() == {} and s.cli_args() == []
    assert s.env == {
        "VLLM_TORCH_PROFILER_DIR": "/traces/r1",
        "VLLM_TORCH_PROFILER_WITH_STACK": "1",
        "VLLM_TORCH_PROFILER_RECORD_SHAPES": "0",
        "VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY": "0",
        "VLLM_PROFILER_DELAY_ITERS": "3",
        "VLLM_PROFILER_MAX_ITERS": "3",
        "VLLM_TORCH_PROFILER_DISABLE_ASYNC_LLM": "1",
    }
    assert s.supports_window and not s.frontend_trace


def test_vllm_before_0_12_warns_that_the_window_is_ignored() -> None:
    s = vllm_launch_settings(opts(profile_token_start=2, profile_token_end=5), "/t", "0.8.5")
    assert "VLLM_PROFILER_DELAY_ITERS" not in s.env and s.env["VLLM_TORCH_PROFILER_DIR"] == "/t"
    assert s.frontend_trace and not s.supports_window
    assert any("no iteration window" in w and "[2, 5)" in w for w in s.warnings)
    # Without a window nothing needs saying.
    assert vllm_launch_settings(opts(), "/t", "0.8.5").warnings == ()


def test_vllm_unknown_version_and_bad_inputs() -> None:
    s = vllm_launch_settings(opts(), "/t", None)
    assert s.uses_profiler_config and any("version unknown" in w for w in s.warnings)
    with pytest.raises(ValueError, match="vllm_version"):
        vllm_launch_settings(opts(), "/t", "nightly")
    with pytest.raises(ValueError, match="trace_dir"):
        vllm_launch_settings(opts(), "", "0.13.0")
    assert parse_vllm_version("v0.10.1.dev3+g1") == (0, 10, 1)
    assert parse_vllm_version("1.0") == (1, 0, 0)


def test_vllm_contents_it_cannot_honour_are_warned() -> None:
    s = vllm_launch_settings(opts(contents=("cpu", "stack")), "/t", "0.13.0")
    assert any("contents without cuda" in w for w in s.warnings)
    npu = vllm_launch_settings(opts(tool="npu", contents=("cpu",)), "/t", "0.13.0")
    assert any("contents without npu" in w for w in npu.warnings)


def test_vllm_session_asking_for_other_settings_than_launched_is_told() -> None:
    launched = vllm_launch_settings(
        opts(contents=("cuda", "stack"), profile_token_end=8), "/t", "0.13.0"
    )
    assert (
        vllm_window_warnings(launched, opts(contents=("cuda", "stack"), profile_token_end=8)) == []
    )
    msgs = vllm_window_warnings(
        launched, opts(contents=("cuda", "shapes"), profile_token_start=1, profile_token_end=3)
    )
    text = " | ".join(msgs)
    assert (
        "delay_iterations=0, max_iterations=8" in text
        and "delay_iterations=2, max_iterations=2" in text
    )
    assert "'stack' is on" in text and "'shapes' is off" in text
    old = vllm_launch_settings(opts(), "/t", "0.9.0")
    assert any(
        "no iteration window" in m for m in vllm_window_warnings(old, opts(profile_token_end=3))
    )


def test_sglang_body_and_warnings() -> None:
    o = opts(
        tool="npu",
        contents=("npu", "module", "shapes", "memory"),
        profile_token_start=3,
        profile_token_end=9,
    )
    req = sglang_start_request(o, "/s/rollout-replica0")
    assert req.body == {
        "output_dir": "/s/rollout-replica0",
        "activities": ["CPU", "GPU", "MEM"],  # memory: SGLang's CUDA memory snapshot
        "with_stack": True,
        "record_shapes": True,
        "start_step": 3,
        "num_steps": 6,
    }
    assert req.stops_by_itself
    assert not any("memory" in w for w in req.warnings)
    assert any("start_step=3" in w for w in req.warnings)
    plain = sglang_start_request(opts(), "/d")
    assert plain.body == {
        "output_dir": "/d",
        "activities": ["CPU", "GPU"],
        "with_stack": False,
        "record_shapes": False,
    }
    assert plain.warnings == () and not plain.stops_by_itself
    assert sglang_start_request(opts(contents=("cpu",)), "/d").body["activities"] == ["CPU"]
    assert sglang_start_request(opts(profile_token_end=4), "/d").body["num_steps"] == 4
    with pytest.raises(ValueError, match="output_dir"):
        sglang_start_request(opts(), "")


@pytest.mark.parametrize(
    ("env", "warned"),
    [
        ({}, set()),
        ({"SGLANG_PROFILE_WITH_STACK": "true", "SGLANG_PROFILE_RECORD_SHAPES": "1"}, set()),
        ({"SGLANG_PROFILE_WITH_STACK": "false"}, {"SGLANG_PROFILE_WITH_STACK"}),
        # SGLang reads only true / 1 as true: "yes" turns the option off too
        ({"SGLANG_PROFILE_RECORD_SHAPES": "yes"}, {"SGLANG_PROFILE_RECORD_SHAPES"}),
    ],
)
def test_sglang_server_env_that_turns_options_off_is_warned(env, warned) -> None:
    req = sglang_start_request(opts(contents=("stack", "shapes")), "/d", env)
    assert {w.split("server's ")[1].split("=")[0] for w in req.warnings} == warned
    quiet = sglang_start_request(opts(), "/d", {"SGLANG_PROFILE_WITH_STACK": "0"})
    assert quiet.warnings == ()  # not asked for: nothing is lost


def test_sglang_profile_v2_is_refused_with_the_reason() -> None:
    assert sglang_env_refusal({}) is None and sglang_env_refusal(None) is None
    assert sglang_env_refusal({"SGLANG_PROFILE_V2": "0"}) is None
    why = sglang_env_refusal({"SGLANG_PROFILE_V2": "1"})
    assert why and "SGLANG_PROFILE_V2=1" in why and "relaunch it without" in why


def test_vllm_0_32_takes_the_window_per_start_and_honours_cpu_only() -> None:
    cpu_only = opts(contents=("cpu",), profile_token_start=1, profile_token_end=4)
    s = vllm_launch_settings(cpu_only, "/t", "0.32.0")
    assert s.window_per_request and s.profiler_config["torch_profiler_activities"] == ["CPU"]
    assert s.warnings == ()  # nothing it cannot honour
    full = vllm_launch_settings(opts(), "/t", "0.32.0")
    assert "torch_profiler_activities" not in full.profiler_config  # the platform's own
    # a different window is no longer "only after a relaunch": it goes with the start
    other = opts(profile_token_start=5, profile_token_end=9)
    assert vllm_window_warnings(full, other) == []
    assert vllm_start_body((0, 32, 0), other) == {"delay_iterations": 6, "max_iterations": 4}
    assert vllm_start_body((0, 31, 9), other) is None and vllm_start_body(None, other) is None
    # activities stay a launch-time setting
    (msg,) = vllm_window_warnings(full, opts(contents=("cpu",)))
    assert "records CPU and device activity" in msg and "asked for CPU only" in msg
    older = vllm_launch_settings(opts(profile_token_end=8), "/t", "0.13.0")
    assert not older.window_per_request
    assert any("only after a relaunch" in w for w in vllm_window_warnings(older, other))
