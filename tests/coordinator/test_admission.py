"""Admission checks on their own: conflicts, reachability, waiting notes, ids and dirs."""

from __future__ import annotations

from pathlib import Path

import pytest

from profd.actors import sessions
from profd.actors.admission import check_conflicts, check_reachable
from profd.actors.alignment import waiting_note
from profd.actors.registry import AgentRegistry
from profd.actors.sessions import Part, Session, new_session_id, session_dir
from profd.actors.targeting import Target
from profd.core.errors import ConflictError, RequestInvalid
from profd.core.protocol import AgentInfo, ReplicaInfo
from profd.core.request import RoleProfilerConfig, SessionRequest
from profd.core.settings import CoordinatorSettings
from profd.core.states import PartState


def agent(
    aid: str,
    role: str = "actor",
    rank: int = 0,
    pid: int | None = None,
    replica: ReplicaInfo | None = None,
) -> AgentInfo:
    return AgentInfo(aid, role, rank, 4, {}, "host", pid or 100 + rank, replica=replica)


def replica(aid: str, start: int, stop: int, colocated: bool) -> AgentInfo:
    info = ReplicaInfo(stop - start, start, stop, colocated=colocated)
    return agent(aid, "rollout", 0, pid=999, replica=info)


def target(info: AgentInfo) -> Target:
    return Target(info, "*", RoleProfilerConfig())


def held_by(sid: str, *infos: AgentInfo, state: PartState = PartState.ARMED) -> Session:
    parts = {i.agent_id: Part(i.agent_id, i.role, i.rank, "*", state=state) for i in infos}
    return Session(
        session_id=sid,
        request=SessionRequest.model_validate({"steps": [5]}),
        save_dir=f"/tmp/{sid}",
        created_at=0.0,
        targets=parts,
        ignored=[],
        deadline=1e12,
    )


def registry_of(*infos: AgentInfo, steps: dict[str, int] | None = None) -> AgentRegistry:
    reg = AgentRegistry()
    for i in infos:
        reg.upsert(i, 0.0, (steps or {}).get(i.agent_id))
    return reg


# -- conflicts --------------------------------------------------------------------------------
def test_a_held_agent_cannot_join_another_session() -> None:
    a = agent("a")
    with pytest.raises(ConflictError) as err:
        check_conflicts([held_by("s1", a)], registry_of(a), [target(a)])
    assert err.value.extra["holders"] == ["s1"]
    assert "actor rank 0 is held by session s1 (actor rank 0, armed)" in err.value.message


def test_one_process_hosts_one_profiler() -> None:
    actor, ref = agent("actor", "actor", 0, pid=7), agent("ref", "ref", 3, pid=7)
    with pytest.raises(ConflictError):
        check_conflicts([held_by("s1", actor)], registry_of(actor, ref), [target(ref)])


def test_the_same_rank_of_two_roles_is_two_workers() -> None:
    actor, critic = agent("actor", "actor", 0, pid=7), agent("critic", "critic", 0, pid=8)
    held = [held_by("s1", actor)]
    assert check_conflicts(held, registry_of(actor, critic), [target(critic)]) is None
    # the same rank in the same process would be one worker: refused
    shared = agent("critic", "critic", 0, pid=7)
    with pytest.raises(ConflictError):
        check_conflicts(held, registry_of(actor, shared), [target(shared)])


def test_finished_parts_hold_nothing() -> None:
    a = agent("a")
    done = held_by("s1", a, state=PartState.DONE)
    assert check_conflicts([done], registry_of(a), [target(a)]) is None
    with pytest.raises(ConflictError):  # the same part still recording holds the agent
        check_conflicts([held_by("s1", a, state=PartState.RECORDING)], registry_of(a), [target(a)])


