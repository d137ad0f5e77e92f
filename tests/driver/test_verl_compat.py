"""verl's own profiler config is accepted unchanged and mapped as verl would."""

from __future__ import annotations

import pytest
import yaml

from profd.core.errors import RequestInvalid
from profd.driver.verl import looks_like_verl, request_from_verl

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

    from profd.driver.launch import load_request

    cfg = yaml.safe_load(VERL_YAML)
    cfg["critic"]["profiler"]["save_path"] = "${global_profiler.save_path}"
    if importlib.util.find_spec("omegaconf") is None:
        with pytest.raises(ValueError, match=r"critic\.profiler\.save_path: holds an unresolved"):
            load_request(cfg)
    else:  # resolved as verl would
        assert load_request(cfg).save_path == "outputs/profile"


def _with(path: str, value: object) -> dict:
    """VERL_YAML with ``value`` at the dotted ``path`` (missing blocks are created)."""
    data = yaml.safe_load(VERL_YAML)
    node = data
    *head, last = path.split(".")
    for part in head:
        node = node.setdefault(part, {})
    node[last] = value
    return data


ACTOR = "actor_rollout_ref.actor.profiler"


@pytest.mark.parametrize(
    ("path", "value", "field", "fragment"),
    [
        (f"{ACTOR}.ranks", 5, f"{ACTOR}.ranks", "must be a list of integers"),
        (f"{ACTOR}.ranks", "0", f"{ACTOR}.ranks", "must be a list of integers"),
        (f"{ACTOR}.ranks", 0, f"{ACTOR}.ranks", "must be a list of integers"),  # not `[]`
        (f"{ACTOR}.ranks", {}, f"{ACTOR}.ranks", "must be a list of integers"),
        (f"{ACTOR}.enable", "yes", f"{ACTOR}.enable", "must be a boolean"),
        (f"{ACTOR}.enable", 1, f"{ACTOR}.enable", "must be a boolean"),
        (f"{ACTOR}.all_ranks", "false", f"{ACTOR}.all_ranks", "must be a boolean"),
        (f"{ACTOR}.tool_config", 5, f"{ACTOR}.tool_config", "must be a mapping"),
        (f"{ACTOR}.tool_config", [], f"{ACTOR}.tool_config", "must be a mapping"),
        (f"{ACTOR}.tool_config.torch", 5, f"{ACTOR}.tool_config.torch", "must be a mapping"),
        (f"{ACTOR}.tool_config.torch", "cpu", f"{ACTOR}.tool_config.torch", "must be a mapping"),
        (
            f"{ACTOR}.tool_config.torch.schedule",
            3,
            f"{ACTOR}.tool_config.torch.schedule",
            "must be a mapping",
        ),
        (
            f"{ACTOR}.tool_config.torch.discrete",
            "no",  # bool("no") is True: was silently discrete
            f"{ACTOR}.tool_config.torch.discrete",
            "must be a boolean",
        ),
        (
            f"{ACTOR}.tool_config.precision_debugger",
            7,
            f"{ACTOR}.tool_config.precision_debugger",
            "must be a mapping",
        ),
        (ACTOR, 5, ACTOR, "must be a mapping"),
        (
            "actor_rollout_ref.rollout.profiler",
            [1],
            "actor_rollout_ref.rollout.profiler",
            "mapping",
        ),
        ("actor_rollout_ref", "x", "actor_rollout_ref", "must be a mapping"),
        ("actor_rollout_ref.actor", 5, "actor_rollout_ref.actor", "must be a mapping"),
        ("critic.profiler", True, "critic.profiler", "must be a mapping"),
        ("global_profiler", 5, "global_profiler", "must be a mapping"),
        ("global_profiler", [], "global_profiler", "must be a mapping"),
        ("global_profiler.tool", 5, "global_profiler.tool", "must be a string"),
        ("global_profiler.steps", 3, "global_profiler.steps", "must be a list of integers"),
        ("global_profiler.steps", "1,2", "global_profiler.steps", "must be a list of integers"),
        ("global_profiler.steps", [1, "x"], "global_profiler.steps.1", "integer"),
        (
            "global_profiler.global_tool_config",
            5,
            "global_profiler.global_tool_config",
            "must be a mapping",
        ),
        (
            "global_profiler.global_tool_config.torch_memory",
            "big",
            "global_profiler.global_tool_config.torch_memory",
            "must be a mapping",
        ),
        (
            "global_profiler.global_tool_config.nsys",
            [],
            "global_profiler.global_tool_config.nsys",
            "must be a mapping",
        ),
        (
            "global_profiler.global_tool_config.nsys.discrete",
            "yes",
            "global_profiler.global_tool_config.nsys.discrete",
            "must be a boolean",
        ),
        ("global_profiler.save_path", 5, "global_profiler.save_path", "string"),
        ("global_profiler.save_path", "a" * 5000, "global_profiler.save_path", "at most 3584"),
        (
            "global_profiler.profile_continuous_steps",
            "y",
            "global_profiler.profile_continuous_steps",
            "bool",
        ),
    ],
)
def test_wrong_types_name_the_verl_field(path: str, value: object, field: str, fragment: str):
    with pytest.raises(RequestInvalid) as info:
        request_from_verl(_with(path, value))
    fields = {f.field: f.message for f in info.value.fields}
    assert field in fields, fields
    assert fragment in fields[field], fields[field]


