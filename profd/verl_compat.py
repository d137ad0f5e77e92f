"""Accept verl's own profiler config (``global_profiler`` + ``<role>.profiler``) unchanged.

The role blocks are looked up where verl keeps them (``actor_rollout_ref.actor.profiler``,
``actor_rollout_ref.ref.profiler``, ``actor_rollout_ref.rollout.profiler``,
``critic.profiler``, ``reward_model.profiler``) or at the top level (``actor.profiler``).
verl's inheritance is applied (reference §3.1): the rollout block takes the actor's
``enable`` / ``all_ranks`` / ``ranks`` and torch/npu ``contents`` / ``discrete`` unless it sets
them; ``torch_memory`` sizes default to ``global_tool_config``. ``discrete`` moves from
``tool_config.<tool>.discrete`` to the role level, where profd keeps it.

Errors name verl's dotted path (``actor_rollout_ref.actor.profiler.ranks``), so a verl user
can fix the file they already have.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from profd.config import FieldError, SessionRequest, field_errors
from profd.errors import RequestInvalid

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
GLOBAL_KEYS = {
    "tool",
    "steps",
    "profile_continuous_steps",
    "save_path",
    "relocate_results",
    "finish_hook_cmd",
    "finish_hook_all_ranks",
    "finish_hook_ranks",
    "global_tool_config",
    "_target_",
}
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


def _lookup(data: Mapping[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _strip_target(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != "_target_"}


def _tool_configs(raw: Mapping[str, Any], path: str, gtc: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tool, cfg in (raw or {}).items():
        if tool not in TOOL_KEYS:
            raise RequestInvalid.at(
                f"{path}.{tool}", f"unknown tool (expected one of {', '.join(sorted(TOOL_KEYS))})"
            )
        allowed = TOOL_KEYS[tool]
        if allowed is None or cfg is None:
            continue
        extra = set(cfg) - allowed
        if extra:
            raise RequestInvalid.at(f"{path}.{tool}.{sorted(extra)[0]}", "unknown key")
        cfg = _strip_target(cfg)
        cfg.pop("discrete", None)
        if tool == "nsys":
            continue
        if tool == "torch" and cfg.get("schedule") is not None:
            cfg["schedule"] = _strip_target(cfg["schedule"])
        out[tool] = {k: v for k, v in cfg.items() if v is not None}
    tm = dict((gtc or {}).get("torch_memory") or {})
    tm = {k: tm[k] for k in ("trace_alloc_max_entries", "stack_depth") if tm.get(k) is not None}
    if tm:
        out["torch_memory"] = {**tm, **out.get("torch_memory", {})}
    return out


def _discrete(raw: Mapping[str, Any], tool: str, gtc: Mapping[str, Any]) -> bool | None:
    tc = (raw.get("tool_config") or {}).get(tool) or {}
    if "discrete" in tc and tc["discrete"] is not None:
        return bool(tc["discrete"])
    if tool == "nsys":
        value = ((gtc or {}).get("nsys") or {}).get("discrete")
        return None if value is None else bool(value)
    return None


def _role_block(
    raw: Mapping[str, Any],
    path: str,
    tool: str,
    gtc: Mapping[str, Any],
    parent: dict[str, Any] | None,
) -> dict[str, Any]:
    known = {"enable", "all_ranks", "ranks", "tool_config"} | ROLE_KEYS_FROM_GLOBAL
    extra = set(raw) - known
    if extra:
        raise RequestInvalid.at(f"{path}.{sorted(extra)[0]}", "unknown key")
    block: dict[str, Any] = {
        "enable": raw.get("enable", False),
        "all_ranks": raw.get("all_ranks", False),
        "ranks": list(raw.get("ranks") or []),
        "tool_config": _tool_configs(raw.get("tool_config") or {}, f"{path}.tool_config", gtc),
    }
    discrete = _discrete(raw, tool, gtc)
    if parent is not None:  # rollout follows the actor unless it says otherwise
        for key in ("enable", "all_ranks", "ranks"):
            if raw.get(key) is None:
                block[key] = parent[key]
        if discrete is None:
            discrete = parent.get("discrete")
        for t in ("torch", "npu"):
            inherited = parent["tool_config"].get(t, {}).get("contents")
            if inherited is not None:
                block["tool_config"].setdefault(t, {}).setdefault("contents", inherited)
    if discrete is not None:
        block["discrete"] = discrete
    return block


def request_from_verl(data: Mapping[str, Any]) -> SessionRequest:
    """Build a :class:`SessionRequest` from a verl config (a dict, e.g. loaded YAML)."""
    g = data.get("global_profiler")
    if not isinstance(g, Mapping):
        raise RequestInvalid.at("global_profiler", "must be a mapping")
    extra = set(g) - GLOBAL_KEYS
    if extra:
        raise RequestInvalid.at(f"global_profiler.{sorted(extra)[0]}", "unknown key")
    tool = g.get("tool")
    if tool is None:
        raise RequestInvalid.at("global_profiler.tool", "is null, which turns profiling off")
    if not g.get("steps"):
        raise RequestInvalid.at("global_profiler.steps", "is empty or null: nothing to profile")
    gtc = g.get("global_tool_config") or {}
    roles: dict[str, Any] = {}
    paths: dict[str, str] = {}
    for role, candidates in ROLE_PATHS.items():
        for dotted in candidates:
            raw = _lookup(data, dotted)
            if isinstance(raw, Mapping):
                parent = roles.get("actor") if role == "rollout" else None
                roles[role] = _role_block(raw, dotted, str(tool), gtc, parent)
                paths[role] = dotted
                break
    enabled = {r: b for r, b in roles.items() if b.get("enable")}
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
        fields = []
        for fe in field_errors(exc):
            parts = fe.field.split(".")
            if parts[0] == "roles" and len(parts) > 1 and parts[1] in paths:
                mapped = ".".join([paths[parts[1]], *parts[2:]])
            else:
                mapped = f"global_profiler.{fe.field}" if fe.field else "global_profiler"
            fields.append(FieldError(field=mapped, message=fe.message, type=fe.type))
        raise RequestInvalid.from_fields(fields) from None
