"""verl's own profiler config is accepted unchanged and mapped as verl would."""

from __future__ import annotations

import pytest
import yaml

from profd.errors import RequestInvalid
from profd.verl_compat import looks_like_verl, request_from_verl

VERL_YAML = """
global_profiler:
  _target_: verl.utils.profiler.ProfilerConfig
  tool: torch
  steps: [5, 1, 2]
  profile_continuous_steps: true
  save_path: outputs/profile
  global_tool_config:
    torch_memory: {trace_alloc_max_entries: 5000, stack_depth: 8}
actor_rollout_ref:
  actor:
    profiler:
      enable: true
      all_ranks: false
      ranks: [0, 8]
      tool_config:
        torch:
          contents: [cpu, stack]
          discrete: true
          schedule: {skip_first: 1, wait: 0, warmup: 0, active: 2, repeat: 0}
        npu: {contents: [], level: level0, analysis: true, discrete: false}
  ref:
    profiler:
      enable: false
  rollout:
    profiler:
      tool_config:
        torch: {profile_token_start: 16, profile_token_end: 64}
critic:
  profiler:
    enable: true
    all_ranks: true
    tool_config:
      torch: {contents: [], discrete: false}
"""


def test_verl_layout_maps_to_a_session() -> None:
    data = yaml.safe_load(VERL_YAML)
    assert looks_like_verl(data)
    req = request_from_verl(data)
    assert req.tool.value == "torch" and req.steps == (1, 2, 5)
    assert req.profile_continuous_steps and req.save_path == "outputs/profile"
    assert set(req.roles) == {"actor", "rollout", "critic"}  # ref is disabled
    actor = req.roles["actor"]
    assert actor.ranks == (0, 8) and actor.discrete
    assert actor.tool_config.torch.contents == ("cpu", "stack")
    assert actor.tool_config.torch.schedule.active == 2
    assert actor.tool_config.torch_memory.stack_depth == 8  # from global_tool_config
    rollout = req.roles["rollout"]  # follows the actor unless it says otherwise
    assert rollout.enable and rollout.ranks == (0, 8) and rollout.discrete
    assert rollout.tool_config.torch.contents == ("cpu", "stack")
    assert rollout.tool_config.torch.profile_token_end == 64
    critic = req.roles["critic"]
    assert critic.all_ranks and not critic.discrete


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"global_profiler": {"tool": None, "steps": [1]}}, "global_profiler.tool"),
        ({"global_profiler": {"tool": "torch", "steps": None}}, "global_profiler.steps"),
        ({"global_profiler": {"tool": "torch", "steps": [1], "stepz": 1}}, "global_profiler.stepz"),
        (
            {
                "global_profiler": {"tool": "nvprof", "steps": [1]},
                "actor": {"profiler": {"enable": True}},
            },
            "global_profiler.tool",
        ),
        (
            {
                "global_profiler": {"tool": "torch", "steps": [1]},
                "actor": {"profiler": {"enable": True, "ranks": ["x"]}},
            },
            "actor.profiler.ranks.0",
        ),
        (
            {
                "global_profiler": {"tool": "torch", "steps": [1]},
                "actor": {"profiler": {"enable": True, "tool_config": {"torch": {"bad": 1}}}},
            },
            "actor.profiler.tool_config.torch.bad",
        ),
        (
            {
                "global_profiler": {"tool": "torch", "steps": [1]},
                "actor": {"profiler": {"enable": False}},
            },
            "actor_rollout_ref.actor.profiler.enable",
        ),
    ],
)
def test_errors_name_verl_fields(patch: dict, field: str) -> None:
    with pytest.raises(RequestInvalid) as info:
        request_from_verl(patch)
    assert field in {f.field for f in info.value.fields}, info.value.fields


def test_unresolved_interpolations_are_named() -> None:
    import importlib.util

    from profd.launch import load_request

    cfg = yaml.safe_load(VERL_YAML)
    cfg["critic"]["profiler"]["save_path"] = "${global_profiler.save_path}"
    if importlib.util.find_spec("omegaconf") is None:
        with pytest.raises(ValueError, match=r"critic\.profiler\.save_path: holds an unresolved"):
            load_request(cfg)
    else:  # resolved as verl would
        assert load_request(cfg).save_path == "outputs/profile"
