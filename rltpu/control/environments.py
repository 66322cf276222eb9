"""The environment workers the controller owns (``env:`` configs): one CPU-only Ray actor per
sampler, each playing its sampler's shard of episodes (``actors/env_worker.py``).

A worker that dies is replaced (``replace_dead``) and its shard redone like a failed sampler
shard; each ``reset``/``step`` call inside runs under ``task.reward_timeout_s``, and its failures
reach the reward pool's counters (``reward_errors``, ``reward_timeouts``, the failure fraction
that stops a job), so ``rltpu status`` and the dashboard show them with the reward calls'.
"""

from __future__ import annotations

import os

from rltpu.observe.log import get_logger

logger = get_logger(__name__)


class EnvPool:
    def __init__(self, ray, cfg, n: int):
        self.ray, self.cfg, self.n = ray, cfg, n
        self.handles: list = []
        self.incarnation = [0] * n
        self.replaced = 0

    def _spawn(self, rank: int):
        from actors.env_worker import EnvWorker
        from rltpu.config import sections_of

        return self.ray.remote(EnvWorker).options(
            name=f"rltpu-env-worker-{rank}-{os.getpid()}-{self.incarnation[rank]}", num_cpus=0,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
        ).remote(rank, sections_of(self.cfg, EnvWorker.SECTIONS))

    def start(self) -> None:
        self.handles = [self._spawn(r) for r in range(self.n)]

    def run(self, rank: int, sampler, examples: list[dict], G: int, seed: int, greedy: bool | None = None):
        """The shard's episodes on worker ``rank``, sampled by ``sampler``; an ObjectRef."""
        return self.handles[rank].run.remote(sampler, examples, G, seed, greedy)

    def replace_dead(self, timeout_s: float = 10.0) -> bool:
        """Ping every worker; replace those that do not answer. True when one was replaced."""
        refs = [h.ping.remote() for h in self.handles]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        out = False
        for rank, ref in enumerate(refs):
            try:
                if ref not in ready:
                    raise TimeoutError(f"no answer in {timeout_s:g}s")
                self.ray.get(ref, timeout=0)
                continue
            except Exception as err:  # noqa: BLE001 - dead or wedged: replace
                why = f"{type(err).__name__}"
            try:
                self.ray.kill(self.handles[rank], no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            self.incarnation[rank] += 1
            self.handles[rank] = self._spawn(rank)
            self.replaced += 1
            out = True
            logger.warning(f"rltpu: warning: environment worker {rank} failed ({why}); replaced "
                           f"(incarnation {self.incarnation[rank]}), its shard is played again")
        return out

    def shutdown(self) -> None:
        for h in self.handles:
            try:
                self.ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.handles = []
