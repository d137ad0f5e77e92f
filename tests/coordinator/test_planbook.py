"""PlanBook: versioned per-agent plans and the long-polls parked on them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from profd.actors.planbook import PlanBook
from profd.core.protocol import WindowPlan
from profd.core.states import ControllerPhase


def window(sid: str) -> WindowPlan:
    return WindowPlan(sid, "torch", (1,), ((1,),), False, {}, f"/tmp/{sid}", "*")


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


def test_versions_only_grow_and_an_unchanged_plan_keeps_its_version() -> None:
    book = PlanBook()
    assert book.plan("a").version == 0  # unknown agent: the empty plan
    assert book.set("a", (window("s1"),)) is True
    v1 = book.plan("a").version
    assert book.set("a", (window("s1"),)) is False  # same windows
    assert book.plan("a").version == v1
    assert book.set("b", (window("s1"),)) is True
    assert book.set("a", ()) is True
    assert book.plan("a").version > book.plan("b").version > v1
    assert book.plan("a").windows == ()


def test_a_restarted_book_never_reuses_a_version() -> None:
    first = PlanBook()
    first.set("a", (window("s1"),))
    time.sleep(0.002)  # versions start from the clock (milliseconds)
    second = PlanBook()
    second.set("a", (window("s2"),))
    assert second.plan("a").version > first.plan("a").version


def test_controller_steps_keep_the_windows_and_change_the_version_once() -> None:
    book = PlanBook()
    book.set("a", (window("s1"),))
    v = book.set_controller_step("a", 5, ControllerPhase.STEP_BEGIN)
    assert v == book.plan("a").version
    assert book.set_controller_step("a", 5, ControllerPhase.STEP_BEGIN) == v  # unchanged
    plan = book.plan("a")
    assert (plan.controller_step, plan.controller_phase) == (5, ControllerPhase.STEP_BEGIN)
    assert plan.windows == (window("s1"),)
    book.set("a", ())  # new windows keep the announced step
    assert book.plan("a").controller_step == 5


def test_wait_answers_at_once_when_the_agent_is_behind() -> None:
    async def go() -> None:
        book = PlanBook()
        book.set("a", (window("s1"),))
        plan = await book.wait("a", 0, 10.0)
        assert plan is not None and plan.windows == (window("s1"),)

    run(go)


def test_wait_parks_until_the_plan_changes() -> None:
    async def go() -> None:
        book = PlanBook()
        book.ensure("a")
        parked = asyncio.create_task(book.wait("a", 0, 10.0))
        await asyncio.sleep(0)
        assert not parked.done()
        book.set("a", (window("s1"),))
        plan = await asyncio.wait_for(parked, 1.0)
        assert plan is not None and plan.windows == (window("s1"),)

    run(go)


def test_wait_times_out_with_nothing_new() -> None:
    async def go() -> None:
        book = PlanBook()
        book.set("a", (window("s1"),))
        assert await book.wait("a", book.plan("a").version, 0.01) is None

    run(go)


def test_wait_any_returns_only_the_changed_plans() -> None:
    async def go() -> None:
        book = PlanBook()
        for aid in ("a", "b"):
            book.set(aid, (window("s1"),))
        known = {aid: book.plan(aid).version for aid in ("a", "b")}
        known["ghost"] = 0  # unknown agents are ignored, never answered
        parked = asyncio.create_task(book.wait_any(known, 10.0))
        await asyncio.sleep(0)
        book.set("b", ())
        changed = await asyncio.wait_for(parked, 1.0)
        assert list(changed) == ["b"] and changed["b"].windows == ()
        # nothing parked is left behind once the poll returned
        assert await book.wait_any({"b": changed["b"].version}, 0) == {}

    run(go)


def test_a_quiet_plan_that_only_loses_windows_wakes_nobody() -> None:
    """A window the agent ended itself leaves its plan without waking its poll or its relay
    (the plan goes with its next poll); a quiet plan that brings a window wakes as usual."""

    async def go() -> None:
        book = PlanBook()
        told: list[str] = []
        book.on_change = lambda aid, refresh: told.append(aid) or False
        book.set("a", (window("s1"), window("s2")))
        held = book.plan("a").version
        told.clear()
        parked = asyncio.create_task(book.wait("a", held, 0.2))
        await asyncio.sleep(0)
        assert book.set("a", (window("s2"),), quiet=True)
        await asyncio.sleep(0.05)
        assert not parked.done() and told == []
        plan = await parked  # at its time, with the plan it did not hold
        assert plan is not None and plan.windows == (window("s2"),) and plan.version > held
        parked = asyncio.create_task(book.wait("a", plan.version, 10.0))
        await asyncio.sleep(0)
        assert book.set("a", (window("s3"),), quiet=True)  # s2 leaves, s3 comes: news
        woken = await asyncio.wait_for(parked, 1.0)
        assert woken is not None and woken.windows == (window("s3"),) and told == ["a"]

    run(go)


def test_wake_releases_a_parked_poll_without_a_new_plan() -> None:
    async def go() -> None:
        book = PlanBook()
        book.ensure("a")
        parked = asyncio.create_task(book.wait_any({"a": 0}, 10.0))
        await asyncio.sleep(0)
        book.wake("a")
        assert await asyncio.wait_for(parked, 1.0) == {}

    run(go)


def test_wait_delivered_waits_for_the_agents_poll_with_the_version() -> None:
    async def go() -> None:
        book = PlanBook()
        book.ensure("a")
        book.ensure("b")
        versions = {aid: book.set_controller_step(aid, 3) for aid in ("a", "b")}
        delivered = asyncio.create_task(book.wait_delivered(versions, 10.0))
        await asyncio.sleep(0)
        await book.wait_any({"a": versions["a"]}, 0)  # a polls holding the new version
        assert not delivered.done()
        await book.wait_any({"b": versions["b"]}, 0)
        assert await asyncio.wait_for(delivered, 1.0) == []

    run(go)


def test_wait_delivered_names_the_agents_that_did_not_confirm() -> None:
    async def go() -> None:
        book = PlanBook()
        versions = {aid: book.set_controller_step(aid, 3) for aid in ("b", "a")}
        await book.wait_any({"a": versions["a"]}, 0)
        assert await book.wait_delivered(versions, 0.02) == ["b"]

    run(go)


def test_a_late_ack_of_an_older_version_does_not_undo_a_delivery() -> None:
    """A relay's sync or push answered late names the version its agent held before: the
    plan delivered since stays delivered (a wait for it ends, and is not made again)."""

    async def go() -> None:
        book = PlanBook()
        old = book.set_controller_step("a", 3)
        new = book.set_controller_step("a", 4)
        book.ack("a", new)
        book.ack("a", old)  # the late answer
        assert await book.wait_delivered({"a": new}, 0.02) == []

    run(go)


def test_an_ack_above_the_plan_an_agent_can_hold_is_ignored() -> None:
    """A version of an earlier incarnation above this one's (its counter ran ahead of the
    clock this one starts from) must not count every later plan as delivered."""

    async def go() -> None:
        book = PlanBook()
        v = book.set_controller_step("a", 3)
        book.ack("a", v + 50_000)  # a relay's snapshot from before the restart
        assert await book.wait_delivered({"a": v}, 0.02) == ["a"]
        book.ack("a", v)
        assert await book.wait_delivered({"a": v}, 0.02) == []

    run(go)
