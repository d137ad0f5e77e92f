"""Messages between agents and the coordinator: each event kind carries exactly its payload."""

from __future__ import annotations

import pickle

import pytest

from profd.core.protocol import (
    AgentEvent,
    AgentInfo,
    EventKind,
    IncompleteFile,
    PartDone,
    PhaseDone,
    ReplicaInfo,
    StepsMissed,
    TraceWritten,
)
from profd.core.states import ControllerPhase

TRACE = TraceWritten("t1", "/s/a.json", 10, (3, 4), "train", "torch")


@pytest.mark.parametrize(
    ("kind", "payload"),
    [
        (EventKind.TRACE, TRACE),
        (EventKind.MISSED, StepsMissed((3,))),
        (EventKind.PART_DONE, PartDone((3,), (4,))),
        (EventKind.PHASE, PhaseDone(3, ControllerPhase.STEP_END)),
        (EventKind.ARMED, None),
        (EventKind.ERROR, None),
        (EventKind.CLOSED, None),
    ],
)
def test_each_kind_takes_its_payload_and_survives_pickling(kind, payload) -> None:
    ev = AgentEvent(kind, "s1", 3, payload=payload)
    assert pickle.loads(pickle.dumps(ev)) == ev  # Ray pickles events between processes


@pytest.mark.parametrize(
    ("kind", "payload", "says"),
    [
        (EventKind.TRACE, None, "trace event carries TraceWritten, not NoneType"),
        (EventKind.TRACE, StepsMissed(), "carries TraceWritten, not StepsMissed"),
        (EventKind.PART_DONE, TRACE, "carries PartDone, not TraceWritten"),
        (EventKind.ARMED, PartDone(), "armed event carries no payload, not PartDone"),
    ],
)
def test_a_payload_of_the_wrong_kind_is_refused(kind, payload, says) -> None:
    with pytest.raises(TypeError, match=says):
        AgentEvent(kind, "s1", payload=payload)


def test_payloads_are_frozen() -> None:
    done = PartDone(incomplete=(IncompleteFile("/e/x.pt", "still growing", 7),))
    with pytest.raises(AttributeError):
        done.recorded = (1,)  # type: ignore[misc]


def test_a_replica_record_rides_on_agent_info() -> None:
    replica = ReplicaInfo(world_size=2, global_rank_start=2, global_rank_stop=4, colocated=True)
    info = AgentInfo("r1", "rollout", 1, 2, {"tp": 2}, "h", 1, replica=replica)
    back = pickle.loads(pickle.dumps(info))
    assert back.replica == replica and back.topology == {"tp": 2}


def test_every_message_pickles_as_its_constructor_and_its_fields() -> None:
    """Each message type is rebuilt through its constructor (:func:`fast_pickle`), never its
    dataclass state functions (which look the fields up per object, in Python); what comes
    back equals what went, field by field."""
    import dataclasses

    from profd.actors.agent_desk import Registration
    from profd.core import protocol
    from profd.core.protocol import EMPTY_PLAN, fast_pickle
    from profd.core.relay_wire import RelayHello

    kinds = [
        c
        for c in vars(protocol).values()
        if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == protocol.__name__
    ]
    assert len(kinds) >= 18
    for cls in [*kinds, Registration, RelayHello]:
        assert "__reduce__" in vars(cls), cls.__name__
    samples = [
        AgentEvent(EventKind.TRACE, "s1", 3, payload=TRACE, seq=4),
        AgentInfo("r1", "rollout", 1, 2, {"tp": 2}, "h", 1, labels={"k": "v"}),
        Registration(EMPTY_PLAN, 5.0),
        RelayHello("/tmp/x.sock"),
        StepsMissed((3,)),
    ]
    for msg in samples:
        cls, args = msg.__reduce__()
        assert cls is type(msg) and args == tuple(
            getattr(msg, f.name) for f in dataclasses.fields(msg)
        )
        assert pickle.loads(pickle.dumps(msg)) == msg

    @dataclasses.dataclass(frozen=True)
    class Derived:
        a: int
        b: int = dataclasses.field(init=False, default=0)

    with pytest.raises(TypeError, match="every field must be an __init__ argument"):
        fast_pickle(Derived)


def test_a_restarting_coordinator_is_named_as_such_not_in_rays_words() -> None:
    """`profd status` while Ray restarts a crashed coordinator printed Ray's raw "IOError:
    The actor is restarting.." as an HTTP 503; it says what is going on now."""
    import asyncio

    import pytest
    from ray import exceptions as rx

    from profd.core.errors import CoordinatorUnavailable
    from profd.core.ray_env import acall_coordinator

    class Handle:
        class status:  # as a Ray actor handle's method
            @staticmethod
            def remote() -> object:
                async def fail() -> None:
                    raise rx.ActorUnavailableError("The actor is restarting.", None)

                return fail()

    with pytest.raises(CoordinatorUnavailable) as exc:
        asyncio.run(acall_coordinator(Handle(), "status"))
    assert str(exc.value).startswith("the profd coordinator is restarting (Ray restarts it")
    assert "status can be asked again in a few seconds" in str(exc.value)
