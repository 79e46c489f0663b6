"""Attention itself: the one place that computes attention scores, for every path the model runs.

Two entries, as nanochat's `flash_attention.py` has one without a cache and one with (its `flash_attn_func` and
`flash_attn_with_kvcache`); both take q [B, H, T, D] (T query tokens per row, already rotated) and return the
heads merged, [B, T, H * D], the layout the output projection reads:

* `attend(q, k, v, mask)`: over the tokens' own keys and values, k and v [B, Hkv, T_k, D] (training, and the
  shared-prompt forward's prompt and completion parts). SDPA.
* `attend_cached(q, k_cache, v_cache, mask)`: over the first mask.shape[-1] slots of a cache that already holds the
  tokens' keys and values (written by `KVCache.update`/`StepCache.update` or by the fused RoPE + KV-write kernel):
  prefill, the plain decode step and the fused one, one query token per row or several (speculative decoding's
  verify step). SDPA with each kv head's query group folded into the query axis, or, with `split_kv` (the fused
  decode step), one split-KV Triton kernel (`fused_ops.decode_attention`): SDPA leaves most of the GPU idle at a
  few queries per row.

Only layouts change between the paths (views, no copies): the numbers are the ones each path computed before this
module existed, and `tests/test_architecture.py` keeps every other module from computing scores or calling SDPA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None = None,
           cpu_gqa: bool = False) -> Tensor:
    """Softmax attention of q [B, H, T, D] over k, v [B, Hkv, T_k, D] (H a multiple of Hkv, query head h reading
    kv head h // (H / Hkv)); mask [B|1, 1, T, T_k] boolean, True where a query may attend, or None: causal (T ==
    T_k). `scale`: the softmax scale, None = head_dim ** -0.5 (SDPA's own, not passed, so the families without
    one compute exactly as they always have). Returns [B, T, H * D].

    `cpu_gqa`: on the CPU, SDPA's own GQA instead of repeated keys and values: the same forward bits (torch 2.13),
    a third of the tensors saved for backward and half the time, but k's and v's gradients summed over a query
    group in another order. The shared-prompt forward takes it; the plain forward keeps its gradients' bits."""
    batch, heads, seq, _ = q.shape
    groups, options = heads // k.shape[1], {} if scale is None else {"scale": scale}
    if groups > 1 and cpu_gqa and q.device.type == "cpu":
        options["enable_gqa"] = True
    elif groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, **options)
    return out.transpose(1, 2).reshape(batch, seq, -1)


def attend_cached(q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor, scale: float | None = None,
                  split_kv: bool = False) -> Tensor:
    """Softmax attention of q [B, H, T, D] over the first S = mask.shape[-1] slots of caches [>= B, Hkv, >= S, D]
    that already hold these tokens' keys and values; returns [B, T, H * D]. `scale` as `attend`.

    SDPA (`split_kv` False): mask [B|1, 1, T, S] boolean, True where a query may attend; caches of exactly B rows
    and S slots (what `KVCache.update` and `StepCache.update` return). Each kv head's query group is folded into
    the query axis instead of copying the cache H / Hkv times.

    The split-KV kernel (`split_kv`, the fused decode step; CUDA, or the CPU under Triton's interpreter): mask [B,
    1, T, S] additive (0 or -inf, `additive_mask`: built once per step, not per layer), q a transposed view of a
    contiguous [B, T, H, D] (what the fused RoPE kernel returns), the caches in the rollout engine's layouts (bf16
    or FP8, `qerl.execution.kv8`), read in rows :B. Row b's T query tokens read cache row b, each with its own mask
    row (speculative decoding's verify step: T drafted tokens per row). Everything it launches depends only on
    shapes (a CUDA graph of it replays), and it allocates only its output and the splits' partials."""
    batch, heads, seq, dim = q.shape
    kv_heads = k_cache.shape[1]
    if split_kv:
        from qerl.execution import fused_ops  # lazy: Triton costs ~0.3 s to import, and only decoding needs it

        rows = batch * seq  # query rows r * T + t: token t of cache row r (views of the fused step's tensors)
        out = fused_ops.decode_attention(q.transpose(1, 2).reshape(rows, heads * dim), k_cache, v_cache,
                                         mask.reshape(rows, mask.shape[-1]), heads, kv_heads, dim,
                                         **({} if scale is None else {"scale": scale}), queries_per_row=seq)
        return out.view(batch, seq, heads * dim)
    groups, options = heads // kv_heads, {} if scale is None else {"scale": scale}
    q = q.reshape(batch, kv_heads, groups * seq, dim)
    out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask.repeat(1, 1, groups, 1), **options)
    out = out.reshape(batch, heads, seq, dim)  # GPU kernels return strided layouts
    return out.transpose(1, 2).reshape(batch, seq, -1)


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """The split-KV kernel's mask: 0 where `allowed` (boolean), -inf elsewhere, in `dtype`."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
