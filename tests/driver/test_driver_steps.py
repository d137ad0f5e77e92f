"""The job's step is its driver's: per Ray job, so two single-controller jobs on one cluster
each keep their own (a coordinator called directly, no Ray)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from profd.actors.coordinator import ProfileCoordinator
from profd.core.errors import RequestInvalid
from profd.core.protocol import AgentInfo

from helpers import coordinator_settings


def info(aid: str, role: str, job: str | None) -> AgentInfo:
    return AgentInfo(aid, role, 0, 1, {}, "h", 1, capabilities={"torch": None}, job_id=job)


def test_two_drivers_on_one_cluster_keep_their_own_steps(tmp_path: Path) -> None:
    async def go() -> None:
        coord = ProfileCoordinator(coordinator_settings(tmp_path, state_dir=None))
        await coord.register(info("a", "actor", "01000000"), None)
        await coord.register(info("b", "critic", "02000000"), None)
        await coord.controller_step(230, 0.1, "01000000")
        await coord.controller_step(5, 0.1, "02000000")
        steps = {a.agent_id: (a.current_step, a.step_source) for a in await coord.list_agents()}
        assert steps == {"a": (230, "driver"), "b": (5, "driver")}
        # job A is past step 50; job B is not
        with pytest.raises(RequestInvalid, match="already begun"):
            await coord.create_session({"steps": [50], "roles": {"actor": {}}})
        view = await coord.create_session({"steps": [50], "roles": {"critic": {}}})
        assert view.reason == "waiting for step 50"
        # next_steps aligns on the target's own driver
        await coord.cancel_session(view.session_id)
        view = await coord.create_session({"next_steps": 1, "roles": {"critic": {}}})
        assert view.steps == [5 + 1 + coord.settings.align_lead_steps]
        # job A's driver announcing a step does not push it to job B's agent
        assert coord._drivers.targets("01000000") == set()
        assert coord._drivers.targets("02000000") == {"b"}
        await coord.cancel_session(view.session_id)
        status = await coord.status()
        assert status.driver_step == 5  # the driver heard from last

    asyncio.run(go())
