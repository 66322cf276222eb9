"""The quickstart's GRPO loop in one process, without Ray: does the policy learn with LoRA? (issue 20)

    python benchmarks/lora_learns.py [--lora-rank 8] [--lr 1e-2] [--steps 100] [--target 0.95] [overrides...]

Why: the same claim as ``rltpu train configs/quickstart.yaml trainer.lora.rank=8`` (tests/test_e2e_lora.py)
on a machine too loaded to start Ray. The pieces are the ones the CLI runs: the quickstart config, its
synthetic copy task and char tokenizer, ``SamplerEngine`` (the configured engine), ``partial_credit``,
``build_train_batch`` and one ``TrainerEngine`` (no FSDP: one trainer instead of 2, one sampler instead of
2). After every update the weights go to the sampler as the sync would: with LoRA the adapters only, after
one full sync. Prints one JSON line per step and a summary (first-5 / last-5 mean reward, adapter bytes per
sync, the sampler-vs-trainer probe gap).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lora-rank", type=int, default=8, help="0: full-parameter training")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    import jax.numpy as jnp
    import numpy as np
    import torch

    from learner.trainer import TrainerEngine
    from rltpu.config import load_config
    from rltpu.control.batch import build_train_batch, merge_generations, score, split_by_rank
    from rltpu.data.rewards import load_reward_fn
    from rltpu.data.sources import build_dataset, build_tokenizer
    from rltpu.models.spec import is_adapter
    from rltpu.sampling.engine import SamplerEngine
    from rltpu.sync.collective import adapter_spec, param_spec

    torch.set_num_threads(1)
    ov = list(args.overrides) + (["trainer.lora.rank=%d" % args.lora_rank] if args.lora_rank else [])
    ov += [f"trainer.lr={args.lr}"] if args.lr else []
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ov)
    tok = build_tokenizer(cfg)
    data = build_dataset(cfg, tok)
    reward_fn = load_reward_fn(cfg.task.reward_fn, cfg.task.reward_kwargs)
    V = tok.vocab_size
    spec = param_spec(cfg.model, V, cfg.trainer.lora)
    eng = TrainerEngine(cfg.model, cfg.trainer, V, cfg.seed, cfg.sampler.temperature)
    smp = SamplerEngine(cfg.model, cfg.sampler, V, tok.pad_id, tok.eos_id, {n: (s, d) for n, s, d in spec},
                        lora=cfg.trainer.lora)
    smp.precompile()
    compiles = smp.stats.compiles

    def sync(version: int, names) -> int:
        sd = eng.full_state_dict()
        arrays = {n: jnp.asarray(sd[n].numpy()) for n in names}
        (smp.set_adapters if version and cfg.trainer.lora else smp.set_params)(arrays, version)
        return sum(int(a.nbytes) for a in arrays.values())

    sync(0, [n for n, _, _ in spec])
    later = [n for n, _, _ in (adapter_spec(spec) if cfg.trainer.lora else spec)]
    rewards_hist, gaps, t0 = [], [], time.time()
    sync_bytes = 0
    for step in range(1, args.steps + 1):
        examples = data.next_batch(cfg.trainer.prompts_per_step)
        prompts = [data.encode(e, tok) for e in examples]
        out = smp.generate(prompts, cfg.sampler.group_size, cfg.seed * 1_000_003 + step * 131)
        gen = merge_generations([out], tok.pad_id)
        rewards, _ = score(gen, examples, cfg.sampler.group_size, tok, reward_fn)
        batch = build_train_batch(gen, rewards, cfg.sampler.group_size, cfg.trainer.scale_rewards)
        eng.train_step(split_by_rank(batch, 1)[0])
        sync_bytes = sync(step, later)
        rewards_hist.append(float(rewards.mean()))
        rec = {"step": step, "reward_mean": round(rewards_hist[-1], 4), "sync_bytes": sync_bytes,
               "wall_s": round(time.time() - t0, 1)}
        if step % 10 == 0:
            b = split_by_rank(batch, 1)[0]
            ids, pos, mask = b["tokens"][:4], b["position_ids"][:4], b["attention_mask"][:4]
            m = mask.astype(bool)
            gap = float(np.abs(smp.probe_logits(ids, pos, mask)[m] - eng.probe_logits(ids, pos, mask)[m]).max())
            gaps.append(gap)
            rec["probe_max_diff"] = gap
        print(json.dumps(rec), flush=True)
        if len(rewards_hist) >= 5 and sum(rewards_hist[-5:]) / 5 >= args.target:
            break
    full_bytes = sum(int(np.prod(s)) * 4 for n, s, _ in spec)
    print(json.dumps({"summary": True, "lora_rank": args.lora_rank, "lr": cfg.trainer.lr, "steps": len(rewards_hist),
                      "first5": round(sum(rewards_hist[:5]) / 5, 4), "last5": round(sum(rewards_hist[-5:]) / 5, 4),
                      "sync_bytes_per_step": sync_bytes, "full_spec_bytes": full_bytes,
                      "adapter_params": sum(int(np.prod(s)) for n, s, _ in spec if is_adapter(n)),
                      "probe_max_diff": max(gaps) if gaps else None,
                      "compiles_after_start": smp.stats.compiles - compiles, "wall_s": round(time.time() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
