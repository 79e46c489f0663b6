"""The FP8 KV cache layout (rollout.kv_cache_dtype: fp8): what the engine's caches hold and its kernels read.

Each (row, kv head, slot) vector of head_dim keys or values is stored as head_dim E4M3 codes scaled by the vector's
own max |x| / 448, then that scale as fp32, then zeros up to 16 bytes: uint8 [rows, kv_heads, slots, head_dim + 16].
One tensor holds codes and scales, so whatever moves cache rows (the engine's compaction, a prompt's KV spread to
its group's rows, zeroing on wake) moves both without knowing the format.

Why a scale per vector: keys after RoPE carry outlier channels (Qwen2's k_proj biases) that a per-tensor scale of 1
(vLLM's default) would saturate; per vector, every key and value keeps E4M3's relative precision (3 mantissa bits).
The scale costs 4 of 144 bytes and the padding 12 (rows on 16-byte boundaries keep the kernels' loads vectorized):
0.56x the bytes of a bf16 cache. `pack` and `unpack` are the reference (prefill, tests); the decode kernels
(`qerl.execution.fused_ops`: RoPE + cache write, attention) read and write the same bytes.
"""
from __future__ import annotations

import torch
from torch import Tensor

FP8_MAX = 448.0  # the largest finite E4M3 value
PAD = 16  # bytes after the codes: the fp32 scale, then zeros


def packed_dim(head_dim: int) -> int:
    """The last dimension of a packed cache (bytes per vector)."""
    return head_dim + PAD


def is_packed(cache: Tensor) -> bool:
    return cache.dtype == torch.uint8


def pack(x: Tensor) -> Tensor:
    """x [..., D] (any float dtype) -> uint8 [..., D + 16]: codes = x / s in E4M3 (round to nearest even), s =
    max |x| / 448 in fp32 (0 for a zero vector, whose codes are 0)."""
    d = x.shape[-1]
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / FP8_MAX
    codes = torch.where(scale > 0, xf / scale, 0.0).to(torch.float8_e4m3fn)
    out = torch.zeros(*x.shape[:-1], d + PAD, dtype=torch.uint8, device=x.device)
    out[..., :d] = codes.view(torch.uint8)
    out[..., d:d + 4] = scale.view(torch.uint8)
    return out


def unpack(packed: Tensor, dtype: torch.dtype) -> Tensor:
    """uint8 [..., D + 16] -> [..., D] in `dtype`: codes times their vector's scale."""
    d = packed.shape[-1] - PAD
    codes = packed[..., :d].contiguous().view(torch.float8_e4m3fn)
    scale = packed[..., d:d + 4].contiguous().view(torch.float32)
    return (codes.float() * scale).to(dtype)
