"""After the traces: exactly-once uploads and finish hooks, scheduled by the coordinator.

* **Uploads** (``upload_uri``): every trace of the session is copied once, from its node, as
  soon as it is indexed; the record is persisted, so a restarted coordinator resumes pending
  uploads and a destination that already holds the file is not copied again. A failed upload
  makes the session ``partial`` with the reason — never a false success.
* **Finish hook** (``finish_hook_cmd``): once every target is finished, the command runs once
  per hook agent, on that agent's node, with ``PROFD_*`` / ``VERL_PROFILE_*`` variables and a
  timeout; exit code and output are kept in the session. Default hook agents: one profiled
  agent per node (the node's directory is uploaded once); ``finish_hook_ranks`` /
  ``finish_hook_all_ranks`` choose ranks instead, among the agents of the session's roles.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

from profd.actors.hook_upload import HookResult, UploadResult, hook_env, run_hook, upload_file
from profd.actors.registry import AgentRecord
from profd.actors.runner import NodeRunner, TraceLocator
from profd.actors.sessions import HookRecord, Session, UploadRecord
from profd.core.ray_env import ray_node
from profd.core.states import HookState, UploadState
from profd.core.views import TraceView

__all__ = ["Finisher", "hook_agents"]

log = logging.getLogger(__name__)

#: Extra time a hook task may take beyond the hook's own timeout (scheduling, output).
HOOK_SLACK_S = 60.0
UPLOAD_TIMEOUT_S = 3600.0


def hook_agents(session: Session, agents: Iterable[AgentRecord]) -> list[AgentRecord]:
    """The agents whose node runs the finish hook, in (role, rank) order."""
    req = session.request
    recs = {r.info.agent_id: r for r in agents}
    profiled = [recs[a] for a in session.targets if a in recs]
    if req.finish_hook_all_ranks or req.finish_hook_ranks:
        roles = {r.info.role for r in profiled} | {p.role for p in session.targets.values()}
        pool = [r for r in recs.values() if r.info.role in roles]
        wanted = set(req.finish_hook_ranks)
        chosen = [r for r in pool if req.finish_hook_all_ranks or r.info.rank in wanted]
    else:
        by_node: dict[str, AgentRecord] = {}
        for r in sorted(profiled, key=lambda r: (r.info.role, r.info.rank)):
            by_node.setdefault(r.info.node_id or r.info.hostname, r)
        chosen = list(by_node.values())
    return sorted(chosen, key=lambda r: (r.info.role, r.info.rank))


class Finisher:
    def __init__(
        self,
        runner: NodeRunner,
        on_change: Callable[[Session], None],
        base_dir: str,
    ) -> None:
        self._runner = runner
        self._on_change = on_change
        self._base_dir = base_dir
        self._tasks: set[asyncio.Task] = set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- uploads ----------------------------------------------------------------------------
    def upload(self, session: Session, trace: TraceView) -> None:
        uri = session.request.upload_uri
        if not uri or trace.trace_id in session.uploads:
            return
        session.uploads[trace.trace_id] = UploadRecord(
            trace.path, trace.bytes, trace.node_id, trace.node_ip, trace.hostname
        )
        self._spawn(self._upload(session, trace.trace_id))

    def resume(self, session: Session) -> None:
        """After a restart: run the uploads that were pending, and hooks that were running."""
        for trace_id, rec in session.uploads.items():
            if rec.state is UploadState.PENDING:
                self._spawn(self._upload(session, trace_id))
        for agent_id, hook in session.hooks.items():
            if not hook.state.is_terminal:
                why = "the coordinator restarted while the hook ran"
                session.hooks[agent_id] = dataclasses.replace(
                    hook, state=HookState.FAILED, error=why
                )

    async def _upload(self, session: Session, trace_id: str) -> None:
        rec = session.uploads[trace_id]
        try:
            node = await self._node_of(rec)
            result: UploadResult = await asyncio.wait_for(
                self._runner.run(
                    node,
                    upload_file,
                    rec.path,
                    session.request.upload_uri,
                    session.session_id,
                    rec.bytes,
                ),
                UPLOAD_TIMEOUT_S,
            )
        except FileNotFoundError as exc:
            result = UploadResult("", 0, False, str(exc))
        except Exception as exc:
            result = UploadResult("", 0, False, f"{type(exc).__name__}: {exc}")
        state = UploadState.DONE if result.ok else UploadState.FAILED
        session.uploads[trace_id] = dataclasses.replace(
            rec, state=state, dest=result.dest, error=result.error
        )
        if not result.ok:
            log.warning(
                "session %s: upload of %s failed: %s", session.session_id, rec.path, result.error
            )
        self._on_change(session)

    async def _node_of(self, rec: UploadRecord) -> str | None:
        """Where the file of an upload record is read: by node id while that node lives, else
        by its address or host name (a coordinator restored on a new cluster: see
        :func:`profd.actors.runner.locate`)."""
        here = ray_node()[0]
        place = await TraceLocator(self._runner, here).place(rec)
        if not place.found:
            raise FileNotFoundError(f"cannot upload {rec.path}: {place.reason}")
        return here if place.local else place.node_id

    # -- hooks ------------------------------------------------------------------------------
    def start_hooks(self, session: Session, agents: Iterable[AgentRecord], traces: list[TraceView]):
        """Once every part is finished: plan and run the hook (idempotent)."""
        req = session.request
        if req.finish_hook_cmd is None or session.hooks_planned:
            return
        if not all(p.state.is_terminal for p in session.targets.values()):
            return
        session.hooks_planned = True
        chosen = hook_agents(session, agents)
        absent = sorted(set(req.finish_hook_ranks) - {r.info.rank for r in chosen})
        if absent and not req.finish_hook_all_ranks:
            session.warnings.append(
                f"finish hook: finish_hook_ranks {absent} match no live agent of the session's "
                "roles; the hook did not run there"
            )
        for rec in chosen:
            info = rec.info
            node = info.node_id or info.hostname
            mine = [t.path for t in traces if (t.node_id or t.hostname) == node]
            session.hooks[info.agent_id] = HookRecord(info.agent_id, info.role, info.rank, node)
            env = hook_env(
                session_id=session.session_id,
                save_dir=session.save_dir,
                tool=req.tool.value,
                role=info.role,
                rank=info.rank,
                pid=info.pid,
                node=node,
                traces=mine,
            )
            self._spawn(self._hook(session, info.agent_id, info.node_id, env))
        if not session.hooks:
            session.warnings.append("finish hook: no agent left to run it on")
        self._on_change(session)

    async def _hook(
        self, session: Session, agent_id: str, node_id: str | None, env: dict[str, str]
    ) -> None:
        req = session.request
        hook = session.hooks[agent_id] = dataclasses.replace(
            session.hooks[agent_id], state=HookState.RUNNING
        )
        timeout = req.finish_hook_timeout_s
        try:
            result: HookResult = await asyncio.wait_for(
                self._runner.run(
                    node_id, run_hook, req.finish_hook_cmd, env, session.save_dir, timeout
                ),
                timeout + HOOK_SLACK_S,
            )
        except Exception as exc:
            result = HookResult(None, "", 0.0, error=f"{type(exc).__name__}: {exc}")
        if result.timed_out:
            state, msg = HookState.TIMED_OUT, f"timed out after {timeout:.0f} s"
        elif result.ok:
            state, msg = HookState.DONE, ""
        else:
            state, msg = HookState.FAILED, result.error or f"exited with {result.exit_code}"
        session.hooks[agent_id] = dataclasses.replace(
            hook,
            state=state,
            exit_code=result.exit_code,
            output=result.output,
            duration_s=result.duration_s,
            error=result.error,
        )
        if msg:
            session.warnings.append(f"finish hook on {hook.role} rank {hook.rank}: {msg}")
        self._on_change(session)

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
