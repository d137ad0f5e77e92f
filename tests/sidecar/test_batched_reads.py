"""The sidecar's reads go to the coordinator a few calls at a time (``BatchedReads``): reads
asked while calls are in flight go together in one ``read_many``, each answered (or failed)
as itself; other calls pass straight through."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from profd.api.client import BatchedReads, LocalCoordinatorClient
from profd.core.errors import CoordinatorUnavailable, NotFoundError, RequestInvalid
from tests.coordinator.test_coordinator_unit import EVERY_ACTOR, make, two_agents


class HeldCoordinator:
    """Records each call and answers it only when the test releases it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.gates: list[asyncio.Future[None]] = []

    async def call(self, method: str, *args: Any) -> Any:
        self.calls.append((method, args))
        gate = asyncio.get_running_loop().create_future()
        self.gates.append(gate)
        await gate
        if method == "read_many":
            return [self._answer(m, a) for m, a in args[0]]
        answer = self._answer(method, args)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    @staticmethod
    def _answer(method: str, args: tuple[Any, ...]) -> Any:
        if args and args[-1] == "missing":
            return NotFoundError(f"no session {args[-1]!r}")
        return f"{method}{args}"

    def release_all(self) -> None:
        for gate in self.gates:
            if not gate.done():
                gate.set_result(None)


async def _until(cond: Any) -> None:
    while not cond():
        await asyncio.sleep(0)


def test_reads_asked_while_calls_are_in_flight_go_together_each_answered_as_itself() -> None:
    async def go() -> None:
        inner = HeldCoordinator()
        reads = BatchedReads(inner, in_flight=2)
        first = [asyncio.ensure_future(reads.call("ping")) for _ in range(2)]
        await _until(lambda: len(inner.calls) == 2)
        assert inner.calls == [("ping", ()), ("ping", ())]  # alone: sent as themselves

        later = [
            asyncio.ensure_future(reads.call("read_json", "get_session", sid))
            for sid in ("s1", "missing", "s3")
        ]
        change = asyncio.ensure_future(reads.call("create_session", {"steps": [1]}))
        await _until(lambda: len(inner.calls) == 3)
        assert inner.calls[2] == ("create_session", ({"steps": [1]},))  # not held back

        inner.release_all()
        assert await asyncio.gather(*first) == ["ping()", "ping()"]
        await _until(lambda: len(inner.calls) == 4)
        assert inner.calls[3] == (
            "read_many",
            ([("read_json", ("get_session", sid)) for sid in ("s1", "missing", "s3")],),
        )
        inner.release_all()
        got = await asyncio.gather(*later, return_exceptions=True)
        assert got[0] == "read_json('get_session', 's1')"
        assert isinstance(got[1], NotFoundError) and "missing" in str(got[1])
        assert got[2] == "read_json('get_session', 's3')"
        assert await change == "create_session({'steps': [1]},)"
        assert (reads.batches, reads.batched_reads) == (1, 3)

    asyncio.run(go())


def test_a_batch_that_fails_as_a_whole_fails_each_of_its_reads_and_the_next_ones_go() -> None:
    class Gone(HeldCoordinator):
        async def call(self, method: str, *args: Any) -> Any:
            if method == "read_many" and not self.calls:
                self.calls.append((method, args))
                raise CoordinatorUnavailable("the profd coordinator did not answer")
            return await super().call(method, *args)

    async def go() -> None:
        inner = Gone()
        reads = BatchedReads(inner, in_flight=1)
        blocker = asyncio.ensure_future(reads.call("ping"))
        await _until(lambda: inner.calls)
        inner.calls.clear()
        waiting = [asyncio.ensure_future(reads.call("read_json", "status")) for _ in range(3)]
        await asyncio.sleep(0)
        inner.release_all()
        assert await blocker == "ping()"
        got = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(g, CoordinatorUnavailable) for g in got)
        again = asyncio.ensure_future(reads.call("read_json", "status"))
        await _until(lambda: len(inner.gates) == 2)
        inner.release_all()
        assert await again == "read_json('status',)"

    asyncio.run(go())


def test_the_coordinators_read_many_answers_each_read_as_it_would_alone(tmp_path: Path) -> None:
    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        await two_agents(coord)
        view = await coord.create_session({"steps": [3], "roles": EVERY_ACTOR})
        reads = [
            ("read_json", ("get_session", view.session_id)),
            ("read_json", ("get_session", "nope")),
            ("ping", ()),
            ("read_json", ("list_sessions", 10, None)),
            ("cancel_session", (view.session_id,)),
            ("read_json", ("get_session",)),  # a bad call: that read fails, as itself
        ]
        got = await coord.read_many(reads)
        assert json.loads(got[0]) == (await coord.get_session(view.session_id)).model_dump(
            mode="json"
        )
        assert isinstance(got[1], NotFoundError)
        assert got[2] == await coord.ping()
        assert got[3].count == 1 and got[3].total == 1
        assert isinstance(got[4], RequestInvalid) and "not a batched read" in str(got[4])
        assert isinstance(got[5], RuntimeError) and "TypeError" in str(got[5])
        assert (await coord.get_session(view.session_id)).state.is_terminal is False

        # through the client, with the coordinator in this process
        client = BatchedReads(LocalCoordinatorClient(coord), in_flight=1)
        answers = await asyncio.gather(
            *(client.call("read_json", "get_session", view.session_id) for _ in range(5)),
            client.call("read_json", "get_session", "nope"),
            return_exceptions=True,
        )
        assert all(a == got[0] for a in answers[:5]) and isinstance(answers[5], NotFoundError)
        assert client.batches == 1 and client.batched_reads == 5

    asyncio.run(go())


def test_a_batch_answered_with_the_wrong_number_of_answers_fails_each_read() -> None:
    class Short(HeldCoordinator):
        async def call(self, method: str, *args: Any) -> Any:
            if method == "read_many":
                self.calls.append((method, args))
                return []
            return await super().call(method, *args)

    async def go() -> None:
        inner = Short()
        reads = BatchedReads(inner, in_flight=1)
        blocker = asyncio.ensure_future(reads.call("ping"))
        await _until(lambda: inner.calls)
        waiting = [asyncio.ensure_future(reads.call("read_json", "status")) for _ in range(2)]
        await asyncio.sleep(0)
        inner.release_all()
        assert await blocker == "ping()"
        got = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 5)
        assert all(isinstance(g, CoordinatorUnavailable) for g in got), got

    asyncio.run(go())


@pytest.mark.parametrize("n", [1, 2])
def test_an_older_coordinator_without_read_many_is_read_one_read_at_a_time(n: int) -> None:
    from profd.api.client import RayCoordinatorClient

    class Remote:
        def __init__(self, name: str) -> None:
            self.name = name

        def remote(self, *args: object) -> object:
            async def done() -> object:
                if args and args[-1] == "nope":
                    raise NotFoundError("no session 'nope'")
                return f"{self.name}{args}"

            return done()

    class OldHandle:  # an actor handle has attributes for its methods only
        read_json = Remote("read_json")
        ping = Remote("ping")

    async def go() -> None:
        client = BatchedReads(RayCoordinatorClient(lookup=lambda: OldHandle()), in_flight=1)
        calls = [client.call("ping")] + [
            client.call("read_json", "get_session", sid) for sid in ["s", "nope"][:n]
        ]
        got = await asyncio.gather(*calls, return_exceptions=True)
        assert got[0] == "ping()"
        if n == 2:
            assert got[1] == "read_json('get_session', 's')" and isinstance(got[2], NotFoundError)

    asyncio.run(go())
