"""`generate`: batched sampling from a model with the reference configuration of the one sampler.

The rollout engine with CUDA graphs, fused kernels and bucketed shapes off (`RolloutEngine.reference`): a plain loop
over `Transformer.forward` with a static KV cache, one prefill per distinct prompt, then one token per step for every
row until all rows stop, on any device. Alongside the tokens it returns the sampling policy's log-probability of each
sampled token, log_softmax(logits / temperature) before top-k/top-p truncation: the quantity the trainer recomputes
for importance ratios. Its KV cache lives for the call only (the memory goes back to the training step).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from qerl.rollout.engine import RolloutEngine
from qerl.rollout.sampling import Rollout

__all__ = ["generate"]


def generate(model: Any, tokenizer: Any, prompts: list[str] | list[list[int]], max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, stop_strings: Sequence[str] = (),
             eos_token_ids: Sequence[int] | None = None, seed: int | None = None,
             generator: torch.Generator | None = None, progress: bool = False,
             row_seeds: Sequence[int] | None = None) -> Rollout:
    """Sample up to `max_new_tokens` per prompt (greedy when temperature == 0): `RolloutEngine.generate` (which
    documents the arguments) on a reference engine made for this call and freed after it."""
    engine = RolloutEngine.reference(model)
    try:
        return engine.generate(tokenizer, prompts, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                               stop_strings=stop_strings, eos_token_ids=eos_token_ids, seed=seed, generator=generator,
                               progress=progress, row_seeds=row_seeds)
    finally:
        engine.free()
