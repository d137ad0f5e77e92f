"""A small synthetic RL post-training loop on CPU, marked with profd.

Two kinds of worker, as in a PPO job with colocated roles:

* ``actor_rollout_ref`` (one per actor rank): generates sequences with the policy, computes
  old log-probs, computes reference log-probs with a frozen copy, and updates the policy over
  mini-batches and micro-batches;
* ``critic``: computes values and updates the value model the same way.

Each worker runs the loop itself (SPMD style) and marks step, stages, mini- and micro-batches.
The class is plain; the demo applies ``ray.remote`` when it creates the workers.
"""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["DemoWorker", "StepBudget"]

log = logging.getLogger(__name__)

VOCAB = 64
HIDDEN = 96
SEQ = 12
BATCH = 16
MINI_BATCHES = 2
MICRO_BATCHES = 2


class DemoWorker:
    def __init__(self, role: str, rank: int, world_size: int, seed: int = 0) -> None:
        import torch

        import profd

        torch.set_num_threads(1)
        torch.manual_seed(seed + rank)
        self.role = role
        self.rank = rank
        self._torch = torch

        def mlp(out: int) -> Any:
            return torch.nn.Sequential(
                torch.nn.Embedding(VOCAB, HIDDEN),
                torch.nn.Linear(HIDDEN, HIDDEN),
                torch.nn.GELU(),
                torch.nn.Linear(HIDDEN, out),
            )

        if role == "critic":
            self.model = mlp(1)
        else:
            self.model = mlp(VOCAB)
            self.ref = mlp(VOCAB).requires_grad_(False)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.agent = profd.attach(
            role=role, rank=rank, world_size=world_size, topology={"dp": rank}
        )

    def ready(self) -> str:
        return self.agent.agent_id

    def node_id(self) -> str | None:
        return self.agent.info.node_id

    # -- stages ---------------------------------------------------------------------------
    def _generate(self) -> Any:
        torch = self._torch
        tokens = torch.randint(0, VOCAB, (BATCH, 1))
        with torch.no_grad():
            for _ in range(SEQ - 1):
                logits = self.model(tokens)[:, -1]
                nxt = torch.multinomial(torch.softmax(logits, -1), 1)
                tokens = torch.cat([tokens, nxt], dim=1)
        return tokens

    def _log_prob(self, model: Any, tokens: Any) -> Any:
        torch = self._torch
        logits = model(tokens[:, :-1])
        return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)

    def _update(self, tokens: Any, target: Any, at_least_s: float = 0.0) -> float:
        """Mini-batches of micro-batches; the optimiser steps once per mini-batch. Then, if
        that took less than ``at_least_s``, waits for the rest (standing in for the time a
        real job's update waits on its all-reduce)."""
        torch = self._torch
        agent = self.agent
        started = time.perf_counter()
        total = 0.0
        for i, mb in enumerate(tokens.chunk(MINI_BATCHES)):
            mb_target = target.chunk(MINI_BATCHES)[i]
            with agent.mini_batch(i):
                self.optim.zero_grad()
                for j, (micro, micro_t) in enumerate(
                    zip(mb.chunk(MICRO_BATCHES), mb_target.chunk(MICRO_BATCHES), strict=True)
                ):
                    with agent.micro_batch(j):
                        if self.role == "critic":
                            values = self.model(micro).squeeze(-1)
                            loss = torch.nn.functional.mse_loss(values, micro_t)
                        else:
                            logp = self._log_prob(self.model, micro)
                            loss = -(logp * micro_t[:, 1:]).mean()
                        loss.backward()
                        total += loss.item()
                self.optim.step()
        spare = at_least_s - (time.perf_counter() - started)
        if spare > 0:
            time.sleep(spare)
        return total

    def _actor_step(self, update_s: float = 0.0) -> float:
        agent = self.agent
        torch = self._torch
        with agent.stage("generate_sequences"):
            tokens = self._generate()
        with agent.stage("compute_log_prob"), torch.no_grad():
            old = self._log_prob(self.model, tokens)
        with agent.stage("ref_compute_log_prob"), torch.no_grad():
            ref = self._log_prob(self.ref, tokens)
        advantages = torch.nn.functional.pad((old - ref).detach(), (1, 0))
        with agent.stage("update_actor", update_loop=True):
            return self._update(tokens, advantages, update_s)

    def _critic_step(self, update_s: float = 0.0) -> float:
        agent = self.agent
        torch = self._torch
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
        with agent.stage("compute_values"), torch.no_grad():
            values = self.model(tokens).squeeze(-1)
        returns = values + torch.randn_like(values) * 0.1
        with agent.stage("update_critic", update_loop=True):
            return self._update(tokens, returns, update_s)

    # -- single-controller style ------------------------------------------------------------
    def work(self, update_s: float = 0.0) -> float:
        """One step's stages, called by a driver that marks the step itself
        (``profd.controller().step(n)``); the worker never calls ``agent.step``.
        ``update_s``: the update stage takes at least this long (the demo makes one rank
        slow by raising it)."""
        if self.role == "critic":
            return self._critic_step(update_s)
        return self._actor_step(update_s)

    def close(self) -> bool:
        return self.agent.close(timeout=120)

    # -- loop -----------------------------------------------------------------------------
    def run(
        self,
        num_steps: int,
        min_step_s: float = 0.5,
        first_step: int = 1,
        budget: Any = None,
    ) -> dict[str, Any]:
        """Run ``num_steps`` steps, or up to ``budget.last()`` when that is later (the demo
        extends the run so a window chosen late still happens). Each step takes at least
        ``min_step_s``, standing in for time a real job waits on rollouts and collectives.
        """
        last = first_step + num_steps - 1
        losses = []
        step = first_step
        while step <= last:
            started = time.perf_counter()
            with self.agent.step(step):
                losses.append(self._critic_step() if self.role == "critic" else self._actor_step())
                spare = min_step_s - (time.perf_counter() - started)
                if spare > 0:
                    time.sleep(spare)
            if budget is not None:
                last = max(last, _budget_last(budget, last))
            step += 1
        written = self.agent.close(timeout=120)
        return {
            "role": self.role,
            "rank": self.rank,
            "steps": step - first_step,
            "traces_written": written,
            "final_loss": losses[-1] if losses else None,
        }


def _budget_last(budget: Any, default: int) -> int:
    """The driver's budget; if it cannot be read, the loop keeps its own plan."""
    import ray

    try:
        return int(ray.get(budget.last.remote(), timeout=10))
    except Exception as exc:  # the demo's loop keeps its own plan
        log.warning("demo: could not read the step budget: %r", exc)
        return default


class StepBudget:
    """The last step the demo workers should run (an actor the driver can raise)."""

    def __init__(self) -> None:
        self._last = 0

    def extend_to(self, step: int) -> int:
        self._last = max(self._last, step)
        return self._last

    def last(self) -> int:
        return self._last

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()
