"""Accept verl's own profiler config (``global_profiler`` + ``<role>.profiler``) unchanged.

The role blocks are looked up where verl keeps them (``actor_rollout_ref.actor.profiler``,
``actor_rollout_ref.ref.profiler``, ``actor_rollout_ref.rollout.profiler``,
``critic.profiler``, ``reward_model.profiler``) or at the top level (``actor.profiler``).
verl's inheritance is applied (reference §3.1): the rollout block takes the actor's
``enable`` / ``all_ranks`` / ``ranks`` and torch/npu ``contents`` / ``discrete`` unless it sets
them; ``torch_memory`` sizes default to ``global_tool_config``. ``discrete`` moves from
``tool_config.<tool>.discrete`` to the role level, where profd keeps it.

Errors name verl's dotted path (``actor_rollout_ref.actor.profiler.ranks``), so a verl user
can fix the file they already have. Every type this module relies on is checked before it is
used (blocks are mappings, ``ranks`` / ``steps`` lists, flags booleans, ``tool`` a string), so
any malformed config raises :class:`~profd.core.errors.RequestInvalid` naming the field and the
rule, never a ``TypeError`` from inside the mapping. A value inherited from elsewhere (the
rollout block's from the actor, ``torch_memory`` sizes from ``global_tool_config``) is
reported where it was written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from profd.core.errors import RequestInvalid
from profd.core.request import FieldError, SessionRequest, ToolKind, field_errors

__all__ = ["looks_like_verl", "request_from_verl"]

ROLE_PATHS = {
    "actor": ("actor_rollout_ref.actor.profiler", "actor.profiler"),
    "ref": ("actor_rollout_ref.ref.profiler", "ref.profiler"),
    "rollout": ("actor_rollout_ref.rollout.profiler", "rollout.profiler"),
    "critic": ("critic.profiler",),
    "reward_model": ("reward_model.profiler", "reward.profiler"),
}
#: verl keys that profd takes from the global block instead (same value in practice).
ROLE_KEYS_FROM_GLOBAL = {
    "tool",
    "save_path",
    "relocate_results",
    "finish_hook_cmd",
    "finish_hook_all_ranks",
    "finish_hook_ranks",
    "global_tool_config",
    "_target_",
}
#: verl's global block: the keys roles share, plus the steps.
GLOBAL_KEYS = ROLE_KEYS_FROM_GLOBAL | {"steps", "profile_continuous_steps"}
TOOL_KEYS = {
    "torch": {
        "contents",
        "discrete",
        "schedule",
        "profile_token_start",
        "profile_token_end",
        "_target_",
    },
    "npu": {
        "contents",
        "level",
        "analysis",
        "discrete",
        "profile_token_start",
        "profile_token_end",
        "_target_",
    },
    "nsys": {"discrete", "_target_"},
    "torch_memory": {"trace_alloc_max_entries", "stack_depth", "_target_"},
    "precision_debugger": None,  # not supported by profd: ignored unless it is the tool
}


def looks_like_verl(data: Mapping[str, Any]) -> bool:
    return isinstance(data, Mapping) and "global_profiler" in data


def _kind(value: Any) -> str:
    """How a value reads in an error message (JSON / YAML vocabulary)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return f"a {type(value).__name__}"


def _mapping(value: Any, path: str) -> Mapping[str, Any] | None:
    """``value`` when it is a mapping, ``None`` when it is null; anything else is an error."""
    if value is None or isinstance(value, Mapping):
        return value
    raise RequestInvalid.at(path, f"must be a mapping, got {_kind(value)}")


def _int_list(value: Any, path: str) -> list[Any] | None:
    """A list (its items are checked by :class:`SessionRequest`, which names the index)."""
    if value is None or isinstance(value, list | tuple):
        return None if value is None else list(value)
    raise RequestInvalid.at(path, f"must be a list of integers, got {_kind(value)}")