def test_a_config_that_is_not_a_mapping_is_refused() -> None:
    with pytest.raises(RequestInvalid) as info:
        request_from_verl([1, 2])  # type: ignore[arg-type]
    assert [f.field for f in info.value.fields] == ["config"]


def test_non_string_keys_are_named_not_a_type_error() -> None:
    data = _with("global_profiler.stepz", 1)
    data["global_profiler"][3] = "x"  # YAML `3: x`: mixed key types once broke the sort
    with pytest.raises(RequestInvalid) as info:
        request_from_verl(data)
    assert info.value.fields[0].field in {"global_profiler.3", "global_profiler.stepz"}
    data = _with(f"{ACTOR}.tool_config.torch.bogus", 1)
    data["actor_rollout_ref"]["actor"]["profiler"]["tool_config"]["torch"][0] = 1
    with pytest.raises(RequestInvalid, match=r"tool_config\.torch\.(0|bogus): unknown key"):
        request_from_verl(data)


def test_inherited_values_are_named_where_they_were_written() -> None:
    # torch_memory sizes come from global_tool_config: a bad one is named there.
    data = _with("global_profiler.global_tool_config.torch_memory.stack_depth", 0)
    with pytest.raises(RequestInvalid) as info:
        request_from_verl(data)
    assert {f.field for f in info.value.fields} == {
        "global_profiler.global_tool_config.torch_memory.stack_depth"
    }
    # The rollout block inherits the actor's ranks: named once, at the actor.
    with pytest.raises(RequestInvalid) as info:
        request_from_verl(_with(f"{ACTOR}.ranks", [-1]))
    assert [f.field for f in info.value.fields] == [f"{ACTOR}.ranks.0"]
    # ... even when only the rollout is enabled.
    data = _with(f"{ACTOR}.ranks", [-1])
    data["actor_rollout_ref"]["actor"]["profiler"]["enable"] = False
    data["critic"]["profiler"]["enable"] = False
    data["actor_rollout_ref"]["rollout"]["profiler"]["enable"] = True
    with pytest.raises(RequestInvalid) as info:
        request_from_verl(data)
    assert [f.field for f in info.value.fields] == [f"{ACTOR}.ranks.0"]


def test_role_own_values_still_win_over_inherited_ones() -> None:
    data = _with("actor_rollout_ref.rollout.profiler.ranks", [3])
    data["actor_rollout_ref"]["rollout"]["profiler"]["tool_config"]["torch"]["contents"] = ["cuda"]
    data["actor_rollout_ref"]["rollout"]["profiler"]["tool_config"]["torch_memory"] = {
        "stack_depth": 4
    }
    req = request_from_verl(data)
    rollout = req.roles["rollout"]
    assert rollout.ranks == (3,) and rollout.tool_config.torch.contents == ("cuda",)
    assert rollout.tool_config.torch_memory.stack_depth == 4  # not global_tool_config's 8
    assert rollout.tool_config.torch_memory.trace_alloc_max_entries == 5000


def test_a_broken_or_missing_yaml_file_is_named_with_its_line(tmp_path) -> None:
    from profd.driver.launch import load_request

    broken = tmp_path / "verl.yaml"
    broken.write_text("global_profiler:\n  steps: [1, 2\n  tool: torch\n")
    with pytest.raises(RequestInvalid) as info:
        load_request(broken)
    (err,) = info.value.fields
    assert err.field == "config" and str(broken) in err.message and "line 3" in err.message
    assert "unicode string" not in err.message
    with pytest.raises(RequestInvalid, match=r"config: .*nowhere\.yaml.*No such file"):
        load_request(tmp_path / "nowhere.yaml")
