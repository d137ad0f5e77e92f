"""Helpers shared by the tests (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from profd.demo.server import UvicornThread, free_port  # noqa: F401  (used by tests)


def wait_until(
    predicate: Any, timeout: float = 30.0, interval: float = 0.05, what: str = ""
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")


def coordinator_settings(tmp_path: Path, **overrides: Any) -> Any:
    from profd.core.settings import CoordinatorSettings

    values = dict(
        save_root=str(tmp_path / "profile"),
        base_dir=str(tmp_path),
        # Persist as `profd up` does, so every API test also exercises the SQLite store.
        state_dir=str(tmp_path / "state"),
        poll_timeout_s=1.0,
        heartbeat_timeout_s=6.0,
        align_timeout_s=1.0,
        tick_s=0.2,
    )
    values.update(overrides)
    return CoordinatorSettings(**values)


class LoopClient:
    """Calls a coordinator that lives on an :class:`InProcessCoordinator` loop from any loop
    (uvicorn's, in API tests)."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    async def call(self, method: str, *args: Any) -> Any:
        import asyncio

        coro = getattr(self.owner.coordinator, method)(*args)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.owner.loop))


def start_agents(owner: Any, n: int = 1, role: str = "actor", **kw: Any) -> list[Any]:
    """``n`` agents of one role, registered with an in-process coordinator."""
    from profd.agent import ProfilerAgent

    agents = [ProfilerAgent(role, r, n, find_link=owner.link, **kw).start() for r in range(n)]
    wait_until(lambda: all(a.connected for a in agents), 10, what="agents registered")
    return agents


def wait_terminal(owner: Any, sid: str, timeout: float = 20.0) -> Any:
    def done() -> Any:
        view = owner.call("get_session", sid)
        return view if view.state.is_terminal else None

    return wait_until(done, timeout, what=f"session {sid} terminal")


def wait_armed(agent: Any, sid: str) -> None:
    wait_until(lambda: any(w.session_id == sid for w in agent.plan.windows), 10, what="plan")


def user_ranges(trace: dict) -> list[str]:
    return [e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]


def busy_python_work(seconds: float) -> int:
    """Pure-Python work for a while (what py-spy should find by name)."""
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += sum(i * i for i in range(200))
    return n
