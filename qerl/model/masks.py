"""Positions and attention masks of a forward: left padding, causality over cache slots, sliding windows.

`qerl.model.transformer.Decoder.masks` builds every forward's from these (the plain one, the shared-prompt one of
`qerl.execution.shared_prompts`, the memory plan's), so all see the same positions and masks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def positions_and_mask(batch: int, seq: int, attention_mask: Tensor | None, position_ids: Tensor | None,
                       cache_position: Tensor | None, cache_len: int | None,
                       device: torch.device) -> tuple[Tensor, Tensor | None]:
    """Position ids [B, T] and a boolean attention mask [B|1, 1, T, S] (None = plain causal, no cache).
    `cache_position`: the slots the T tokens are written at, [T] for every row or [B, T] each row its own (several
    rows extended at once, each after its own tokens: `RolloutEngine.extend_rows`; position_ids must then be given)."""
    query_slots = cache_position if cache_position is not None else torch.arange(seq, device=device)
    if query_slots.dim() == 2 and position_ids is None:
        raise ValueError("cache_position [B, T] (each row at its own slots) needs position_ids")
    key_len = cache_len if cache_position is not None else seq
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch:
            raise ValueError(f"attention_mask must be [batch={batch}, T_total], got {tuple(attention_mask.shape)}")
        mask_len = attention_mask.shape[1]
        if (cache_position is None and mask_len != seq) or mask_len > key_len:
            raise ValueError(f"attention_mask length {mask_len} must be the input length {seq} without a cache, "
                             f"or at most the cache length {key_len} with one")
        valid = attention_mask.to(device=device, dtype=torch.bool)
    if position_ids is None:
        if attention_mask is not None:  # left padding: count real tokens so each row starts at position 0
            positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
            position_ids = positions[:, query_slots] if cache_position is not None else positions
        else:
            position_ids = query_slots[None].expand(batch, seq)
    if attention_mask is None and cache_position is None:
        return position_ids, None  # lets SDPA pick its causal (flash) kernel
    key_slots = torch.arange(key_len, device=device)
    queries = query_slots if query_slots.dim() == 2 else query_slots[None]  # [B|1, T]
    allowed = key_slots[None, None, :] <= queries[:, :, None]  # [B|1, T, S] causal over written slots
    if attention_mask is not None:
        if valid.shape[1] < key_len:  # slots past the mask are not written yet; causality already hides them
            valid = F.pad(valid, (0, key_len - valid.shape[1]), value=True)
        # Each query also sees itself, so padding rows never softmax over nothing (NaN); real rows are unaffected.
        allowed = (allowed & valid[:, None, :]) | (key_slots[None, None, :] == queries[:, :, None])
    return position_ids, allowed[:, None]


def sliding_mask(mask: Tensor | None, seq: int, cache_position: Tensor | None, key_len: int, window: int,
                 device: torch.device) -> Tensor:
    """`mask` (as `positions_and_mask` returns it; None = plain causal) narrowed, for sliding layers, to the last
    `window` key slots of each query, itself included: transformers' `kv_idx > q_idx - sliding_window`."""
    query_slots = cache_position if cache_position is not None else torch.arange(seq, device=device)
    queries = (query_slots if query_slots.dim() == 2 else query_slots[None])[:, None, :, None]  # [B|1, 1, T, 1]
    key_slots = torch.arange(key_len, device=device)
    if mask is None:
        mask = key_slots <= queries
    return mask & (key_slots > queries - window)