def _flag(value: Any, path: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise RequestInvalid.at(path, f"must be a boolean (true or false), got {_kind(value)}")


def _no_extra(raw: Mapping[Any, Any], allowed: set[str], path: str) -> None:
    extra = set(raw) - allowed
    if extra:  # keys may be of any type in YAML (``1: x``): sort them as text
        raise RequestInvalid.at(f"{path}.{sorted(extra, key=str)[0]}", "unknown key")


def _lookup(data: Mapping[str, Any], dotted: str) -> Any:
    """The node at ``dotted``; ``None`` when a step is absent or null. A step that is present
    but not a mapping is an error: the block below it could not be read."""
    node: Any = data
    walked: list[str] = []
    for part in dotted.split("."):
        if node is None:
            return None
        if not isinstance(node, Mapping):
            raise RequestInvalid.at(".".join(walked), f"must be a mapping, got {_kind(node)}")
        if part not in node:
            return None
        node = node[part]
        walked.append(part)
    return node


def _strip_target(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != "_target_"}


def _global_tool_configs(g: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """``global_tool_config``: the blocks profd reads must be mappings; ``discrete`` a bool."""
    path = "global_profiler.global_tool_config"
    gtc = _mapping(g.get("global_tool_config"), path) or {}
    out: dict[str, Mapping[str, Any]] = {}
    for tool in TOOL_KEYS:  # verl keeps more (nsight options, ...): other keys are ignored
        cfg = _mapping(gtc.get(tool), f"{path}.{tool}")
        if cfg is not None:
            _flag(cfg.get("discrete"), f"{path}.{tool}.discrete")
            out[tool] = cfg
    return out


def _tool_configs(
    raw: Mapping[str, Any],
    path: str,
    gtc: Mapping[str, Mapping[str, Any]],
    origins: dict[str, str],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tool, cfg in raw.items():
        tool_path = f"{path}.{tool}"
        if tool not in TOOL_KEYS:
            raise RequestInvalid.at(
                tool_path, f"unknown tool (expected one of {', '.join(sorted(TOOL_KEYS))})"
            )
        cfg = _mapping(cfg, tool_path)
        allowed = TOOL_KEYS[tool]
        if allowed is None or cfg is None:
            continue
        _no_extra(cfg, allowed, tool_path)
        _flag(cfg.get("discrete"), f"{tool_path}.discrete")
        cfg = _strip_target(cfg)
        cfg.pop("discrete", None)
        if tool == "nsys":
            continue
        if tool == "torch" and cfg.get("schedule") is not None:
            cfg["schedule"] = _strip_target(_mapping(cfg["schedule"], f"{tool_path}.schedule"))
        out[tool] = {k: v for k, v in cfg.items() if v is not None}
    tm = gtc.get("torch_memory") or {}
    own = out.get("torch_memory", {})
    for key in ("trace_alloc_max_entries", "stack_depth"):
        if tm.get(key) is not None and key not in own:
            out.setdefault("torch_memory", {})[key] = tm[key]
            origins[f"tool_config.torch_memory.{key}"] = (
                f"global_profiler.global_tool_config.torch_memory.{key}"
            )
    return out


def _discrete(
    tool_config: Mapping[str, Any], tool: str, gtc: Mapping[str, Mapping[str, Any]]
) -> bool | None:
    tc = tool_config.get(tool)
    if isinstance(tc, Mapping) and tc.get("discrete") is not None:
        return tc["discrete"]
    if tool == "nsys":
        return (gtc.get("nsys") or {}).get("discrete")
    return None


def _role_block(
    raw: Mapping[str, Any],
    path: str,
    tool: str,
    gtc: Mapping[str, Mapping[str, Any]],
    parent: tuple[dict[str, Any], str] | None,
    origins: dict[str, str],
) -> dict[str, Any]:
    """profd's block for one role. ``origins`` maps a profd path inside the block to the verl
    path the value came from, when that is not ``<path>.<same path>`` (inherited values)."""
    _no_extra(raw, {"enable", "all_ranks", "ranks", "tool_config"} | ROLE_KEYS_FROM_GLOBAL, path)
    enable = _flag(raw.get("enable"), f"{path}.enable")
    all_ranks = _flag(raw.get("all_ranks"), f"{path}.all_ranks")
    ranks = _int_list(raw.get("ranks"), f"{path}.ranks")
    tool_config = _mapping(raw.get("tool_config"), f"{path}.tool_config") or {}
    block: dict[str, Any] = {
        "enable": bool(enable),
        "all_ranks": bool(all_ranks),
        "ranks": ranks or [],
        "tool_config": _tool_configs(tool_config, f"{path}.tool_config", gtc, origins),
    }
    discrete = _discrete(tool_config, tool, gtc)
    if parent is not None:  # rollout follows the actor unless it says otherwise
        actor, actor_path = parent
        for key, value in (("enable", enable), ("all_ranks", all_ranks), ("ranks", ranks)):
            if value is None:
                block[key] = actor[key]
                origins[key] = f"{actor_path}.{key}"
        if discrete is None:
            discrete = actor.get("discrete")
        for t in ("torch", "npu"):
            inherited = actor["tool_config"].get(t, {}).get("contents")
            if inherited is not None and "contents" not in block["tool_config"].get(t, {}):
                block["tool_config"].setdefault(t, {})["contents"] = inherited
                origins[f"tool_config.{t}.contents"] = f"{actor_path}.tool_config.{t}.contents"
    if discrete is not None:
        block["discrete"] = discrete
    return block


def _verl_field(fe: FieldError, paths: dict[str, str], origins: dict[str, dict[str, str]]) -> str:
    """verl's dotted path for an error profd's model reported at ``fe.field``."""
    parts = fe.field.split(".")
    if parts[0] == "roles" and len(parts) > 1 and parts[1] in paths:
        inner = ".".join(parts[2:])
        for key in sorted(origins.get(parts[1], {}), key=len, reverse=True):
            if inner == key or inner.startswith(key + "."):
                return origins[parts[1]][key] + inner[len(key) :]
        return ".".join([paths[parts[1]], *parts[2:]])
    return f"global_profiler.{fe.field}" if fe.field else "global_profiler"


def request_from_verl(data: Mapping[str, Any]) -> SessionRequest:
    """Build a :class:`SessionRequest` from a verl config (a dict, e.g. loaded YAML).

    Every error is a :class:`RequestInvalid` naming verl's dotted field and the rule.
    """
    if not isinstance(data, Mapping):
        raise RequestInvalid.at("config", f"must be a mapping (a verl config), got {_kind(data)}")
    g = data.get("global_profiler")
    if not isinstance(g, Mapping):
        raise RequestInvalid.at("global_profiler", f"must be a mapping, got {_kind(g)}")
    _no_extra(g, GLOBAL_KEYS, "global_profiler")
    tool = g.get("tool")
    if tool is None:
        raise RequestInvalid.at("global_profiler.tool", "is null, which turns profiling off")
    if not isinstance(tool, str):
        raise RequestInvalid.at(
            "global_profiler.tool",
            f"must be a string naming the tool (one of {', '.join(ToolKind)}), got {_kind(tool)}",
        )
    steps = _int_list(g.get("steps"), "global_profiler.steps")
    if not steps:
        raise RequestInvalid.at("global_profiler.steps", "is empty or null: nothing to profile")
    gtc = _global_tool_configs(g)
    roles: dict[str, Any] = {}
    paths: dict[str, str] = {}
    origins: dict[str, dict[str, str]] = {}
    for role, candidates in ROLE_PATHS.items():
        for dotted in candidates:
            raw = _mapping(_lookup(data, dotted), dotted)
            if raw is not None:
                parent = (
                    (roles["actor"], paths["actor"])
                    if role == "rollout" and "actor" in roles
                    else None
                )
                origins[role] = {}
                roles[role] = _role_block(raw, dotted, tool, gtc, parent, origins[role])
                paths[role] = dotted
                break
    enabled = {r: b for r, b in roles.items() if b["enable"]}
    if not enabled:
        raise RequestInvalid.at(
            "actor_rollout_ref.actor.profiler.enable",
            "no role has profiler.enable=true, so verl would profile nothing",
        )
    body = {k: g[k] for k in GLOBAL_KEYS - {"global_tool_config", "_target_"} if k in g}
    body = {k: v for k, v in body.items() if v is not None}
    body["roles"] = enabled
    try:
        return SessionRequest.model_validate(body)
    except ValidationError as exc:
        fields: list[FieldError] = []
        for fe in field_errors(exc):
            mapped = FieldError(
                field=_verl_field(fe, paths, origins), message=fe.message, type=fe.type
            )
            if mapped not in fields:  # an inherited value fails in each role that holds it
                fields.append(mapped)
        raise RequestInvalid.from_fields(fields) from None
