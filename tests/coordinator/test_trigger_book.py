"""Triggers as pure logic: the request's rules, when a condition holds, and what a holding
condition does during cooldown, past the hourly cap or the disk budget, or while its ranks
are busy."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from profd.actors.straggler_steps import KEPT_VERDICTS, judge_step
from profd.actors.trigger_book import FiringState, Suppressed, TriggerBook, saved_firing
from profd.actors.trigger_reports import (
    RoleSpans,
    has_durations,
    report,
    span_steps,
    stages,
)
from profd.analysis.models import StragglerRule
from profd.analysis.stragglers import late_cause, late_outliers
from profd.core.protocol import LabelDurations, MarkDurations, OutOfMemory
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
    # straggler and oom are evaluated: their own rules, and fields they do not use refused
    assert (
        "required" in errors({**base, "when": {**base["when"], "kind": "straggler"}})["when.stage"]
    )
    late = {**base["when"], "kind": "straggler", "stage": "update"}
    assert (
        "not used by a straggler"
        in errors({**base, "when": {**late, "factor": 3.0}})["when.factor"]
    )
    oom = {**base["when"], "kind": "oom"}
    assert (
        "not used by an oom" in errors({**base, "when": {**oom, "stage": "update"}})["when.stage"]
    )
    assert "when.for_steps" in errors({**base, "when": {**oom, "for_steps": 2}})
    assert "step_time" in errors({**base, "when": {**base["when"], "stage": "x"}})["when.stage"]
    made = TriggerRequest.model_validate({**base, "when": {**late, "min_ms": 50, "for_steps": 2}})
    again = TriggerRequest.model_validate(made.model_dump(mode="json"))  # as listed, posted back
    assert again == made and again.when.mark == "update"
    assert TriggerRequest.model_validate({**base, "when": oom}).when.kind == "oom"
    assert (
        "chosen when the trigger fires"
        in errors({**base, "session": {"roles": {}}})["session.roles"]
    )
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


def test_a_replaced_trigger_keeps_its_id_firings_and_cooldown() -> None:
    """PUT: the condition changes at once; the firings so far still hold it back (else an
    edit would be a way round the cooldown and the hourly cap)."""
    clock = Clock()
    book = TriggerBook(clock)
    t = book.add(request(cooldown_s=60))
    samples = {r: [0.10] * 8 for r in range(4)}
    samples[2].append(0.31)
    [firing] = book.observe("a2", "actor", 2, step(0.31), history_of(samples))
    book.fired(firing, "s-1")
    same = book.replace(t.trigger_id, request(cooldown_s=60, when={"factor": 5.0}))
    assert same.trigger_id == t.trigger_id and same.created_at == t.created_at
    assert book.get(t.trigger_id) is same and same.request.when.factor == 5.0
    assert same.fired == 1 and [f.session_id for f in same.firings] == ["s-1"]
    assert book.observe("a2", "actor", 2, step(0.31), history_of(samples)) == []  # 3.1x < 5x
    samples[2].append(0.6)
    assert book.observe("a2", "actor", 2, step(0.6), history_of(samples)) == []
    assert same.suppressed == {Suppressed.COOLDOWN: 1}  # slow enough now, but in cooldown
    assert book.named("slow") is same and book.named("other") is None
    with pytest.raises(KeyError):
        book.replace("trg-none", request())
    # a firing still due (its ranks busy) was judged by the old condition: an edit of the
    # condition ends it, saying so; an edit of anything else keeps it
    other = TriggerBook(clock)
    t = other.add(request(name="late"))
    [due] = other.observe("a2", "actor", 2, step(0.31), history_of(samples))
    assert other.replace(t.trigger_id, request(name="late", cooldown_s=9)).due == due
    edited = other.replace(t.trigger_id, request(name="late", when={"role": "critic"}))
    assert edited.due is None and other.due() == []
    (gone,) = edited.firings
    assert gone.state is FiringState.FAILED and "condition was changed" in gone.error


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
    # as a restarted coordinator reads it back: in time order, an unreadable record left out
    again = TriggerBook(Clock())
    t = again.add(request(when={"kind": "stage_time", "stage": "update_actor"}), f.trigger_id)
    later = {**saved_firing(failed), "firing_id": f"{f.trigger_id}.9", "at": failed.at + 1}
    assert again.recall_failed(t.trigger_id, [later, {"at": "soon"}, saved_firing(failed)]) == 2
    assert list(t.firings) == [
        failed,
        replace(failed, firing_id=later["firing_id"], at=later["at"]),
    ]


def test_a_pass_judges_every_report_and_a_failing_trigger_spares_the_others(caplog) -> None:
    book = TriggerBook(Clock())
    broken = book.add(request(when={"kind": "stage_time", "stage": "generate"}))
    book.add(request(when={"kind": "stage_time", "stage": "update_actor"}))
    samples = {r: [0.05] * 8 for r in range(4)}
    samples[1].append(0.2)
    samples[3].append(0.3)

    def history(role: str, mark: str | None, n: int) -> dict[int, list[float]]:
        if mark == "generate":
            raise RuntimeError("a broken read")
        return history_of(samples)(role, mark, n)

    def one(rank: int, seconds: float) -> tuple:
        stages = (
            LabelDurations("generate", (1.0,)),
            LabelDurations("update_actor", (seconds,)),
        )
        return report(f"a{rank}", "actor", rank, MarkDurations(step=None, stages=stages), 7)

    reports = [one(0, 0.05), one(1, 0.2), one(3, 0.3), one(2, 0.05)]
    [f] = book.observe_pass(reports, history)  # one firing: the next waits for it
    assert (f.evidence.rank, f.evidence.step, f.evidence.observed_s) == (1, 7, 0.2)
    assert book.get(broken.trigger_id).due is None
    assert [r.message for r in caplog.records].count(
        "trigger slow: judging the live times failed"
    ) == 1
    book.failed(f, "no agent")
    [g] = book.observe_pass(reports[2:], history)
    assert g.evidence.rank == 3


def test_what_a_pass_keeps_of_a_report_is_flat_and_whole() -> None:
    times = MarkDurations(
        step=LabelDurations("step", ()),
        stages=(
            LabelDurations("gen", (1.0,), spans=((4, 0.0, 1.0), (5, 1.0, 2.0))),
            LabelDurations("update", (), spans=((3, 0.0, 0.5),)),
            LabelDurations("ref", (0.2,)),
        ),
    )
    flat = report("a1", "actor", 1, times, 9)
    assert not any(isinstance(x, tuple | list) for x in flat)
    want = [("gen", True, (4, 5)), ("update", False, (3,)), ("ref", True, ())]
    assert [(label, new, tuple(steps)) for label, new, steps in stages(flat)] == want
    assert has_durations(flat, "gen") and not has_durations(flat, "update")
    assert not has_durations(flat, None) and list(span_steps(flat, "gen")) == [4, 5]
    assert flat[:4] == ("a1", "actor", 1, 9)


# -- straggler ------------------------------------------------------------------------------
def test_the_live_straggler_rule_is_the_summarys() -> None:
    rng, rule = random.Random(7), StragglerRule()
    for _ in range(300):
        n = rng.randint(2, 9)
        starts = [rng.uniform(0, 0.05) for _ in range(n)]
        walls = [rng.uniform(0.05, 0.2) for _ in range(n)]
        if rng.random() < 0.5:  # one slow or late rank, often
            i = rng.randrange(n)
            starts[i] += rng.choice([0.0, 0.3])
            walls[i] += rng.choice([0.0, 0.3])
        ends = [s + w for s, w in zip(starts, walls, strict=True)]
        ms = [[x * 1000 for x in v] for v in (starts, ends, walls)]
        want = {h.index: h for h in late_outliers(ms[1], ms[2], rule)}
        ranks = [10 + i for i in range(n)]  # verdicts are by rank
        got = judge_step(ranks, starts, ends, walls)
        assert set(got.late) == {10 + i for i in want} and got.members == n
        for i, h in want.items():
            x = got.late[10 + i]
            assert x.is_late and abs(x.late * 1000 - h.late) < 1e-6
            assert abs(x.threshold * 1000 - h.threshold) < 1e-6
            assert x.cause == late_cause(ms[0], ms[2], i, rule)[2].value
        # the healthy peer: not late, its end the closest to the others' median end
        healthy = [
            (abs(ends[i] - statistics.median(ends[:i] + ends[i + 1 :])), 10 + i)
            for i in range(n)
            if i not in want
        ]
        assert got.peer == (min(healthy)[1] if healthy else None)


def straggler(**when) -> TriggerRequest:
    return TriggerRequest.model_validate(
        {"name": "late", "when": {"kind": "straggler", "role": "actor", "stage": "update",
                                  **when}, "cooldown_s": 60}
    )  # fmt: skip


class Ends:
    """The role's stage spans per rank, as the coordinator's MarkStats keeps them."""

    def __init__(self, ranks: int, job: str = "a") -> None:
        self.steps: dict[int, dict[int, SimpleNamespace]] = {r: {} for r in range(ranks)}
        self.job = job  # the agents' id prefix: another job's agents have other ids

    def add(self, rank: int, step: int, start: float, end: float) -> MarkDurations:
        self.steps[rank][step] = SimpleNamespace(start=start, end=end, wall=end - start)
        d = LabelDurations("update", (end - start,), spans=((step, start, end),))
        return MarkDurations(step=None, stages=(d,))

    def __call__(self, role: str, stage: str) -> RoleSpans:
        assert (role, stage) == ("actor", "update")
        ranks = [r for r, s in self.steps.items() if s]
        return RoleSpans({r: f"{self.job}{r}" for r in ranks}, {r: self.steps[r] for r in ranks})


def run_step(book, ends, step, late, profiled=None, order=(0, 1, 2, 3)) -> list:
    """Every rank's stage ends at ``step + 0.1`` (ends spread 1 ms), ``late[r]`` later."""
    out = []
    for r in order:
        start = step + 0.001 * r
        times = ends.add(r, step, start, start + 0.1 + late.get(r, 0.0))
        out += book.observe(f"a{r}", "actor", r, times, history_of({}), step, ends, profiled)
    return out


