"""MXFP4 weights (OCP Microscaling), byte-compatible with compressed-tensors' ``mxfp4-pack-quantized``.

A weight W [N, K] is stored as
  * ``weight_packed`` uint8 [N, K/2]: E2M1 codes packed as in :mod:`qerl.quant.nvfp4`;
  * ``weight_scale``  uint8 [N, K/32]: E8M0 block scale, i.e. the biased exponent e, scale = 2**(e-127).

Scale choice (compressed-tensors' ``generate_mx_scales``): the block amax is rounded to a power of two,
rounding *up* when its mantissa is >= 1.75 (so the block max lands at <= 7 before saturating to 6),
then e = exponent(amax) - 2 (E2M1's largest exponent), clamped to [0, 255].
Dividing by a power of two is exact, so codes do not depend on the dtype the division runs in.
"""

from __future__ import annotations

import torch

from qerl.quant.nvfp4 import decode_packed, e2m1_round, fill_rows, pack_e2m1

__all__ = ["BLOCK", "E8M0_BIAS", "check_shape", "quantize", "dequantize", "scale_exponents"]

BLOCK = 32
E8M0_BIAS = 127
_E2M1_EMAX = 2  # floor(log2(6))
_ROWS_PER_CHUNK_ELEMS = 1 << 24


def check_shape(n: int, k: int, name: str = "weight") -> None:
    """Raise ValueError naming the tensor when [n, k] cannot be stored as MXFP4 (K % 32 != 0)."""
    if k % BLOCK:
        raise ValueError(
            f"{name}: shape [{n}, {k}] cannot be MXFP4-quantized: in_features {k} is not a multiple "
            f"of the block size {BLOCK}"
        )


def scale_exponents(amax: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponents (uint8) for block absolute maxima (any float dtype, >= 0)."""
    bits = amax.float().view(torch.int32)
    # Add half of the second mantissa bit: carries into the exponent iff the mantissa is >= 1.75.
    exponent = ((bits + (1 << 21)) >> 23) & 0xFF  # biased fp32 exponent of the rounded amax
    # An amax that is zero or subnormal after rounding has no exponent (log2 -> -inf): clamps to 0.
    biased = torch.where(exponent == 0, 0, exponent - _E2M1_EMAX)
    return biased.clamp(0, 255).to(torch.uint8)


def _scale_values(exponents: torch.Tensor) -> torch.Tensor:
    ones = torch.ones(exponents.shape, dtype=torch.float32, device=exponents.device)
    return torch.ldexp(ones, exponents.to(torch.int32) - E8M0_BIAS)


def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantize a 2-D float weight [N, K] (K % 32 == 0) -> {"weight_packed", "weight_scale"}."""
    if w.ndim != 2 or not w.is_floating_point():
        raise ValueError(f"MXFP4 quantizes 2-D float weights, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    check_shape(n, k)
    w = w.detach()
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(n, k // BLOCK, dtype=torch.uint8, device=w.device)
    rows = max(1, _ROWS_PER_CHUNK_ELEMS // k)
    for r in range(0, n, rows):
        blocks = w[r : r + rows].float().unflatten(-1, (k // BLOCK, BLOCK))
        amax = blocks.abs().amax(-1)
        if not torch.isfinite(amax).all():
            row, blk = (~torch.isfinite(amax)).nonzero()[0].tolist()
            raise ValueError(f"weight of shape [{n}, {k}] has a NaN/Inf in row {r + row}, block {blk}")
        exponents = scale_exponents(amax)
        codes = e2m1_round(blocks / _scale_values(exponents).unsqueeze(-1)).flatten(-2)
        packed[r : r + rows] = pack_e2m1(codes)
        scales[r : r + rows] = exponents
    return {"weight_packed": packed, "weight_scale": scales}


def dequantize(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Reconstruct the [N, K] weight: e2m1(code) * 2**(e - 127), exact in fp32, cast to dtype."""
    if weight_packed.dtype != torch.uint8 or weight_packed.ndim != 2:
        raise ValueError(
            f"weight_packed must be 2-D uint8, got {weight_packed.dtype} {tuple(weight_packed.shape)}"
        )
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 2
    if tuple(weight_scale.shape) != (n, k // BLOCK) or weight_scale.dtype != torch.uint8:
        raise ValueError(
            f"weight_scale {weight_scale.dtype} {tuple(weight_scale.shape)} does not match weight_packed "
            f"{tuple(weight_packed.shape)}: expected uint8 ({n}, {k // BLOCK})"
        )
    def rows(start: int, stop: int) -> torch.Tensor:
        values = decode_packed(weight_packed[start:stop]).unflatten(-1, (k // BLOCK, BLOCK))
        return (values * _scale_values(weight_scale[start:stop]).unsqueeze(-1)).flatten(-2)

    return fill_rows(n, k, dtype, weight_packed.device, rows)
