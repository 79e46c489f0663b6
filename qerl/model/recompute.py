"""The update's memory plan: how many decoder blocks recompute their forward in backward (only as many as memory
needs), and how much memory is left beside the kept activations.

Activation checkpointing trades a third more GEMM work for memory. A 7B NVFP4 update with every block checkpointed
peaks at ~14 GiB on a 141 GiB H200, so it pays the recomputation for nothing; a 32B update on an 80 GB card needs
most blocks checkpointed. `model.gradient_checkpointing: auto` plans per update: it measures what one block keeps
for backward on this update's micro-batch (the allocator's growth over one block's forward: its saved tensors and
output, whatever kernels and adapters run) and keeps as many blocks' activations as the free memory holds beside
a margin for the backward's transients and the LM head; the first blocks recompute, the rest keep theirs.
`true` / `false` force all / none. Off CUDA, `auto` recomputes nothing (host memory is not the limit there).

What is left after the kept activations and the margin (`MemoryPlan.spare_bytes`) is the update's to use for
speed second: the trainer keeps dequantized base weights in it (`model.keep_dequantized`), never at the cost of a
kept activation (recomputing a block costs more than dequantizing its weights again).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

GIB = 2**30


@dataclass(frozen=True)
class MemoryPlan:
    recomputed_blocks: int  # the first blocks recompute their forward in backward
    spare_bytes: int  # free device memory beyond the kept activations and the margin (0 off CUDA, or all recomputed)


def block_activation_bytes(decoder: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> int:
    """Bytes one block keeps alive for backward (saved tensors + its output) on this micro-batch, measured."""
    batch, seq = input_ids.shape
    was_training = decoder.training
    decoder.train()
    try:
        with torch.enable_grad():
            block = decoder.layers[0]
            position_ids, masks = decoder.masks(batch, seq, attention_mask, device=input_ids.device)
            cos, sin = decoder.rope_tables(position_ids)[block.sliding]
            x = decoder.embed_tokens(input_ids)
            before = torch.cuda.memory_allocated(input_ids.device)
            out = block(x, cos[:, None], sin[:, None], masks[block.sliding])
            kept = torch.cuda.memory_allocated(input_ids.device) - before
            del out
    finally:
        decoder.train(was_training)
    return kept


def plan(decoder: nn.Module, input_ids: Tensor, attention_mask: Tensor, setting: bool | str,
         margin_bytes: int | None = None) -> MemoryPlan:
    """This update's plan for `model.gradient_checkpointing` (`setting`) on this micro-batch shape."""
    layers = len(decoder.layers)
    if input_ids.device.type != "cuda" or setting is True:  # all recomputed: a run that asked for memory first
        return MemoryPlan(layers if setting is True else 0, 0)  # spends none on speed (nothing measured)
    per_block = block_activation_bytes(decoder, input_ids, attention_mask)
    free, total = torch.cuda.mem_get_info(input_ids.device)
    free += torch.cuda.memory_reserved(input_ids.device) - torch.cuda.memory_allocated(input_ids.device)
    # Beside the kept activations, backward holds a block's recomputed activations and its gradients, and the LM
    # head's chunked log-probs: a few blocks' worth, plus a slice of the card against fragmentation.
    margin = margin_bytes if margin_bytes is not None else 3 * per_block + int(0.08 * total) + GIB
    if setting is False:
        recomputed = 0
    else:
        recomputed = max(0, layers - max(0, math.floor((free - margin) / max(per_block, 1))))
    return MemoryPlan(recomputed, max(0, free - margin - (layers - recomputed) * per_block))