def test_a_straggler_fires_after_for_steps_late_steps_on_it_with_the_peer_it_chose() -> None:
    clock = Clock()
    book = TriggerBook(clock)
    t = book.add(straggler(for_steps=2, min_ms=100))
    ends = Ends(4)
    assert run_step(book, ends, 1, {}) == [] and run_step(book, ends, 2, {2: 0.05}) == []
    assert run_step(book, ends, 3, {2: 0.5}) == []  # late once (50 ms before: under min_ms)
    # step 4 is judged only once every rank has reported it: rank 2, late, reports first
    assert run_step(book, ends, 4, {2: 0.4}, order=(2, 0, 1)) == []
    [f] = run_step(book, ends, 4, {2: 0.4}, order=(3,))
    ev = f.evidence
    assert (ev.kind, ev.rank, ev.agent_id, ev.mark, ev.step) == ("straggler", 2, "a2", "update", 4)
    assert abs(ev.late_s - 0.4) < 0.01 and ev.observed_s == ev.late_s
    assert ev.threshold_s == ev.baseline_s and 0.005 <= ev.threshold_s < 0.05
    assert abs(ev.peer_median_end_s - 4.101) < 1e-9 and abs(ev.end_s - 4.502) < 1e-9
    assert ev.cause == "long duration" and ev.baseline_samples == 3
    assert ev.peer_rank in (1, 3)  # ends closest to the median end of step 4 (rank 0: first)
    d = ev.as_dict()
    assert d["kind"] == "straggler" and d["factor"] is None and d["peer_rank"] == ev.peer_rank
    book.fired(f, "s-1")
    assert run_step(book, ends, 5, {2: 0.4}) == []
    assert t.suppressed == {Suppressed.COOLDOWN: 1}


