"""NF4 weights as in QLoRA / bitsandbytes (NormalFloat-4 codes, absmax per 64, double-quantized absmax).

qerl's own serialization (no inference engine reads NF4 checkpoints in this layout). For W [N, K]:
  * ``weight_packed``        uint8 [N, K/2]: NF4 code indices, two per byte, even column in the low nibble
                             (as our E2M1 formats; bitsandbytes puts the first one in the high nibble);
  * ``weight_absmax_q``      int8 [N, K/64]: block absmax minus the mean absmax, linearly quantized
                             (symmetric, +-127) per group of 256 consecutive blocks in row-major order;
  * ``weight_absmax_scale``  float32 [ceil(N*K/64/256)]: the step of each group of 256;
  * ``weight_absmax_offset`` float32 [1]: the mean absmax.
  absmax = absmax_q * absmax_scale[group] + absmax_offset;  W ~= NF4[code] * absmax.

Unlike bitsandbytes, codes are chosen against the reconstructed (double-quantized) absmax, so the
rounding accounts for the scale the reader will actually use.
"""

from __future__ import annotations

import math

import torch

from qerl.quant.nvfp4 import fill_rows, pack_e2m1, unpack_e2m1

__all__ = ["BLOCK", "ABSMAX_GROUP", "NF4_VALUES", "check_shape", "tensor_shapes", "quantize", "dequantize"]

BLOCK = 64
ABSMAX_GROUP = 256
# The 16 NormalFloat-4 levels (bitsandbytes' table: quantiles of N(0, 1), rescaled to [-1, 1], exact 0).
NF4_VALUES = torch.tensor(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
     0.7229568362236023, 1.0],
    dtype=torch.float32,
)
_MIDPOINTS = (NF4_VALUES[1:] + NF4_VALUES[:-1]) / 2
_BYTE_TO_PAIR = torch.stack([NF4_VALUES[torch.arange(256) & 15], NF4_VALUES[torch.arange(256) >> 4]], 1)


def check_shape(n: int, k: int, name: str = "weight") -> None:
    """Raise ValueError naming the tensor when [n, k] cannot be stored as NF4 (K % 64 != 0)."""
    if k % BLOCK:
        raise ValueError(
            f"{name}: shape [{n}, {k}] cannot be NF4-quantized: in_features {k} is not a multiple "
            f"of the block size {BLOCK}"
        )


def tensor_shapes(n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each stored tensor for a [n, k] weight."""
    groups = math.ceil(n * (k // BLOCK) / ABSMAX_GROUP)
    return {
        "weight_packed": ((n, k // 2), torch.uint8),
        "weight_absmax_q": ((n, k // BLOCK), torch.int8),
        "weight_absmax_scale": ((groups,), torch.float32),
        "weight_absmax_offset": ((1,), torch.float32),
    }


def _grouped(x: torch.Tensor) -> torch.Tensor:
    """Flatten row-major and split into rows of ABSMAX_GROUP (zero-padded)."""
    flat = x.reshape(-1)
    pad = -flat.numel() % ABSMAX_GROUP
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, ABSMAX_GROUP)


def _absmax(absmax_q: torch.Tensor, absmax_scale: torch.Tensor, absmax_offset: torch.Tensor) -> torch.Tensor:
    grouped = _grouped(absmax_q.float()) * absmax_scale.unsqueeze(-1) + absmax_offset.float()
    return grouped.reshape(-1)[: absmax_q.numel()].view(absmax_q.shape)


def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantize a 2-D float weight [N, K] (K % 64 == 0) to NF4 with double-quantized absmax."""
    if w.ndim != 2 or not w.is_floating_point():
        raise ValueError(f"NF4 quantizes 2-D float weights, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    check_shape(n, k)
    blocks = w.detach().float().unflatten(-1, (k // BLOCK, BLOCK))
    absmax = blocks.abs().amax(-1)
    if not torch.isfinite(absmax).all():
        row, blk = (~torch.isfinite(absmax)).nonzero()[0].tolist()
        raise ValueError(f"weight of shape [{n}, {k}] has a NaN/Inf in row {row}, block {blk}")
    offset = absmax.double().mean().float().reshape(1)  # fp64 sum: same offset on CPU and GPU
    centered = _grouped(absmax - offset)
    step = centered.abs().amax(-1)
    step = step / step.new_tensor(127.0)  # tensor divisor: CUDA would multiply by a rounded 1/127
    step = torch.where(step > 0, step, torch.ones_like(step))
    absmax_q = (centered / step.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    absmax_q = absmax_q.reshape(-1)[: absmax.numel()].view(absmax.shape)
    used = _absmax(absmax_q, step, offset).clamp_min(torch.finfo(torch.float32).tiny)
    normalized = (blocks / used.unsqueeze(-1)).clamp(-1, 1)
    codes = torch.bucketize(normalized, _MIDPOINTS.to(w.device)).to(torch.uint8).flatten(-2)
    return {
        "weight_packed": pack_e2m1(codes),
        "weight_absmax_q": absmax_q,
        "weight_absmax_scale": step,
        "weight_absmax_offset": offset,
    }


def dequantize(
    weight_packed: torch.Tensor,
    weight_absmax_q: torch.Tensor,
    weight_absmax_scale: torch.Tensor,
    weight_absmax_offset: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Reconstruct the [N, K] weight: NF4[code] * absmax, in fp32, cast to dtype."""
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 2
    expected = tensor_shapes(n, k)
    given = {"weight_packed": weight_packed, "weight_absmax_q": weight_absmax_q,
             "weight_absmax_scale": weight_absmax_scale, "weight_absmax_offset": weight_absmax_offset}
    for name, (shape, dt) in expected.items():
        t = given[name]
        if tuple(t.shape) != shape or t.dtype != dt:
            raise ValueError(f"{name}: got {t.dtype} {tuple(t.shape)}, expected {dt} {shape} for an [{n}, {k}] weight")
    absmax = _absmax(weight_absmax_q, weight_absmax_scale, weight_absmax_offset)
    table = _BYTE_TO_PAIR.to(weight_packed.device)

    def rows(start: int, stop: int) -> torch.Tensor:
        pairs = torch.nn.functional.embedding(weight_packed[start:stop].to(torch.int32), table)
        return (pairs.flatten(-2).unflatten(-1, (k // BLOCK, BLOCK)) * absmax[start:stop].unsqueeze(-1)).flatten(-2)

    return fill_rows(n, k, dtype, weight_packed.device, rows)


def nf4_codes(packed: torch.Tensor) -> torch.Tensor:
    """NF4 code indices [..., K] of packed bytes [..., K/2] (for inspection and tests)."""
    return unpack_e2m1(packed)
