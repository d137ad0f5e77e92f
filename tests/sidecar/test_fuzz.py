"""Fuzzing: schemathesis against the sidecar's own OpenAPI, over real HTTP (uvicorn on
127.0.0.1), with an in-process coordinator and registered agents behind it.

For every operation, schema-valid and schema-violating requests are sent with the token and
without it. Whatever they hold: no 5xx, every response conforms to the schema (status code,
content type, body), bodies that break the schema are rejected, operations that declare the
bearer scheme refuse requests without it, and a rejected request (4xx) changes no session.

``PROFD_FUZZ_EXAMPLES`` (default 50) bounds the examples per operation and generation mode.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from helpers import AUTH, start_agents

EXAMPLES = int(os.environ.get("PROFD_FUZZ_EXAMPLES", "50"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
    ignored_auth,
]


@pytest.fixture
def target(make_sidecar, local_coordinator) -> Iterator[tuple[str, Any]]:
    """A sidecar with two actor agents and a critic (all in this process: one live session
    holds them all, so an accepted session is cancelled at once to let the next one in)."""
    agents = start_agents(local_coordinator, 2, "actor") + start_agents(
        local_coordinator, 1, "critic"
    )
    try:
        with make_sidecar(upload_prefixes=("memory://fuzz",)) as srv:
            yield srv.url, local_coordinator
    finally:
        for a in agents:
            a.close(timeout=10)


def state(owner: Any) -> tuple[dict[str, int], list[str]]:
    """Sessions per state and the live ones (cheap: no view of every session is built)."""
    st = owner.call("status")
    return st.sessions_by_state, st.live_sessions


def run_strategy(
    strategy: Any, owner: Any, headers: dict[str, str], seen: dict[int, int], n: int
) -> None:
    @given(case=strategy)
    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def one(case: Any) -> None:
        before = state(owner)
        response = case.call(headers=headers, timeout=30)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.as_curl_command(), response.text)
        if 400 <= response.status_code < 500:
            assert state(owner) == before, ("a rejected request changed state", case)
        case.validate_response(response, checks=CHECKS, headers=headers)
        if response.status_code == 201:  # leave nothing behind for the next case
            made = response.json()
            if "session_id" in made:
                owner.call("cancel_session", made["session_id"])
            else:
                owner.call("delete_trigger", made["trigger_id"])

    one()


def fuzz(url: str, owner: Any, headers: dict[str, str]) -> dict[int, int]:
    """Run every operation: its OpenAPI examples, then generated valid and invalid requests.
    Return how often each status came."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    seen: dict[int, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        examples = operation.get_strategies_from_examples()
        if examples:
            run_strategy(st.one_of(examples), owner, headers, seen, 3 * len(examples))
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                run_strategy(operation.as_strategy(mode), owner, headers, seen, EXAMPLES)
            except Unsatisfiable:  # nothing to negate: no parameter and no body
                assert mode is GenerationMode.NEGATIVE, operation.label
    return seen


@pytest.mark.slow
def test_fuzz_with_the_token(target) -> None:
    url, owner = target
    seen = fuzz(url, owner, {**AUTH})
    # The fuzzer got past validation: sessions were created, and refused with reasons.
    assert seen.get(201, 0) > 0 and seen.get(422, 0) > 0 and seen.get(200, 0) > 0
    assert not any(code >= 500 for code in seen)


@pytest.mark.slow
def test_fuzz_without_the_token(target) -> None:
    url, owner = target
    before = state(owner)
    seen = fuzz(url, owner, {})
    assert seen.get(401, 0) > 0 and not any(code >= 500 for code in seen)
    assert state(owner) == before  # no change got through without the token
