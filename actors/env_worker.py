"""One environment worker: a CPU-only process (no chips) that plays a sampler shard's episodes.

The controller hands it the shard's examples and its sampler's handle; the worker runs the turn
loop (``rltpu.data.envs.episodes.run_episodes``), calling the sampler once per turn and the
environment's ``reset``/``step`` on ``DeadlineRunner`` threads under ``task.reward_timeout_s``. One
call returns the whole shard, shaped like a sampler's output, so the step loop, async rollouts and
the redo-on-failure path treat an episode shard like a generation shard.
"""

from __future__ import annotations

import os


class EnvWorker:
    # what this process reads of the run config (``rltpu.config.sections_of``): the tokenizer is
    # ``build_tokenizer``'s (task.tokenizer, else model.path, else the task's characters)
    SECTIONS = ("env", "task", "model.path", "sampler.prompt_buckets", "health.deadlines.sampling",
                "health.heartbeat_timeout_s")

    def __init__(self, rank: int, sections: dict):
        from rltpu.config import Sections
        from rltpu.data.sources import build_tokenizer
        from rltpu.data.envs.base import Renderer, load_env_class
        from rltpu.data.envs.episodes import deadline_call

        self.rank = rank
        self.cfg = cfg = Sections.read(sections, "EnvWorker.SECTIONS")
        self.cls = load_env_class(cfg.env.path)
        self.renderer = Renderer(build_tokenizer(cfg), getattr(self.cls, "observation_role", "tool"))
        self.call = deadline_call(cfg.task.reward_timeout_s, cfg.task.reward_concurrency)
        d = cfg.health.deadlines
        self.sample_timeout_s = d.sampling + cfg.health.heartbeat_timeout_s  # the supervisor fences first

    def ping(self) -> int:
        return os.getpid()

    def run(self, sampler, examples: list[dict], G: int, seed: int, greedy: bool | None = None) -> dict:
        import ray

        from rltpu.data.envs.base import make_env
        from rltpu.data.envs.episodes import run_episodes

        def generate(prompts, n, s):
            ref = (sampler.generate.remote(prompts, n, s) if greedy is None
                   else sampler.generate_eval.remote(prompts, n, s, greedy))
            return ray.get(ref, timeout=self.sample_timeout_s)

        e, t = self.cfg.env, self.cfg.task
        envs = [make_env(self.cls, e.kwargs) for _ in range(len(examples) * G)]
        return run_episodes(generate, envs, self.renderer, examples, G, seed, e.max_turns, e.max_tokens,
                            max(self.cfg.sampler.prompt_buckets), self.call, t.reward_default)