def test_a_colocated_replica_shares_the_devices_of_its_training_ranks() -> None:
    train = agent("t1", "actor", 1, pid=11)
    colocated = replica("r", 0, 2, colocated=True)
    reg = registry_of(train, colocated)
    with pytest.raises(ConflictError):
        check_conflicts([held_by("s1", train)], reg, [target(colocated)])
    separate = replica("r2", 0, 2, colocated=False)
    check_conflicts([held_by("s1", train)], registry_of(train, separate), [target(separate)])
    # a training rank outside the replica's devices is free
    far = agent("t3", "actor", 3, pid=13)
    check_conflicts([held_by("s1", colocated)], registry_of(far, colocated), [target(far)])


def test_a_timed_request_cannot_hold_a_colocated_replica_and_its_ranks() -> None:
    train = agent("t0", "actor", 0, pid=10)
    colocated = replica("r", 0, 2, colocated=True)
    reg = registry_of(train, colocated)
    both = [target(train), target(colocated)]
    check_conflicts([], reg, both)  # a driver orders them: the replica stops before training
    with pytest.raises(ConflictError, match="this timed request"):
        check_conflicts([], reg, both, timed=True)


# -- reachability -----------------------------------------------------------------------------
def test_steps_every_target_has_begun_are_refused() -> None:
    a, b = agent("a", rank=0), agent("b", rank=1)
    reg = registry_of(a, b, steps={"a": 9, "b": 12})
    with pytest.raises(RequestInvalid, match=r"already begun.*\[9, 12\]"):
        check_reachable((8, 9), reg, [target(a), target(b)])
    check_reachable((10,), reg, [target(a), target(b)])  # a has not begun step 10


def test_a_target_of_unknown_step_may_still_reach_any_step() -> None:
    a, b = agent("a", rank=0), agent("b", rank=1)
    reg = registry_of(a, b, steps={"a": 9})
    assert check_reachable((1,), reg, [target(a), target(b)]) is None  # b may not be at 1 yet
    with pytest.raises(RequestInvalid, match="already begun"):  # once b's step is known, refused
        check_reachable((1,), registry_of(a, b, steps={"a": 9, "b": 4}), [target(a), target(b)])


def test_reachability_asks_the_driver_for_targets_without_a_step() -> None:
    a = agent("a")
    reg = registry_of(a)
    check_reachable((3,), reg, [target(a)])  # no step known at all
    with pytest.raises(RequestInvalid):
        check_reachable((3,), reg, [target(a)], job_step=lambda rec: 3)


def test_the_waiting_note_names_the_steps_that_will_be_missed() -> None:
    note = waiting_note((3, 4, 5, 6), [5, 7])
    assert note is not None
    assert note.startswith("waiting for step 6; step(s) 3-5 had already begun")
    assert waiting_note((3, 4), [1, 2]) is None  # nothing past
    assert waiting_note((3, 4), [5]) is None  # nothing ahead: refused at admission instead
    assert waiting_note((3, 4), [3, None]) is None  # a target's step is unknown


# -- ids and directories ----------------------------------------------------------------------
def test_session_ids_carry_the_time_and_never_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = iter(["aaaa", "aaaa", "bbbb"])
    monkeypatch.setattr(sessions.secrets, "token_hex", lambda n: next(tokens))
    first = new_session_id(0.0, [])
    assert first.endswith("-aaaa") and len(first) == len("YYYYmmdd-HHMMSS-aaaa")
    assert new_session_id(0.0, [first]) == first[: -len("aaaa")] + "bbbb"


def test_session_dirs_resolve_against_the_base_dir(tmp_path: Path) -> None:
    settings = CoordinatorSettings(save_root=str(tmp_path / "root"), base_dir=str(tmp_path))

    def req(**kw: object) -> SessionRequest:
        return SessionRequest.model_validate({"steps": [1], **kw})

    assert session_dir(req(), settings, "s1") == str(tmp_path / "root" / "s1")
    assert session_dir(req(save_path="rel/out"), settings, "s1") == str(tmp_path / "rel/out/s1")
    assert session_dir(req(save_path="/abs/out"), settings, "s1") == "/abs/out/s1"
