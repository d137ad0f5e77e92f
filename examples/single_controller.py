"""A single-controller RL driver in verl's style, profiled by profd.

verl's shape, in miniature:

* **worker groups**: a group of Ray actors called as one (``RayWorkerGroup``); a call is sent
  to every rank with its share of the batch and the driver gathers the results;
* **workers** (``ActorRolloutRefWorker``: the colocated policy / rollout / reference worker,
  ``CriticWorker``) expose one method per stage and only mark stages; they never see the step;
* **the driver** runs the loop and tells profd the step:
  ``with profd.controller().step(n): ...`` announces step ``n`` to every profiled agent
  before any worker call of the step runs.

A verl config (``global_profiler`` + ``<role>.profiler``) is given to profd unchanged (here
on a private Ray on 127.0.0.1, since no ``--address`` is given; see
:func:`profd.join_or_start_ray`)::

    python examples/single_controller.py --config examples/verl_config.yaml

(``profd.start_session(config)`` before the workers start; see ``docs/verl.md``.) Without
``--config`` nothing is profiled until someone asks, while the driver runs::

    python examples/single_controller.py --address auto --steps 200 --step-seconds 0.5
    profd profile --next-steps 2 --all-ranks --wait
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import profd

VOCAB = 32
HIDDEN = 48
SEQ = 8
BATCH = 8  # prompts per step, split across the data-parallel ranks
MINI_BATCHES = 2


def _policy(torch: Any, out: int) -> Any:
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, out)
    )


def _log_probs(torch: Any, model: Any, tokens: Any) -> Any:
    logp = torch.log_softmax(model(tokens[:, :-1]), -1)
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


class ActorRolloutRefWorker:
    """verl's hybrid worker: generates with the policy, scores with it and with a frozen
    reference, and updates the policy. One process, one profd agent; stage labels carry the
    role (``actor_compute_log_prob``, ``ref_compute_log_prob``, ``actor_update``)."""

    def __init__(self, rank: int, world_size: int) -> None:
        import torch

        torch.set_num_threads(1)
        torch.manual_seed(rank)
        self.torch = torch
        self.actor = _policy(torch, VOCAB)
        self.ref = _policy(torch, VOCAB).requires_grad_(False)
        self.optim = torch.optim.Adam(self.actor.parameters(), lr=1e-3)
        self.agent = profd.attach(
            role="actor_rollout_ref", rank=rank, world_size=world_size, topology={"dp": rank}
        )

    def generate_sequences(self, prompts: Any) -> Any:
        torch = self.torch
        with self.agent.stage("generate_sequences", role="rollout"), torch.no_grad():
            tokens = prompts
            for _ in range(SEQ - prompts.shape[1]):
                probs = torch.softmax(self.actor(tokens)[:, -1], -1)
                tokens = torch.cat([tokens, torch.multinomial(probs, 1)], dim=1)
            return tokens

    def compute_log_prob(self, tokens: Any) -> Any:
        with self.agent.stage("compute_log_prob", role="actor"), self.torch.no_grad():
            return _log_probs(self.torch, self.actor, tokens)

    def compute_ref_log_prob(self, tokens: Any) -> Any:
        with self.agent.stage("compute_log_prob", role="ref"), self.torch.no_grad():
            return _log_probs(self.torch, self.ref, tokens)

    def update_actor(self, tokens: Any, advantages: Any) -> float:
        total = 0.0
        with self.agent.stage("update", role="actor", update_loop=True):
            for i, (tok, adv) in enumerate(
                zip(tokens.chunk(MINI_BATCHES), advantages.chunk(MINI_BATCHES), strict=True)
            ):
                with self.agent.mini_batch(i):
                    self.optim.zero_grad()
                    loss = -(_log_probs(self.torch, self.actor, tok) * adv).mean()
                    loss.backward()
                    self.optim.step()
                    total += loss.item()
        return total

    def profd_connected(self) -> bool:
        return self.agent.connected

    def close(self) -> bool:
        return self.agent.close(timeout=120)


class CriticWorker:
    """verl's critic: values for the advantage, then its own update."""

    def __init__(self, rank: int, world_size: int) -> None:
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        self.critic = _policy(torch, 1)
        self.optim = torch.optim.Adam(self.critic.parameters(), lr=1e-3)
        self.agent = profd.attach(role="critic", rank=rank, world_size=world_size)

    def compute_values(self, tokens: Any) -> Any:
        with self.agent.stage("compute_values"), self.torch.no_grad():
            return self.critic(tokens).squeeze(-1)

    def update_critic(self, tokens: Any, returns: Any) -> float:
        total = 0.0
        with self.agent.stage("update_critic", update_loop=True):
            for i, (tok, ret) in enumerate(
                zip(tokens.chunk(MINI_BATCHES), returns.chunk(MINI_BATCHES), strict=True)
            ):
                with self.agent.mini_batch(i):
                    self.optim.zero_grad()
                    loss = ((self.critic(tok).squeeze(-1)[:, :-1] - ret) ** 2).mean()
                    loss.backward()
                    self.optim.step()
                    total += loss.item()
        return total

    def profd_connected(self) -> bool:
        return self.agent.connected

    def close(self) -> bool:
        return self.agent.close(timeout=120)


