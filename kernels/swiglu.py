"""SiLU(gate) · up of a fused gate/up projection output, forward and backward, reading the fused tensor in place.

The update computes gate and up as one GEMM ([tokens, 2I], gate columns first: `qerl.execution.fusion`). Liger-kernel's
SwiGLU takes the two halves as separate contiguous tensors, so each forward copied both halves out of the fused
output (2 × [tokens, I] read and written) and kept the copies for backward, and autograd's split backward then
concatenated the two halves' gradients into a [tokens, 2I] tensor again. These kernels read the halves where they
lie (row stride 2I) and write the gradient straight into the fused layout: what remains is one read of gate and
up and one write of the product forward, and one read of them, of the output's gradient and one write of the
fused gradient backward.

The roundings are Liger's (and eager PyTorch's): SiLU in fp32 rounded to the activation dtype, then times up in
that dtype; backward in fp32 from the recomputed sigmoid, each gradient rounded once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _forward_kernel(gu_ptr, out_ptr, I, stride_gu, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    up = tl.load(gu_ptr + row * stride_gu + I + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(up.dtype)
    tl.store(out_ptr + row * stride_out + cols, silu * up, mask=mask)


@triton.jit
def _backward_kernel(grad_ptr, gu_ptr, dgu_ptr, I, stride_grad, stride_gu, stride_dgu, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    grad = tl.load(grad_ptr + row * stride_grad + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + I + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    d_gate = grad * (silu * (1.0 - sig) + sig) * up  # Liger's order of products
    d_up = grad * silu
    out = dgu_ptr + row * stride_dgu
    tl.store(out + cols, d_gate.to(dgu_ptr.dtype.element_ty), mask=mask)
    tl.store(out + I + cols, d_up.to(dgu_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, width] with unit stride along the width (a copy only if it has none)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def forward(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[..., :I]) * gate_up[..., I:] as [..., I]."""
    gu = _rows(gate_up)
    inter = gu.shape[1] // 2
    out = torch.empty(gu.shape[0], inter, dtype=gu.dtype, device=gu.device)
    if gu.shape[0]:
        _forward_kernel[(gu.shape[0], triton.cdiv(inter, BLOCK))](gu, out, inter, gu.stride(0), out.stride(0),
                                                                 BLOCK=BLOCK, num_warps=4)
    return out.view(*gate_up.shape[:-1], inter)


def backward(grad: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """The gradient of `forward` with respect to gate_up, [..., 2I] in gate_up's layout (gate columns first)."""
    gu, dout = _rows(gate_up), _rows(grad)
    inter = gu.shape[1] // 2
    dgu = torch.empty(gu.shape, dtype=gu.dtype, device=gu.device)
    if gu.shape[0]:
        _backward_kernel[(gu.shape[0], triton.cdiv(inter, BLOCK))](dout, gu, dgu, inter, dout.stride(0),
                                                                  gu.stride(0), dgu.stride(0), BLOCK=BLOCK,
                                                                  num_warps=4)
    return dgu.view(gate_up.shape)


class SiluMulFused(torch.autograd.Function):
    """Autograd of `forward`: saves gate_up itself (Liger saved its copies of the two halves: the same bytes)."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        return forward(gate_up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        return backward(grad, gate_up)
