"""Config core: validation rules of the reference (§2) with errors that name the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from profd.core.request import (
    GlobalProfilerConfig,
    RoleProfilerConfig,
    SessionRequest,
    ToolKind,
    TorchScheduleConfig,
    TorchToolConfig,
    field_errors,
)


def errors_of(data: dict) -> dict[str, str]:
    with pytest.raises(ValidationError) as info:
        SessionRequest.model_validate(data)
    return {e.field: e.message for e in field_errors(info.value)}


def test_minimal_request_defaults() -> None:
    req = SessionRequest.model_validate({"next_steps": 2})
    assert req.tool is ToolKind.TORCH
    assert req.next_steps == 2 and req.steps is None
    assert req.roles == {}
    assert req.profile_continuous_steps is False


def test_steps_are_sorted_and_deduplicated() -> None:
    req = SessionRequest.model_validate({"steps": [5, 1, 2, 2]})
    assert req.steps == (1, 2, 5)


def test_exactly_one_window_kind() -> None:
    errs = errors_of({"steps": [1], "next_steps": 2})
    assert "steps" in errs and "exactly one" in errs["steps"]
    errs = errors_of({})
    assert "exactly one" in errs["steps"]


@pytest.mark.parametrize(
    ("data", "field", "fragment"),
    [
        ({"steps": []}, "steps", "at least one step"),
        ({"steps": [-1]}, "steps.0", "greater than or equal to 0"),
        ({"steps": [True]}, "steps.0", "valid integer"),
        ({"next_steps": 0}, "next_steps", "greater than 0"),
        ({"next_steps": 2, "wait_for_agents": True}, "wait_for_agents", "explicit `steps`"),
        ({"next_steps": 1, "tool": "gpu"}, "tool", "'torch'"),
        ({"next_steps": 1, "bogus": 1}, "bogus", "Extra inputs"),
        ({"next_steps": 1, "finish_hook_cmd": "  "}, "finish_hook_cmd", "non-empty"),
        ({"next_steps": 1, "finish_hook_ranks": [1.5]}, "finish_hook_ranks.0", "integer"),
        (
            {"next_steps": 1, "roles": {"actor": {"ranks": [-2]}}},
            "roles.actor.ranks.0",
            "greater than or equal to 0",
        ),
        ({"next_steps": 1, "roles": {"actor": {"ranks": "0"}}}, "roles.actor.ranks", "a list"),
        ({"next_steps": 1, "roles": {"actor": {"enable": "yes"}}}, "roles.actor.enable", "bool"),
        ({"next_steps": 1, "roles": {"actor": {"rank": [0]}}}, "roles.actor.rank", "Extra"),
        ({"next_steps": 1, "roles": {"bad role!": {}}}, "roles.bad role!", "pattern"),
        (
            {"next_steps": 1, "roles": {"a": {"tool_config": {"py_spy": {"rate_hz": 0}}}}},
            "roles.a.tool_config.py_spy.rate_hz",
            "greater than or equal to 1",
        ),
        (
            {"next_steps": 1, "roles": {"a": {"tool_config": {"nsys": {"settle_s": 0}}}}},
            "roles.a.tool_config.nsys.settle_s",
            "greater than 0",
        ),
        (
            {"next_steps": 1, "roles": {"actor": {"tool_config": {"precision_debugger": {}}}}},
            "roles.actor.tool_config.precision_debugger",
            "Extra",
        ),
        (
            {"next_steps": 1, "roles": {"a": {"tool_config": {"torch": {"contents": ["gpu"]}}}}},
            "roles.a.tool_config.torch.contents.0",
            "'cuda'",
        ),
        (
            {"next_steps": 1, "roles": {"a": {"tool_config": {"torch": {"contents": "cpu"}}}}},
            "roles.a.tool_config.torch.contents",
            "a list",
        ),
        (
            {
                "next_steps": 1,
                "roles": {"a": {"tool_config": {"torch": {"schedule": {"active": -1}}}}},
            },
            "roles.a.tool_config.torch.schedule.active",
            "greater than or equal to 0",
        ),
        (
            {
                "next_steps": 1,
                "roles": {
                    "rollout": {
                        "tool_config": {"torch": {"profile_token_start": 5, "profile_token_end": 5}}
                    }
                },
            },
            "roles.rollout.tool_config.torch.profile_token_end",
            "must be > profile_token_start, got start=5, end=5",
        ),
        (
            {
                "next_steps": 1,
                "roles": {"a": {"tool_config": {"torch_memory": {"stack_depth": 0}}}},
            },
            "roles.a.tool_config.torch_memory.stack_depth",
            "greater than 0",
        ),
        (
            {"next_steps": 1, "roles": {"a": {"tool_config": {"npu": {"level": "level9"}}}}},
            "roles.a.tool_config.npu.level",
            "'level0'",
        ),
    ],
)
def test_invalid_values_name_the_field(data: dict, field: str, fragment: str) -> None:
    errs = errors_of(data)
    assert field in errs, errs
    assert fragment.lower() in errs[field].lower(), errs[field]


def test_validation_error_is_a_value_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"roles\.actor\.ranks"):
        SessionRequest.model_validate({"next_steps": 1, "roles": {"actor": {"ranks": ["x"]}}})


def test_models_are_frozen() -> None:
    block = RoleProfilerConfig()
    with pytest.raises(ValidationError):
        block.enable = False  # type: ignore[misc]


def test_contents_mapping_matches_the_reference() -> None:
    empty = TorchToolConfig()
    assert empty.with_cuda and not empty.record_shapes and not empty.with_stack
    cpu_only = TorchToolConfig(contents=("cpu",))
    assert not cpu_only.with_cuda
    full = TorchToolConfig(contents=("cuda", "shapes", "memory", "stack"))
    assert full.with_cuda and full.record_shapes and full.profile_memory and full.with_stack
    assert full.contents == ("cuda", "shapes", "memory", "stack")  # never modified


def test_schedule_enabled_by_active_only() -> None:
    assert not TorchScheduleConfig(skip_first=3, wait=1).enabled
    assert TorchScheduleConfig(active=1).enabled


def test_global_block_is_its_own_model() -> None:
    g = GlobalProfilerConfig(steps=(3, 1))
    assert g.steps == (1, 3) and g.save_path is None and g.finish_hook_ranks == ()
    with pytest.raises(ValidationError, match="tool"):
        GlobalProfilerConfig(tool="precision_debugger")


def test_role_block_defaults_enable_when_listed() -> None:
    req = SessionRequest.model_validate({"next_steps": 1, "roles": {"critic": {}}})
    block = req.roles["critic"]
    assert block.enable and not block.all_ranks and block.ranks == () and not block.discrete
    assert block.tool_config.torch_memory.trace_alloc_max_entries == 100_000
    assert block.tool_config.for_tool(ToolKind.TORCH) is block.tool_config.torch


def test_installed_names_do_not_squat_generic_modules(tmp_path) -> None:
    """`api` and `actors` install as profd.api / profd.actors: outside the repository a user's
    own `api` or `actors` module is never shadowed by profd."""
    import subprocess
    import sys

    code = (
        "import importlib.util as u; "
        "print([u.find_spec(n) is None for n in ('api', 'actors')], "
        "u.find_spec('profd.api') is not None, u.find_spec('profd.actors') is not None)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[True, True] True True"


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("value", [NAN, INF, -INF, "nan", "inf"])
@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"duration_s": None}, "duration_s"),
        ({"next_steps": 1, "finish_hook_timeout_s": None}, "finish_hook_timeout_s"),
        (
            {"next_steps": 1, "roles": {"a": {"tool_config": {"nsys": {"flush_timeout_s": None}}}}},
            "roles.a.tool_config.nsys.flush_timeout_s",
        ),
        (
            {"next_steps": 1, "roles": {"a": {"tool_config": {"nsys": {"settle_s": None}}}}},
            "roles.a.tool_config.nsys.settle_s",
        ),
    ],
)
def test_floats_must_be_finite(data: dict, field: str, value: object) -> None:
    import json

    text = json.dumps(data).replace("null", json.dumps(value))
    errs = errors_of(json.loads(text))
    assert field in errs, errs
    assert "finite number" in errs[field], errs[field]
    assert "86400" not in errs[field]


def test_every_float_field_refuses_nan() -> None:
    """No float field of the request (or of a model nested in it) is left accepting NaN."""
    from pydantic import BaseModel

    seen: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            ann = info.annotation
            args = getattr(ann, "__args__", ())
            if ann is float or float in args:
                seen.append(f"{prefix}{name}")
                with pytest.raises(ValidationError, match="finite number"):
                    model.model_validate({name: NAN})
            for sub in (ann, *args):
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    walk(sub, f"{prefix}{name}.")

    walk(SessionRequest, "")
    from profd.core.request import ToolConfigs

    walk(ToolConfigs, "roles.*.tool_config.")
    assert "duration_s" in seen and "roles.*.tool_config.nsys.settle_s" in seen, seen


def test_save_path_length_rules() -> None:
    from profd.core.request import MAX_SAVE_PATH_BYTES, NAME_MAX, PATH_MAX

    # Room below the longest accepted save_path for /<session id>/<subdir>/<file name>.
    assert (
        MAX_SAVE_PATH_BYTES + len("/20250101-120000-abcd/rollout-engine-replica99/") + NAME_MAX
        < PATH_MAX
    )
    longest = "/" + "/".join(["d" * NAME_MAX] * 13)
    longest += "/" + "e" * (MAX_SAVE_PATH_BYTES - len(longest) - 1)
    assert len(longest) == MAX_SAVE_PATH_BYTES
    assert SessionRequest(next_steps=1, save_path=longest).save_path == longest
    errs = errors_of({"next_steps": 1, "save_path": longest + "e"})
    assert f"at most {MAX_SAVE_PATH_BYTES} bytes" in errs["save_path"], errs
    errs = errors_of({"next_steps": 1, "save_path": "x" * 5000})
    assert "PATH_MAX" in errs["save_path"] and "got 5000" in errs["save_path"]
    # A component over NAME_MAX, counted in UTF-8 bytes (128 characters, 256 bytes).
    errs = errors_of({"next_steps": 1, "save_path": "/tmp/" + "é" * 128 + "/x"})
    assert "NAME_MAX" in errs["save_path"] and "got 256 bytes" in errs["save_path"], errs
    assert SessionRequest(next_steps=1, save_path="/tmp/" + "é" * 127).save_path


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"next_steps": 1, "save_path": "/tmp/a\x00b"}, "save_path"),
        ({"next_steps": 1, "finish_hook_cmd": "echo \x00"}, "finish_hook_cmd"),
        ({"next_steps": 1, "upload_uri": "file:///tmp/\x00"}, "upload_uri"),
    ],
)
def test_nul_characters_are_refused(data: dict, field: str) -> None:
    errs = errors_of(data)
    assert "NUL" in errs.get(field, ""), errs


def test_lone_surrogates_in_save_path_are_named() -> None:
    errs = errors_of({"next_steps": 1, "save_path": "/tmp/\ud800"})
    assert "lone surrogates" in errs["save_path"], errs
    # Undecodable bytes as os.fsdecode() gives them are a valid path.
    assert SessionRequest(next_steps=1, save_path="/tmp/\udcff").save_path
