"""NVFP4 weights, byte-compatible with compressed-tensors' ``nvfp4-pack-quantized`` format.

A weight W [N, K] is stored as
  * ``weight_packed``       uint8 [N, K/2]: E2M1 codes (sign<<3 | magnitude index), two per byte,
                            even column in the low nibble;
  * ``weight_scale``        float8_e4m3fn [N, K/16]: one scale per block of 16 along K;
  * ``weight_global_scale`` float32 [1]: 448*6 / amax(|W|), so block scales use FP8's full range.

Dequantization: ``W ~= e2m1(code) * (weight_scale / weight_global_scale)`` with the division done
first, in fp32 (as compressed-tensors and vLLM do; multiplying by the global scale instead would round
differently). Quantization reproduces llm-compressor's min-max observer + compressed-tensors'
``calculate_qparams`` / ``quantize`` bit for bit, including which dtype each step rounds in.

This module is the single source of truth for the format: the quantizer, QuantLinear, the Triton
kernels' references and the tests all use it. Torch only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "BLOCK",
    "E2M1_VALUES",
    "FP4_MAX",
    "FP8_MAX",
    "e2m1_round",
    "pack_e2m1",
    "unpack_e2m1",
    "e2m1_decode",
    "decode_packed",
    "tensor_amax",
    "global_scale_for",
    "quantize",
    "dequantize",
    "check_shape",
    "fill_rows",
]

BLOCK = 16
FP4_MAX = 6.0
FP8_MAX = 448.0
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)

# The magnitude index is the number of rounding boundaries strictly below |x| (bucketize, the fastest
# exact formulation on CPU); boundaries where ties go up are nudged one fp32 ulp down to fit that.
_BOUNDARIES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_TIES_UP = torch.tensor([False, True, False, True, False, True, False])
_BOUNDARIES = torch.where(_TIES_UP, torch.nextafter(_BOUNDARIES, torch.zeros(())), _BOUNDARIES)
_SIGNED_VALUES = torch.cat([E2M1_VALUES, -E2M1_VALUES])  # indexed by the 4-bit code
# Decoding a whole byte at once via embedding(int32) avoids an int64 index per weight.
_BYTE_TO_PAIR = torch.stack([_SIGNED_VALUES[torch.arange(256) & 15], _SIGNED_VALUES[torch.arange(256) >> 4]], 1)
_ROWS_PER_CHUNK_ELEMS = 1 << 24  # bound fp32 temporaries (~64 MiB each) on 100M+ element weights


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round floats (already divided by their scale) to E2M1 codes, uint8 with values in [0, 16).

    Nearest value with ties to the even mantissa (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4,
    5->4) and saturation at 6: compressed-tensors' cast_to_fp4. The sign bit is set for every x < 0,
    including values that round to zero (code 8, "-0"), exactly as compressed-tensors packs them.
    """
    x = x.float()
    index = torch.bucketize(x.abs(), _BOUNDARIES.to(x.device), right=False).to(torch.uint8)
    return index | ((x < 0).to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes [..., K] (K even) two per byte -> [..., K/2], even column in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1 needs an even last dimension, got shape {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: uint8 [..., K/2] -> uint8 codes [..., K]."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_e2m1 expects uint8, got {packed.dtype}")
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes -> their fp32 values (code 8 decodes to -0.0)."""
    return _SIGNED_VALUES.to(codes.device)[codes.long()]


def decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 bytes [..., K/2] -> fp32 values [..., K] (same as e2m1_decode(unpack_e2m1(p)))."""
    pairs = torch.nn.functional.embedding(packed.to(torch.int32), _BYTE_TO_PAIR.to(packed.device))
    return pairs.flatten(-2)


def fill_rows(n: int, k: int, dtype: torch.dtype, device: torch.device, rows: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """An [n, k] tensor of `dtype` built from row ranges ``rows(start, stop)`` (fp32), so dequantizing a
    large weight never holds more than one chunk of fp32 temporaries next to the result."""
    out = torch.empty(n, k, dtype=dtype, device=device)
    step = max(1, _ROWS_PER_CHUNK_ELEMS // max(k, 1))
    for r in range(0, n, step):
        out[r : r + step] = rows(r, min(r + step, n))
    return out


def check_shape(n: int, k: int, name: str = "weight") -> None:
    """Raise ValueError naming the tensor when [n, k] cannot be stored as NVFP4 (K % 16 != 0)."""
    if k % BLOCK:
        raise ValueError(
            f"{name}: shape [{n}, {k}] cannot be NVFP4-quantized: in_features {k} is not a multiple "
            f"of the block size {BLOCK}"
        )


def _observer_dtype(w: torch.Tensor) -> torch.dtype:
    # llm-compressor observes min/max in the weight's dtype and compressed-tensors divides in it, so
    # bf16/fp32 weights round their global and block scales in bf16/fp32. fp16 would overflow
    # 448*6/amax for amax < 0.04, so fp16 (and anything else) is computed in fp32 instead.
    return w.dtype if w.dtype in (torch.bfloat16, torch.float32) else torch.float32


def tensor_amax(w: torch.Tensor) -> torch.Tensor:
    """max |w| in the dtype the global scale is computed in (see global_scale_for; shared scales use it)."""
    return w.detach().to(_observer_dtype(w)).abs().amax()


def global_scale_for(amax: torch.Tensor) -> torch.Tensor:
    """Per-tensor scale 448*6/amax (float32 [1]) from an absolute maximum, as compressed-tensors'
    ``generate_gparam``: the division runs in amax's dtype (bf16 amax -> bf16-rounded scale)."""
    amax = amax.reshape(1).clamp(min=torch.finfo(torch.float32).tiny)
    return (FP8_MAX * FP4_MAX / amax).to(torch.float32)


def quantize(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Quantize a 2-D weight [N, K] (K % 16 == 0) to NVFP4.

    Args:
        w: the weight, any float dtype; bf16 and fp32 round exactly as llm-compressor would.
        global_scale: optional float32 [1] to use instead of 448*6/amax(|w|), e.g. one scale shared
            by q/k/v or gate/up so that an inference engine can fuse them (vLLM requires it).

    Returns:
        ``{"weight_packed": uint8 [N, K/2], "weight_scale": float8_e4m3fn [N, K/16],
        "weight_global_scale": float32 [1]}``, all on w's device.
    """
    if w.ndim != 2:
        raise ValueError(f"NVFP4 quantizes 2-D weights, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise TypeError(f"NVFP4 quantizes float weights, got {w.dtype}")
    n, k = w.shape
    check_shape(n, k)
    w = w.detach().to(_observer_dtype(w))
    if global_scale is None:
        amax = w.abs().amax()
        if not torch.isfinite(amax):
            row, col = (~torch.isfinite(w)).nonzero()[0].tolist()
            raise ValueError(f"weight of shape [{n}, {k}] has a NaN/Inf at [{row}, {col}]")
        global_scale = global_scale_for(amax)
    # a private copy: layers sharing a scale must not share storage (safetensors refuses aliases)
    global_scale = global_scale.to(device=w.device, dtype=torch.float32).reshape(1).clone()
    if not torch.isfinite(global_scale).all() or global_scale.item() <= 0:
        raise ValueError(f"NVFP4 global scale must be finite and > 0, got {global_scale.item()}")

    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(n, k // BLOCK, dtype=torch.float8_e4m3fn, device=w.device)
    rows = max(1, _ROWS_PER_CHUNK_ELEMS // k)
    for r in range(0, n, rows):
        blocks = w[r : r + rows].unflatten(-1, (k // BLOCK, BLOCK))
        amax = blocks.abs().amax(-1)
        if not torch.isfinite(amax).all():
            row, blk = (~torch.isfinite(amax)).nonzero()[0].tolist()
            raise ValueError(f"weight of shape [{n}, {k}] has a NaN/Inf in row {r + row}, block {blk}")
        # Block scale: (amax / 6) rounded in the observer dtype, times the fp32 global scale,
        # saturated into e4m3; an all-zero block gets e4m3's eps 0.125 to keep the division finite.
        # (a 0-dim tensor divisor: CUDA turns division by a Python scalar into a reciprocal multiply)
        scale = (global_scale * (amax / amax.new_tensor(FP4_MAX))).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        scale = torch.where(scale.float() == 0, torch.full_like(scale, 0.125), scale)
        effective = scale.float() / global_scale  # the order compressed-tensors divides in
        codes = e2m1_round(blocks.float() / effective.unsqueeze(-1)).flatten(-2)
        packed[r : r + rows] = pack_e2m1(codes)
        scales[r : r + rows] = scale
    return {"weight_packed": packed, "weight_scale": scales, "weight_global_scale": global_scale}


def dequantize(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Reconstruct the [N, K] weight: e2m1(code) * (scale / global_scale), in fp32, cast to dtype."""
    if weight_packed.dtype != torch.uint8 or weight_packed.ndim != 2:
        raise ValueError(
            f"weight_packed must be 2-D uint8, got {weight_packed.dtype} {tuple(weight_packed.shape)}"
        )
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 2
    if tuple(weight_scale.shape) != (n, k // BLOCK):
        raise ValueError(
            f"weight_scale shape {tuple(weight_scale.shape)} does not match weight_packed "
            f"{tuple(weight_packed.shape)}: expected ({n}, {k // BLOCK})"
        )
    if weight_global_scale.numel() != 1:
        raise ValueError(f"weight_global_scale must hold one value, got {tuple(weight_global_scale.shape)}")
    effective = weight_scale.float() / weight_global_scale.float().reshape(())

    def rows(start: int, stop: int) -> torch.Tensor:
        values = decode_packed(weight_packed[start:stop]).unflatten(-1, (k // BLOCK, BLOCK))
        return (values * effective[start:stop].unsqueeze(-1)).flatten(-2)

    return fill_rows(n, k, dtype, weight_packed.device, rows)
