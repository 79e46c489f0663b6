"""The optimizer of the LoRA parameters and its learning-rate schedule (`optim.*` settings)."""
from __future__ import annotations

import math

import torch
from torch import nn

from qerl.config import OptimSettings


def lr_lambda(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to `min_ratio` (or constant)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(params: list[nn.Parameter], o: OptimSettings,
                    total_steps: int) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `params` and its schedule over `total_steps` updates (stepped once per update)."""
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: lr_lambda(i, o.warmup_steps, total_steps, o.schedule, o.min_lr_ratio))
    return optimizer, scheduler