def test_a_late_step_is_not_hidden_by_a_later_one_judged_in_the_same_pass() -> None:
    """One pass completes steps 11 and 12 (rank 3's report of both, then rank 2's on-time
    12): rank 2 was late in 11, and is found there, as report by report."""
    book = TriggerBook(Clock())
    book.add(straggler())
    ends = Ends(4)
    for r in range(3):
        for s in (11, 12):
            late = 0.3 if (r, s) == (2, 11) else 0.0
            ends.add(r, s, s + 0.001 * r, s + 0.001 * r + 0.1 + late)
    for s in (11, 12):
        ends.add(3, s, s + 0.003, s + 0.103)
    spans3 = tuple((s, s + 0.003, s + 0.103) for s in (11, 12))
    times3 = MarkDurations(step=None, stages=(LabelDurations("update", (0.1, 0.1), spans=spans3),))
    on_time = MarkDurations(
        step=None, stages=(LabelDurations("update", (0.1,), spans=((12, 12.002, 12.102),)),)
    )
    reports = [report("a3", "actor", 3, times3, 12), report("a2", "actor", 2, on_time, 12)]
    [f] = book.observe_pass(reports, history_of({}), ends)
    assert (f.evidence.rank, f.evidence.step) == (2, 11)
    assert f.evidence.late_s > 0.25


