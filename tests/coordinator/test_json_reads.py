"""The sidecar's read routes pass through JSON the coordinator encoded (``read_json``): each
body equals what dumping the views in the route's listing model gives."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from profd.api.responses import json_listing, json_response
from profd.api.routes.agents import AgentList
from profd.api.routes.sessions import SessionList
from profd.api.routes.traces import TraceList
from profd.core.errors import RequestInvalid
from profd.core.json_body import JsonItems
from tests.coordinator.test_coordinator_unit import EVERY_ACTOR, make, trace, two_agents


def _body(response) -> object:  # type: ignore[no-untyped-def]
    assert response.media_type == "application/json"
    return json.loads(response.body)


def test_json_reads_equal_the_views_dumped_by_their_listing_models(tmp_path: Path) -> None:
    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        await two_agents(coord)
        views = []
        for steps in ([3], [8]):
            views.append(await coord.create_session({"steps": steps, "roles": EVERY_ACTOR}))
            await coord.cancel_session(views[-1].session_id)
        await coord.report("a", [trace(views[0].session_id, views[0].save_dir, "t-a", (3,))])

        one = await coord.read_json("get_session", views[0].session_id)
        assert isinstance(one, bytes)
        want = (await coord.get_session(views[0].session_id)).model_dump(mode="json")
        assert _body(json_response(one)) == want

        page = await coord.list_sessions(1, None)
        got = await coord.read_json("list_sessions", 1, None)
        assert isinstance(got, JsonItems) and got.count == 1 and got.total == 2
        old = SessionList(data=page.items, count=1, total=page.total, next_cursor=page.next_cursor)
        body = json_listing(got, total=got.total, next_cursor=got.next_cursor)
        assert _body(body) == old.model_dump(mode="json") and got.next_cursor

        tpage = await coord.list_traces(None, None, None, 50, None)
        tgot = await coord.read_json("list_traces", None, None, None, 50, None)
        old_t = TraceList(data=tpage.items, count=1, total=1, next_cursor=None, bytes=tpage.bytes)
        tbody = json_listing(tgot, total=tgot.total, next_cursor=tgot.next_cursor, bytes=tgot.bytes)
        assert _body(tbody) == old_t.model_dump(mode="json")

        agents = await coord.list_agents()
        old_a = AgentList(data=agents, count=2).model_dump(mode="json")
        assert _body(json_listing(await coord.read_json("list_agents"))) == old_a

        status = (await coord.status()).model_dump(mode="json")
        assert _body(json_response(await coord.read_json("status"))) == status

        with pytest.raises(RequestInvalid, match="not a JSON read"):
            await coord.read_json("cancel_session", views[1].session_id)

    asyncio.run(go())


def test_a_coordinator_without_json_reads_is_read_and_encoded_by_the_sidecar() -> None:
    """A new sidecar beside an older coordinator (still running after an upgrade): its read
    routes encode the plain reads themselves."""
    from profd.api.client import RayCoordinatorClient

    class Remote:
        def __init__(self, answer: object) -> None:
            self.answer = answer

        def remote(self, *args: object) -> object:
            async def done() -> object:
                return self.answer

            return done()

    from profd.core.views import TraceView

    t = TraceView(
        trace_id="t1", session_id="s1", agent_id="a", role="actor", rank=0, tool="torch",
        scope="train", steps=[3], path="/p/t1.json", file_name="t1.json", bytes=5,
        node_id=None, node_ip=None, hostname="h", created_at=1.0,
    )  # fmt: skip

    class OldHandle:  # an actor handle has attributes for its methods only: no read_json
        list_agents = Remote([t])

    client = RayCoordinatorClient(lookup=lambda: OldHandle())
    got = asyncio.run(client.call("read_json", "list_agents"))
    assert isinstance(got, JsonItems) and got.count == 1
    assert json.loads(json_listing(got).body) == {"data": [t.model_dump(mode="json")], "count": 1}


def test_a_finished_sessions_json_is_kept_until_what_it_shows_changes(tmp_path: Path) -> None:
    """Read again unchanged, a finished session's view is the kept JSON; a trace indexed late,
    an upload or a finish hook that moves on, each shows in the next read (as a view built
    afresh has it), and a live session is built on every read."""
    from profd.actors.sessions import HookRecord, UploadRecord
    from profd.core.states import HookState, UploadState

    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        await two_agents(coord)
        live = await coord.create_session({"steps": [30], "roles": EVERY_ACTOR})
        assert live.state.is_terminal is False
        first = await coord.read_json("get_session", live.session_id)
        assert await coord.read_json("get_session", live.session_id) is not first

        await coord.cancel_session(live.session_id)
        sid = live.session_id
        s = coord._book.get(sid)

        async def fresh() -> object:
            return (await coord.get_session(sid)).model_dump(mode="json")

        kept = await coord.read_json("get_session", sid)
        assert await coord.read_json("get_session", sid) is kept  # not built again
        assert json.loads(kept) == await fresh()

        await coord.report("a", [trace(sid, live.save_dir, "t-late", (30,))])
        late = await coord.read_json("get_session", sid)
        assert [t["trace_id"] for t in json.loads(late)["traces"]] == ["t-late"]
        assert json.loads(late) == await fresh()

        s.uploads["t-late"] = UploadRecord(path="/p", bytes=1, node_id=None)
        pending = await coord.read_json("get_session", sid)
        assert json.loads(pending)["uploads"][0]["state"] == "pending"
        s.uploads["t-late"] = UploadRecord(
            path="/p", bytes=1, node_id=None, state=UploadState.DONE, dest="file:///d"
        )
        done = json.loads(await coord.read_json("get_session", sid))
        assert done["uploads"][0]["state"] == "done" and done == await fresh()

        s.hooks["h"] = HookRecord(agent_id="h", role="actor", rank=0, node="n")
        assert json.loads(await coord.read_json("get_session", sid))["hooks"][0]["state"] == (
            "pending"
        )
        s.hooks["h"] = HookRecord(
            agent_id="h", role="actor", rank=0, node="n", state=HookState.DONE, exit_code=0
        )
        hooked = json.loads(await coord.read_json("get_session", sid))
        assert hooked["hooks"][0]["exit_code"] == 0 and hooked == await fresh()

        # steps chosen after the session ended (next_steps cancelled while being aligned)
        s.resolve_steps((31,))
        stepped = json.loads(await coord.read_json("get_session", sid))
        assert stepped["steps"] == [31] and stepped == await fresh()
        hooked = stepped

        # a page is made of the same kept JSON
        page = await coord.read_json("list_sessions", 10, None)
        assert json.loads(page.items) == [hooked]

    asyncio.run(go())


def test_the_kept_json_of_finished_sessions_stays_within_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from profd.actors import session_book

    async def go() -> None:
        coord, _ = make(tmp_path)
        await coord.start()
        await two_agents(coord)
        ids = []
        for step in range(20, 26):
            v = await coord.create_session({"steps": [step], "roles": EVERY_ACTOR})
            await coord.cancel_session(v.session_id)
            ids.append(v.session_id)
        size = len(await coord.read_json("get_session", ids[0]))
        monkeypatch.setattr(session_book, "VIEW_CACHE_BYTES", 3 * size + size // 2)
        coord._book._encoded.clear()
        coord._book._encoded_bytes = 0
        for sid in ids:
            await coord.read_json("get_session", sid)
        book = coord._book
        assert list(book._encoded) == ids[-3:]  # the least recently read dropped first
        assert book._encoded_bytes == sum(len(b) for _, b in book._encoded.values())
        assert book._encoded_bytes <= session_book.VIEW_CACHE_BYTES

    asyncio.run(go())
