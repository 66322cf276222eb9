"""AdamW with linear warm-up then constant LR (what short RL runs use)."""

from __future__ import annotations

import torch


def build_optimizer(model: torch.nn.Module, cfg) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    # only what trains: a frozen base (LoRA) gets no AdamW state
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, foreach=False
    )
    warmup = max(cfg.warmup_steps, 0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
    return opt, sched
