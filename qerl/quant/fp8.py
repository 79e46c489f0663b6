"""The FP8 update for bf16 bases: a frozen `nn.Linear`'s forward and dx GEMMs on FP8 tensor cores.

Inside `qerl.execution.update_precision(model, "fp8")` (`model.base_gemm: fp8`: the FP8 phase of the model's
`qerl.kernels.context.GemmContext`, which `qerl.execution` hands each frozen linear as `gemm_context`), the frozen bf16
weight W [N, K] is quantized per call to E4M3, one scale per row of what the GEMM reads (W's rows n for y = x Wᵀ,
Wᵀ's rows k for dx = dy W: `torch._scaled_mm` scales only along the dimensions it does not contract), activations
and gradients per row, and the product runs through `torch._scaled_mm`. Nothing is kept between calls but the two
scale vectors (W is frozen, so they are computed once): memory as the bf16 update, plus one FP8 copy of the largest weight in
flight; or, inside the context's `held_weights` (the update, when memory allows), both FP8 copies of each weight
kept through the update. Quantizing W reads 2 and writes 1 byte per weight, ~15% of the FP8 GEMM's time at a 7B's
training sizes.
NVFP4 layers have their own path (qerl.kernels.gemm: dequantized straight into FP8); this one is for plain linears.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["frozen_linear"]

FP8_MAX = 448.0  # the largest finite E4M3 value


def _applies(linear: nn.Module, x: Tensor) -> bool:
    context = getattr(linear, "gemm_context", None)  # qerl.execution hands the model's to its frozen linears
    if not (context is not None and context.precision == "fp8" and type(linear) is nn.Linear and x.is_cuda
            and x.dtype == torch.bfloat16):
        return False
    w = linear.weight
    # _scaled_mm: both weight dimensions multiples of 16, a frozen weight (no weight gradient to compute).
    return not w.requires_grad and w.dtype == torch.bfloat16 and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0


def frozen_linear(linear: nn.Module, x: Tensor) -> Tensor:
    """`linear(x)`, in FP8 where the FP8 update is on and `linear` is a frozen bf16 `nn.Linear` on CUDA."""
    if not _applies(linear, x):
        return linear(x)
    shape = x.shape
    y = _FP8Linear.apply(x.reshape(-1, shape[-1]), linear.weight, _scales(linear), linear.gemm_context)
    y = y.view(*shape[:-1], y.shape[-1])
    return y if linear.bias is None else y + linear.bias


def _scales(linear: nn.Linear) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(per-row scale of W and its inverse, per-column scale and its inverse), computed once per weight."""
    w = linear.weight
    cached = getattr(linear, "_qerl_fp8_scales", None)
    if cached is None or cached[0] != w.data_ptr():
        with torch.no_grad():
            a = w.abs()
            rows = a.amax(1).float().clamp_min(1e-30) / FP8_MAX
            cols = a.amax(0).float().clamp_min(1e-30) / FP8_MAX
        cached = (w.data_ptr(), (rows, 1.0 / rows, cols, 1.0 / cols))
        linear._qerl_fp8_scales = cached
    return cached[1]


def _weight_fp8(w: Tensor, inv: Tensor, transposed: bool) -> Tensor:
    """The reference: W (or Wᵀ) scaled per row of the result, in E4M3, contiguous."""
    x = w.t() if transposed else w
    return (x.float() * inv[:, None]).to(torch.float8_e4m3fn).contiguous()


def weight_fp8(w: Tensor, inv: Tensor, transposed: bool, context) -> Tensor:
    """`_weight_fp8` in one Triton kernel on CUDA (kernels/fp8_rows.py): one read of W, one (transposing) write,
    into `context`'s scratch; inside its `held_weights` (the update, when memory allows) made once per weight and
    direction."""
    if not w.is_cuda:
        return _weight_fp8(w, inv, transposed)
    from qerl.kernels.fp8_rows import weight_fp8 as triton_weight

    return context.weight_copy(w, ("fp8", transposed), w.numel(), torch.float8_e4m3fn, w.device,
                               lambda flat: triton_weight(w.contiguous(), inv, transposed, out=flat))


def _product(a: Tensor, w8: Tensor, w_scale: Tensor) -> Tensor:
    """a [M, C] @ w8ᵀ with w8 [D, C] in E4M3 scaled per row by w_scale [D]: [M, D] in a's dtype."""
    from qerl.kernels.gemm import fp8_rows

    aq, s_a = fp8_rows(a)
    return torch._scaled_mm(aq, w8.t(), scale_a=s_a, scale_b=w_scale[None, :], out_dtype=a.dtype)[:a.shape[0]]


class _FP8Linear(torch.autograd.Function):
    """y = x Wᵀ with W frozen: the gradient goes to x only, nothing of W is saved."""

    @staticmethod
    def forward(ctx, x2: Tensor, w: Tensor, scales: tuple[Tensor, ...], context) -> Tensor:
        s_n, inv_n, s_k, inv_k = scales
        ctx.save_for_backward(w)  # the frozen parameter itself (no copy)
        ctx.scales, ctx.context = (s_k, inv_k), context
        return _product(x2, weight_fp8(w, inv_n, False, context), s_n)

    @staticmethod
    def backward(ctx, dy2: Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        (w,), (s_k, inv_k) = ctx.saved_tensors, ctx.scales
        return _product(dy2.contiguous(), weight_fp8(w, inv_k, True, ctx.context), s_k), None, None, None