class RayWorkerGroup:
    """Ranks of one worker class, called as one: the batch is split across the ranks
    (data parallel) and the results are concatenated, as verl's ``DP_COMPUTE`` dispatch does."""

    def __init__(self, cls: type, world_size: int, **options: Any) -> None:
        import ray

        remote = ray.remote(cls).options(**options)
        self.workers = [remote.remote(rank, world_size) for rank in range(world_size)]

    def _call(self, method: str, *batches: Any) -> list[Any]:
        import ray

        shards = [b.chunk(len(self.workers)) for b in batches]
        refs = [
            getattr(w, method).remote(*(s[i] for s in shards)) for i, w in enumerate(self.workers)
        ]
        return ray.get(refs)

    def __getattr__(self, method: str) -> Any:
        def call(*batches: Any) -> Any:
            import torch

            results = self._call(method, *batches)
            return torch.cat(results) if isinstance(results[0], torch.Tensor) else results

        return call

    def close(self) -> list[bool]:
        import ray

        return ray.get([w.close.remote() for w in self.workers])

    def wait_profd(self, timeout: float = 30.0) -> bool:
        """Wait until every rank's agent holds its plan (for a window declared at launch)."""
        import ray

        deadline = time.monotonic() + timeout
        while not all(ray.get([w.profd_connected.remote() for w in self.workers])):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True


def fit(
    arr_wg: RayWorkerGroup,
    critic_wg: RayWorkerGroup,
    steps: int,
    step_seconds: float,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """The driver loop: one RL step = rollout, scoring, advantages, updates."""
    import torch

    ctl = profd.controller()
    history = []
    for step in range(1, steps + 1):
        started = time.perf_counter()
        with ctl.step(step):  # every profiled agent knows the step before the first call
            prompts = torch.randint(0, VOCAB, (BATCH, 2))
            tokens = arr_wg.generate_sequences(prompts)
            old_log_prob = arr_wg.compute_log_prob(tokens)
            ref_log_prob = arr_wg.compute_ref_log_prob(tokens)
            values = critic_wg.compute_values(tokens)
            # driver-side, as verl's compute_advantage: KL-penalised reward, reward-to-go
            rewards = (tokens[:, 1:] % 2).float() - 0.1 * (old_log_prob - ref_log_prob)
            returns = rewards.flip(-1).cumsum(-1).flip(-1)
            advantages = returns - values[:, :-1]
            critic_loss = critic_wg.update_critic(tokens, returns)
            actor_loss = arr_wg.update_actor(tokens, advantages)
        history.append(
            {"step": step, "actor_loss": sum(actor_loss), "critic_loss": sum(critic_loss)}
        )
        if progress:  # one line per step, for whoever watches the job (and its tests)
            took = time.perf_counter() - started
            print(json.dumps({"step": step, "seconds": round(took, 4)}), flush=True)
        spare = step_seconds - (time.perf_counter() - started)
        if spare > 0:
            time.sleep(spare)
    return history


def main(
    steps: int = 4,
    config: str | None = None,
    step_seconds: float = 0.0,
    address: str | None = None,
    actor_world_size: int = 2,
    progress: bool = False,
) -> dict[str, Any]:
    profd.join_or_start_ray(address, num_cpus=4)
    import ray

    session_id = None
    if config is not None:  # verl's own profiler config, unchanged (before the workers start)
        session_id = profd.start_session(config).session_id
    arr_wg = RayWorkerGroup(ActorRolloutRefWorker, actor_world_size, num_cpus=0)
    critic_wg = RayWorkerGroup(CriticWorker, 1, num_cpus=0)
    try:
        if session_id is not None:  # the window starts soon: every worker holds its plan first
            for group in (arr_wg, critic_wg):
                group.wait_profd()
        history = fit(arr_wg, critic_wg, steps, step_seconds, progress)
        closed = arr_wg.close() + critic_wg.close()  # flushes the last profiled step
    finally:
        for w in arr_wg.workers + critic_wg.workers:
            ray.kill(w)
    out = {
        "ray_address": ray.get_runtime_context().gcs_address,
        "session_id": session_id,
        "steps": len(history),
        "closed": closed,
        "last": history[-1],
    }
    if session_id is not None:
        view = profd.wait_session(session_id)
        out.update(state=view.state.value, traces=[t.path for t in view.traces])
    return out


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--address",
        default=None,
        help="Ray address, e.g. auto (default: $RAY_ADDRESS, else a private Ray on 127.0.0.1)",
    )
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--step-seconds", type=float, default=0.0, help="minimum time per step")
    p.add_argument("--config", default=None, help="verl (or profd) profiler config, YAML")
    p.add_argument("--progress", action="store_true", help="print one JSON line per step")
    return p.parse_args()


if __name__ == "__main__":
    args = _parse()
    try:
        out = main(args.steps, args.config, args.step_seconds, args.address, progress=args.progress)
    except ConnectionError as exc:  # no cluster at --address: say so, no traceback
        raise SystemExit(f"error: {exc}") from None
    print(json.dumps(out, default=str))
