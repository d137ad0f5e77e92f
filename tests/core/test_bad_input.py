"""Bad input is refused with a :class:`RequestInvalid` naming the field, never a crash.

Property tests: any JSON-ish value put at any key request_from_verl knows (or at a block above
one) gives a :class:`SessionRequest` or a ``RequestInvalid`` whose fields are named, never a
``TypeError`` / ``AttributeError`` from inside the mapping; refusals happen before a session
or a coordinator exists.
"""

from __future__ import annotations

import copy
import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from profd.core.errors import RequestInvalid
from profd.core.request import MAX_SAVE_PATH_BYTES, NAME_MAX, SessionRequest
from profd.driver.verl import GLOBAL_KEYS, ROLE_PATHS, TOOL_KEYS, request_from_verl
from tests.driver.test_verl_compat import VERL_YAML

BASE = yaml.safe_load(VERL_YAML)
SCHEDULE_KEYS = ("skip_first", "wait", "warmup", "active", "repeat", "_target_")


def _existing_paths(node: object, prefix: str) -> list[str]:
    out: list[str] = []
    if isinstance(node, dict):
        for k, v in node.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            out += [path, *_existing_paths(v, path)]
    return out


def _known_paths() -> list[str]:
    paths = set(_existing_paths(BASE, ""))
    paths |= {f"global_profiler.{k}" for k in GLOBAL_KEYS}
    for tool, keys in TOOL_KEYS.items():
        base = f"global_profiler.global_tool_config.{tool}"
        paths |= {base, f"{base}.discrete", f"{base}.trace_alloc_max_entries"}
        paths |= {f"{base}.{k}" for k in keys or ()}
    for candidates in ROLE_PATHS.values():
        for role in candidates:
            parts = role.split(".")
            paths |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
            paths |= {f"{role}.{k}" for k in ("enable", "all_ranks", "ranks", "tool_config")}
            paths |= {f"{role}.save_path", f"{role}._target_"}
            for tool, keys in TOOL_KEYS.items():
                tc = f"{role}.tool_config.{tool}"
                paths |= {tc, *(f"{tc}.{k}" for k in keys or ())}
            paths |= {f"{role}.tool_config.torch.schedule.{k}" for k in SCHEDULE_KEYS}
    return sorted(paths)


KNOWN_PATHS = _known_paths()
KEY_NAMES = sorted({p.rsplit(".", 1)[-1] for p in KNOWN_PATHS})

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**53 - 2, max_value=2**70)
    | st.floats()  # NaN and infinities included
    | st.text(max_size=12)
    | st.sampled_from(["torch", "nsys", "npu", "cpu", "level0", "a" * 5000, "x\x00y", "${a.b}"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KEY_NAMES) | st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def _put(data: dict, path: str, value: object) -> None:
    node = data
    *head, last = path.split(".")
    for part in head:
        if not isinstance(node.get(part), dict):  # an earlier substitution replaced it
            node[part] = {}
        node = node[part]
    node[last] = value


def _outcome(data: object) -> SessionRequest | RequestInvalid:
    """A valid request, or the refusal; any other exception escapes (and fails the test)."""
    try:
        req = request_from_verl(data)  # type: ignore[arg-type]
    except RequestInvalid as exc:
        return exc
    return SessionRequest.model_validate(req.model_dump())  # valid as it stands


def _named(exc: RequestInvalid) -> bool:
    """A refusal that names each field it refuses, with a message."""
    return bool(exc.fields) and all(
        isinstance(f.field, str) and f.field and f.message for f in exc.fields
    )


def _request_or_named_refusal(data: object) -> bool:
    got = _outcome(data)
    return isinstance(got, SessionRequest) or _named(got)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(KNOWN_PATHS), json_values), min_size=1, max_size=3))
def test_any_value_at_any_known_key_is_a_request_or_a_named_refusal(subs) -> None:
    data = copy.deepcopy(BASE)
    for path, value in subs:
        _put(data, path, value)
    assert _request_or_named_refusal(data), _outcome(data)


@settings(max_examples=100, deadline=None)
@given(json_values)
def test_any_value_as_the_whole_config(value) -> None:
    assert _request_or_named_refusal(value), _outcome(value)
    assert _request_or_named_refusal({"global_profiler": value})


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=()), max_size=300))
def test_any_save_path_text_is_accepted_or_refused_by_validation(text: str) -> None:
    try:
        req = SessionRequest(next_steps=1, save_path=text)
    except ValidationError as exc:
        assert exc.errors()[0]["loc"] == ("save_path",)
        return
    encoded = req.save_path.encode("utf-8", "surrogateescape")  # what the OS gets
    assert b"\x00" not in encoded and len(encoded) <= MAX_SAVE_PATH_BYTES
    assert all(len(part) <= NAME_MAX for part in encoded.split(b"/"))


@pytest.mark.parametrize(
    "config",
    [
        {**BASE, "actor_rollout_ref": {"actor": {"profiler": {"enable": True, "ranks": 5}}}},
        {**BASE, "global_profiler": {**BASE["global_profiler"], "save_path": "a" * 5000}},
        {"duration_s": float("nan")},
        {"next_steps": 1, "save_path": "/tmp/" + "x" * 300},
        [1, 2],
    ],
)
def test_start_session_refuses_before_any_session_exists(config, monkeypatch) -> None:
    """The refusal comes from load_request: before Ray is even looked at, so no coordinator is
    started and no session (or session directory) is created."""
    import profd
    from profd.driver import launch

    def no_ray(*args, **kwargs):  # pragma: no cover - reached only if validation let it pass
        raise AssertionError("start_session went past validation")

    monkeypatch.setattr(launch, "resolve_interpolations", lambda c: c)
    import ray

    monkeypatch.setattr(ray, "is_initialized", no_ray)
    with pytest.raises(RequestInvalid) as info:
        profd.start_session(config)
    assert info.value.fields and all(f.field for f in info.value.fields)


def test_load_request_names_profd_layout_fields() -> None:
    from profd.driver.launch import load_request

    with pytest.raises(RequestInvalid) as info:
        load_request({"duration_s": float("inf")})
    assert [(f.field, f.message) for f in info.value.fields] == [
        ("duration_s", "Input should be a finite number")
    ]
    with pytest.raises(RequestInvalid, match="config: expected a mapping"):
        load_request(json.loads("[1]"))  # type: ignore[arg-type]


def test_a_field_that_must_be_a_list_says_list_not_tuple() -> None:
    """Users write JSON or YAML: "should be a valid tuple" named a Python type they never
    wrote."""
    from pydantic import ValidationError

    from profd.core.request import SessionRequest, field_errors

    with pytest.raises(ValidationError) as exc:
        SessionRequest.model_validate({"steps": [1], "roles": {"critic": {"ranks": "0"}}})
    (err,) = field_errors(exc.value)
    assert (err.field, err.message) == ("roles.critic.ranks", "Input should be a list")