def test_a_profiled_rank_is_not_called_a_straggler_and_stages_elsewhere_are_ignored() -> None:
    book = TriggerBook(Clock())
    t = book.add(straggler(for_steps=1))
    ends = Ends(3)
    assert run_step(book, ends, 1, {1: 0.3}, profiled=lambda a: a == "a1", order=(0, 1, 2)) == []
    other = MarkDurations(step=None, stages=(LabelDurations("gen", (1.0,), spans=((2, 0, 9),)),))
    assert book.observe("a0", "actor", 0, other, history_of({}), 2, ends) == []
    [f] = run_step(book, ends, 2, {1: 0.3}, order=(0, 1, 2))
    assert f.evidence.rank == 1 and sorted(t.verdicts) == [1, 2]
    lone = TriggerBook(Clock())  # a role of one rank has no peers: never judged
    lone.add(straggler())
    one = Ends(1)
    assert run_step(lone, one, 1, {0: 5.0}, order=(0,)) == []


def test_another_job_or_a_resume_starts_the_straggler_verdicts_afresh() -> None:
    """Triggers outlive jobs: a new job's steps (from 1 again, other agents) and a job that
    resumed from an earlier step are judged on their own steps, not the old run's."""
    book = TriggerBook(Clock())
    t = book.add(straggler(for_steps=2, min_ms=100))
    first = Ends(3)
    for step in range(1, 70):  # more steps than are kept
        run_step(book, first, step, {}, order=(0, 1, 2))
    assert sorted(t.verdicts)[0] == 70 - KEPT_VERDICTS  # the oldest judged went first
    assert [f.evidence.step for f in run_step(book, first, 70, {2: 0.5}, order=(0, 1, 2))] == []
    second = Ends(3, job="b")  # the next job on the same role: healthy, from step 1
    for step in (1, 2, 3):
        assert run_step(book, second, step, {}, order=(0, 1, 2)) == []
    assert sorted(t.verdicts) == [1, 2, 3] and t.verdict_agents == {"b0", "b1", "b2"}
    for step in (4, 5):  # rank 1 late twice: fires on this job's own steps
        fired = run_step(book, second, step, {1: 0.5}, order=(0, 1, 2))
    assert [(f.evidence.rank, f.evidence.step) for f in fired] == [(1, 5)]
    run_step(book, second, 2, {}, order=(0, 1, 2))  # resumed from step 2: a new run
    assert sorted(t.verdicts) == [2]


# -- oom ------------------------------------------------------------------------------------
def test_an_out_of_memory_error_fires_on_its_rank_then_cooldown() -> None:
    clock = Clock()
    book = TriggerBook(clock)
    t = book.add(
        TriggerRequest.model_validate(
            {"name": "oom", "when": {"kind": "oom", "role": "actor"}, "cooldown_s": 60}
        )
    )
    book.add(request())  # a step_time trigger: an oom is not its business
    oom = OutOfMemory("OutOfMemoryError: CUDA out of memory.", "update", "/p/x_oom1.pickle")
    assert book.out_of_memory("c1", "critic", 1, oom, 7) == []
    [f] = book.out_of_memory("a1", "actor", 1, oom, 7)
    ev = f.evidence.as_dict()
    assert (ev["kind"], ev["rank"], ev["agent_id"], ev["mark"], ev["step"]) == (
        "oom", 1, "a1", "update", 7
    )  # fmt: skip
    assert ev["error"] == oom.error and ev["snapshot_path"] == "/p/x_oom1.pickle"
    book.fired(f, "s-1")
    assert book.out_of_memory("a1", "actor", 1, oom, 8) == []
    assert t.suppressed == {Suppressed.COOLDOWN: 1}
    assert book.observe("a1", "actor", 1, step(9.0), history_of({1: [9.0] * 8})) == []


