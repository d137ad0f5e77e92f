"""Triggers as pure logic: the request's rules, when a condition holds, and what a holding
condition does during cooldown, past the hourly cap or the disk budget, or while its ranks
are busy."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from profd.actors.trigger_book import FiringState, Suppressed, TriggerBook
from profd.core.protocol import LabelDurations, MarkDurations
from profd.core.request import field_errors
from profd.core.trigger_request import TriggerRequest


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def request(**kw) -> TriggerRequest:
    when = {"kind": "step_time", "role": "actor", "factor": 2.0, "baseline_steps": 8}
    when.update(kw.pop("when", {}))
    return TriggerRequest.model_validate({"name": "slow", "when": when, **kw})


def errors(body: dict) -> dict[str, str]:
    with pytest.raises(ValidationError) as exc:
        TriggerRequest.model_validate(body)
    return {e.field: e.message for e in field_errors(exc.value)}


def test_bad_triggers_name_the_field_and_the_rule() -> None:
    base = {"name": "t", "when": {"kind": "step_time", "role": "actor"}}
    assert "when.factor" in errors({**base, "when": {**base["when"], "factor": 1.0}})
    assert "when.stage" in errors({**base, "when": {**base["when"], "kind": "stage_time"}})
    got = errors({**base, "when": {**base["when"], "kind": "straggler"}})
    assert "not evaluated yet" in got["when.kind"]
    assert "chosen when the trigger fires" in errors({**base, "session": {"roles": {}}})[
        "session.roles"
    ]
    assert "session.next_steps" in errors({**base, "session": {"next_steps": 0}})
    # the template is checked as the session it becomes: a bad tool fails now, not at firing
    assert "session.tool" in errors({**base, "session": {"tool": "nope"}})
    assert "max_per_hour" in errors({**base, "max_per_hour": 0})
    ok = TriggerRequest.model_validate(base)
    s = ok.session_for((2, 0))
    assert s.next_steps == 2 and s.roles["actor"].ranks == (2, 0)


def history_of(samples: dict[int, list[float]]):
    def history(role: str, mark: str | None, n: int) -> dict[int, list[float]]:
        assert role == "actor"
        return {r: v[-n:] for r, v in samples.items()}

    return history


def step(*seconds: float) -> MarkDurations:
    return MarkDurations(step=LabelDurations("step", tuple(seconds)))


def test_a_slow_rank_fires_once_then_cooldown_hourly_cap_and_disk_suppress() -> None:
    clock = Clock()
    book = TriggerBook(clock)
    t = book.add(request(cooldown_s=60, max_per_hour=2, max_disk_mb=1))
    samples = {r: [0.10] * 8 for r in range(4)}
    # not slow enough: 0.19 s against a 0.10 s median and factor 2
    samples[2].append(0.19)
    assert book.observe("a2", "actor", 2, step(0.19), history_of(samples)) == []
    samples[2].append(0.31)
    [firing] = book.observe("a2", "actor", 2, step(0.31), history_of(samples))
    ev = firing.evidence
    assert (ev.rank, ev.mark, ev.observed_s, ev.baseline_s) == (2, "step", 0.31, 0.10)
    assert firing.state is FiringState.DUE and book.due() == [firing]
    # while due (its ranks busy), a second holding condition makes no second firing
    assert book.observe("a2", "actor", 2, step(0.4), history_of(samples)) == []
    done = book.fired(firing, "s-1")
    assert done.state is FiringState.FIRED and book.due() == [] and t.fired == 1
    clock.now += 30
    assert book.observe("a2", "actor", 2, step(0.4), history_of(samples)) == []
    assert t.suppressed == {Suppressed.COOLDOWN: 1}
    clock.now += 31
    [second] = book.observe("a2", "actor", 2, step(0.4), history_of(samples))
    book.fired(second, "s-2")
    clock.now += 61
    assert book.observe("a2", "actor", 2, step(0.4), history_of(samples)) == []
    assert t.suppressed[Suppressed.HOURLY_CAP] == 1
    clock.now += 3600
    book.add_disk(t.trigger_id, 2_000_000)
    assert book.observe("a2", "actor", 2, step(0.4), history_of(samples)) == []
    assert t.suppressed[Suppressed.DISK_BUDGET] == 1


def test_not_armed_without_history_and_min_ms_and_other_roles_ignored() -> None:
    book = TriggerBook(Clock())
    book.add(request(when={"min_ms": 500, "baseline_steps": 8}))
    few = {0: [0.1, 9.0], 1: [0.1]}
    assert book.observe("a0", "actor", 0, step(9.0), history_of(few)) == []  # not armed
    full = {r: [0.1] * 8 for r in range(2)}
    full[0].append(0.4)
    assert book.observe("a0", "actor", 0, step(0.4), history_of(full)) == []  # < 500 ms
    assert book.observe("c0", "critic", 0, step(9.0), history_of(full)) == []
    full[0].append(0.6)
    [f] = book.observe("a0", "actor", 0, step(0.6), history_of(full), step=41)
    assert (f.evidence.observed_s, f.evidence.step) == (0.6, 41)


def test_for_steps_needs_that_many_slow_durations_in_a_row() -> None:
    book = TriggerBook(Clock())
    book.add(request(when={"for_steps": 2}))
    samples = {r: [0.1] * 8 for r in range(3)}
    samples[1] += [0.5, 0.1, 0.5]  # one stall, then one more: never two in a row
    assert book.observe("a1", "actor", 1, step(0.5), history_of(samples)) == []
    samples[1].append(0.6)
    [f] = book.observe("a1", "actor", 1, step(0.6), history_of(samples))
    assert f.evidence.observed_s == 0.6


def test_a_stage_trigger_watches_only_its_stage() -> None:
    book = TriggerBook(Clock())
    book.add(request(when={"kind": "stage_time", "stage": "update_actor"}))
    samples = {r: [0.05] * 8 for r in range(2)}
    samples[1].append(0.2)  # update_actor's windows (generate's are not asked for)
    hist = history_of(samples)
    gen = MarkDurations(step=None, stages=(LabelDurations("generate", (1.0,)),))
    assert book.observe("a1", "actor", 1, gen, hist) == []
    upd = MarkDurations(step=None, stages=(LabelDurations("update_actor", (0.2,)),))
    [f] = book.observe("a1", "actor", 1, upd, hist)
    assert (f.evidence.mark, f.evidence.rank) == ("update_actor", 1)
    failed = book.failed(f, "no agent")
    assert failed.state is FiringState.FAILED and book.due() == []
