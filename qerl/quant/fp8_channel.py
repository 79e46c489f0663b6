"""FP8 weights: E4M3 codes with one FP32 scale per output channel (quant.scheme: fp8).

Layout (compressed-tensors' "float-quantized" format with `strategy: channel`, the weights of its FP8_DYNAMIC
preset, which vLLM runs as W8A8 with per-token activation scales and transformers decompresses):
  * ``weight`` float8_e4m3fn [N, K]: round-to-nearest-even of W / scale, saturated to +-448;
  * ``weight_scale`` float32 [N, 1]: max |W[n, :]| / 448, so each row's largest weight lands on E4M3's largest.
Dequantized: ``weight.float() * weight_scale``.

The scale is computed and stored in FP32 from the exact row maximum, whatever the weight's dtype: llm-compressor
observes in the weight's dtype (a bf16 model gets bf16 scales, and its division W / scale rounds to bf16 before the
cast to E4M3: a second rounding); FP32 keeps the one rounding, and is the dtype the GEMM's scales are in
(torch._scaled_mm, vLLM's loader casts whatever it reads to FP32). For an FP32 weight the bytes are
compressed-tensors' own, bit for bit (tests/test_quant_fp8.py).
"""

from __future__ import annotations

import torch

__all__ = ["FP8_MAX", "quantize", "dequantize", "tensor_shapes"]

FP8_MAX = 448.0  # the largest finite E4M3 value
# compressed-tensors replaces a zero scale (an all-zero row) by its dtype's epsilon, so dividing by it is defined
_ZERO_ROW_SCALE = torch.finfo(torch.float32).eps
_ROWS_PER_CHUNK_ELEMS = 1 << 24  # bound fp32 temporaries (~64 MiB) on 100M+ element weights


def tensor_shapes(n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {"weight": ((n, k), torch.float8_e4m3fn), "weight_scale": ((n, 1), torch.float32)}


def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Dense [N, K] float weight -> {"weight": E4M3 [N, K], "weight_scale": fp32 [N, 1]}."""
    if w.ndim != 2 or not w.is_floating_point():
        raise ValueError(f"fp8 quantizes 2-D float weights, got {w.dtype} {tuple(w.shape)}")
    w = w.detach()
    scale = w.abs().amax(1, keepdim=True).float() / FP8_MAX  # the max of a bf16/fp16 row is exact in fp32
    scale = torch.where(scale == 0, torch.full_like(scale, _ZERO_ROW_SCALE), scale)
    codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    step = max(1, _ROWS_PER_CHUNK_ELEMS // max(w.shape[1], 1))
    for r in range(0, w.shape[0], step):
        # + 0: -0 becomes +0, as compressed-tensors' zero-point add makes it (the same bytes, not just values).
        # Clamped before the cast: anything beyond 448 casts to NaN in e4m3fn (no infinities), never saturates.
        codes[r:r + step] = (w[r:r + step].float() / scale[r:r + step]).add_(0.0).clamp_(-FP8_MAX, FP8_MAX)
    return {"weight": codes, "weight_scale": scale}


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """E4M3 codes [N, K] times their row scales [N, 1] (fp32 product, one rounding to `dtype`)."""
    if weight.dtype != torch.float8_e4m3fn or weight.ndim != 2:
        raise ValueError(f"fp8 weight: got {weight.dtype} {tuple(weight.shape)}, expected torch.float8_e4m3fn [N, K]")
    n, k = weight.shape
    if weight_scale.numel() != n:
        raise ValueError(f"fp8 weight_scale: got {tuple(weight_scale.shape)}, expected ({n}, 1)")
    scale = weight_scale.reshape(n, 1).float()
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    step = max(1, _ROWS_PER_CHUNK_ELEMS // max(k, 1))
    for r in range(0, n, step):
        out[r:r + step] = weight[r:r + step].float() * scale[r:r + step]
    return out
