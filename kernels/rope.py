"""Rotary position embedding (Hugging Face's rotate-half convention) forward and backward, one launch each.

out = x·cos + rotate_half(x)·sin in fp32, rounded once to x's dtype, for x [B, H, T, D] in any strides (the update's
q and k are transposed views of the projections) and fp32 tables [B|1, 1, T, D]. One program per (b, t) loads the
position's cos and sin once and rotates every head. This replaces `torch.compile` of the eager expression in the
update: the same one fused kernel per direction, without Dynamo's guards on each of the update's ~1,800 calls (the
update is bound by its launch rate) or inductor's compilation in every new process (the first step's cost).

Backward: rotate_half's transpose. With x = (x1, x2) halves and tables (c1, c2), (s1, s2):
out1 = x1·c1 − x2·s1, out2 = x2·c2 + x1·s2, so dx1 = g1·c1 + g2·s2 and dx2 = g2·c2 − g1·s1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, T,
                 sxb, sxh, sxt, scb, sct, sob, soh, sot,
                 HALF: tl.constexpr, BACKWARD: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // T
    t = pid % T
    d = tl.arange(0, HALF)
    table = b.to(tl.int64) * scb + t.to(tl.int64) * sct
    c1 = tl.load(cos_ptr + table + d)
    c2 = tl.load(cos_ptr + table + HALF + d)
    s1 = tl.load(sin_ptr + table + d)
    s2 = tl.load(sin_ptr + table + HALF + d)
    x_row = x_ptr + b.to(tl.int64) * sxb + t.to(tl.int64) * sxt
    o_row = out_ptr + b.to(tl.int64) * sob + t.to(tl.int64) * sot
    for h in range(H):
        x1 = tl.load(x_row + h * sxh + d).to(tl.float32)
        x2 = tl.load(x_row + h * sxh + HALF + d).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        tl.store(o_row + h * soh + d, y1.to(out_ptr.dtype.element_ty))
        tl.store(o_row + h * soh + HALF + d, y2.to(out_ptr.dtype.element_ty))


def supports(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Shapes the kernel takes: x [B, H, T, D] with unit stride along D, D/2 a power of two; tables [B|1, 1, T, D]."""
    if x.dim() != 4 or cos.dim() != 4 or x.stride(-1) != 1:
        return False
    batch, _, seq, dim = x.shape
    half = dim // 2
    return (dim % 2 == 0 and half & (half - 1) == 0 and cos.shape[1] == 1 and cos.shape[2] == seq
            and cos.shape[3] == dim and cos.shape[0] in (1, batch))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    batch, heads, seq, dim = x.shape
    # The output in [B, T, H, D] memory, viewed as [B, H, T, D]: the layout the projections' views already have.
    out = torch.empty(batch, seq, heads, dim, dtype=x.dtype, device=x.device).transpose(1, 2)
    if cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):  # the model's are both
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
    table_b = 0 if cos.shape[0] == 1 else cos.stride(0)
    if batch * seq:
        _rope_kernel[(batch * seq,)](x, cos, sin, out, heads, seq, x.stride(0), x.stride(1), x.stride(2),
                                     table_b, cos.stride(2), out.stride(0), out.stride(1), out.stride(2),
                                     HALF=dim // 2, BACKWARD=backward, num_warps=1 if dim <= 128 else 2)
    return out


class Rope(torch.autograd.Function):
    """Autograd of the rotation: saves only the tables (the gradient of the tables is not needed: fixed positions)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        return _rotate(grad, cos, sin, backward=True), None, None