def test_a_cooldown_longer_than_an_hour_holds_and_recalled_firings_keep_their_ids() -> None:
    """A cooldown of two hours is held past the hour the cap counts; a restored book's
    firings hold it too, keep the ids their sessions name, and an older session's firing
    (no id stored) gets a number after every stored one, whichever trigger it is of."""
    clock = Clock()
    book = TriggerBook(clock)
    t = book.add(request(cooldown_s=7200, max_per_hour=4))
    samples = {r: [0.10] * 8 for r in range(4)}
    samples[2].append(0.5)  # rank 2's newest step: 5x the median
    [firing] = book.observe("a2", "actor", 2, step(0.5), history_of(samples))
    book.fired(firing, "s-1")
    clock.now += 5400  # 90 minutes: out of the hour, still in the cooldown
    assert book.observe("a2", "actor", 2, step(0.5), history_of(samples)) == []
    assert t.suppressed == {Suppressed.COOLDOWN: 1}
    clock.now += 1801
    assert len(book.observe("a2", "actor", 2, step(0.5), history_of(samples))) == 1

    again = TriggerBook(clock)
    a = again.add(request(cooldown_s=7200), trigger_id="trgA")
    c = again.add(request(cooldown_s=7200), trigger_id="trgC")
    ev = {"role": "actor", "rank": 2, "agent_id": "a2", "kind": "step_time", "unknown": 1}
    again.number_after(["trgA.4", "trgC.3"])
    old_c = (clock.now - 5400, "s-c0", {"evidence": ev})  # an older profd's: no id
    again.recall("trgC", [old_c, (clock.now - 10, "s-c3", {"firing_id": "trgC.3", "evidence": ev})])
    again.recall(
        "trgA", [(clock.now - 20, "s-a0", {}), (clock.now - 5, "s-a4", {"firing_id": "trgA.4"})]
    )
    ids = [f.firing_id for f in (*a.firings, *c.firings)]
    assert len(set(ids)) == 4 and {"trgA.4", "trgC.3"} <= set(ids)
    assert all(int(i.rpartition(".")[2]) > 4 for i in ids if i not in ("trgA.4", "trgC.3"))
    assert c.fired == 2 and len(c.fired_at) == 1  # the older one is out of the hour
    assert c.firings[0].evidence.rank == 2 and c.firings[1].session_id == "s-c3"
    assert again.observe("a2", "actor", 2, step(0.5), history_of(samples)) == []
    assert a.suppressed == c.suppressed == {Suppressed.COOLDOWN: 1}
    [new] = book.due()
    assert new.firing_id.startswith(t.trigger_id)


def test_a_failed_firing_whose_session_was_made_comes_back_once_as_fired() -> None:
    """A PUT failed a due firing while its session was being admitted, and the coordinator
    died before the row saying it fired was written: the restored session is its truth."""
    from profd.actors.trigger_saved import restore_triggers, saved_trigger

    book = TriggerBook(Clock())
    t = book.add(request())
    samples = {r: [0.10] * 8 for r in range(4)}
    samples[1].append(0.31)
    [f] = book.observe("a1", "actor", 1, step(0.31), history_of(samples))
    row = saved_trigger(t)
    book.failed(f, "the trigger's condition changed")
    row["failed"] = saved_trigger(t)["failed"]
    origin = {"trigger_id": t.trigger_id, "firing_id": f.firing_id, "at": f.at}
    session = SimpleNamespace(session_id="s1", created_at=f.at + 1, origin=origin)
    again = TriggerBook(Clock())
    assert restore_triggers(again, [row], [session], now=f.at + 2) == {t.trigger_id: ["s1"]}
    (back,) = again.get(t.trigger_id).firings
    assert (back.firing_id, back.state, back.session_id) == (f.firing_id, FiringState.FIRED, "s1")
