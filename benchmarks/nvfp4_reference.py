"""NVFP4's reference rounding, written from the format's definition and independent of qerl's codec.

Per tensor: a float32 global scale g = 448 * 6 / amax(|W|) (compressed-tensors' ``generate_gparam``: FP8 E4M3's
largest value times E2M1's). Per block of 16 along K: the block scale s = E4M3(amax_block / 6 * g), round to nearest
even, saturated at 448; an all-zero block gets E4M3's eps 0.125 (compressed-tensors' guard against dividing by 0).
The block's values are divided by s / g and rounded to nearest, ties to even, onto E2M1's grid
{0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturated at 6.

Everything is computed in float64 from the weight's own values (no intermediate bf16 or fp32 rounding), so the only
roundings are the format's own: the global scale to fp32, the block scale to E4M3 and the element to E2M1. That is
the point of having it next to qerl's codec, which reproduces compressed-tensors' arithmetic (which rounds
intermediate values in the weight's dtype): any difference between the two is an arithmetic-order difference, not
a different format.
"""

from __future__ import annotations

import torch

BLOCK = 16
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def round_to_e2m1_index(x: torch.Tensor) -> torch.Tensor:
    """Magnitude indices 0..7 of |x| rounded to nearest on E2M1's grid, ties to the even mantissa, saturating at 6.

    Tie points: 0.25 (0 | 0.5), 0.75 (0.5 | 1), 1.25 (1 | 1.5), 1.75 (1.5 | 2), 2.5 (2 | 3), 3.5 (3 | 4),
    5 (4 | 6). "Even" is the value whose mantissa bit is 0: 0, 1, 2, 4 (indices 0, 2, 4, 6).
    """
    a = x.abs().double().clamp(max=6.0)
    grid = E2M1_GRID.to(a.device)
    distance = (a.unsqueeze(-1) - grid).abs()
    best = distance.min(-1, keepdim=True).values
    candidates = distance == best  # one, or two at a tie
    # among tied candidates prefer the even index (mantissa 0): weight even indices first
    preference = torch.where(torch.arange(8, device=a.device) % 2 == 0, 2, 1)
    return (candidates * preference * 16 - torch.arange(8, device=a.device)).argmax(-1)


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Non-negative float64 values rounded once to FP8 E4M3 (nearest, ties to even, saturating at 448), as
    float8_e4m3fn. Done by hand because torch casts float64 to float8 through float32: two roundings, which can
    turn a value just above a tie into the tie and then round it the wrong way."""
    x = x.double().clamp(min=0.0, max=448.0)
    # E4M3: 3 mantissa bits, smallest normal exponent -6; below it subnormals share the step 2**-9
    exponent = torch.floor(torch.log2(x.clamp(min=2.0**-6))).clamp(min=-6)
    step = torch.exp2(exponent - 3)
    rounded = torch.round(x / step) * step  # torch.round: half to even; x / step is exact (a power of two)
    return rounded.clamp(max=448.0).to(torch.float8_e4m3fn)  # exact: already an E4M3 value


def global_scale(w: torch.Tensor) -> torch.Tensor:
    """float32 [1]: 448 * 6 / amax(|W|), computed in float64 and rounded once to fp32."""
    amax = w.detach().double().abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
    return (448.0 * 6.0 / amax).float().reshape(1)


def quantize(w: torch.Tensor, g: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """W [N, K] -> {"codes": uint8 [N, K] (sign << 3 | magnitude index), "scale": float8_e4m3fn [N, K/16],
    "global_scale": float32 [1]}: the format's reference rounding (module docstring)."""
    n, k = w.shape
    g = global_scale(w) if g is None else g.float().reshape(1)
    blocks = w.detach().double().unflatten(-1, (k // BLOCK, BLOCK))
    raw = blocks.abs().amax(-1) / 6.0 * g.double()
    scale = round_to_e4m3(raw)
    scale = torch.where(scale.double() == 0, torch.full_like(scale, 0.125), scale)
    effective = scale.double() / g.double()
    scaled = blocks / effective.unsqueeze(-1)
    codes = round_to_e2m1_index(scaled).to(torch.uint8) | ((scaled < 0).to(torch.uint8) << 3)
    return {"codes": codes.flatten(-2), "scale": scale, "global_scale": g}


def dequantize(q: dict[str, torch.Tensor]) -> torch.Tensor:
    """The reference's reconstruction in float64: E2M1(code) * (scale / global_scale)."""
    codes = q["codes"].long()
    values = E2M1_GRID.to(codes.device)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()
    effective = q["scale"].double() / q["global_scale"].double()
    n, k = codes.shape
    return (values.unflatten(-1, (k // BLOCK, BLOCK)) * effective.unsqueeze(-1)).flatten(-2)
