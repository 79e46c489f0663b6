"""Triton kernels of the fused decode step (`Transformer.decode_step(fused=True)`), with their launchers.

Each kernel mirrors the PyTorch ops it replaces, including the intermediate roundings to the activation dtype
(RMSNorm rounds the normalized x before the weight multiply; RoPE runs in fp32; SiLU rounds before the product),
so the fused step stays within ~1 ulp of `Transformer.forward`. They run on CUDA, and on CPU tensors under
Triton's interpreter (TRITON_INTERPRET=1, tests). The model calls them; the rollout engine does not.

Here rather than in `kernels/`: that package holds the NVFP4 GEMM kernels behind `QuantLinear` (optional, loaded
lazily); these belong to the model's decode step and are small enough to read next to it.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor, nn

try:  # optional: the fused decode kernels (CUDA, or CPU under TRITON_INTERPRET=1 in tests)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - no triton, or a broken install
    triton = None


if triton is not None:

    @triton.jit
    def _add_rmsnorm_kernel(X, R, W, Y, N, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        """X[row] += R[row] (in place, rounded like a bf16 add), Y[row] = W * rmsnorm(X[row])."""
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        m = offs < N
        x = tl.load(X + row * N + offs, mask=m, other=0.0)
        if HAS_RES:
            r = tl.load(R + row * N + offs, mask=m, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            tl.store(X + row * N + offs, x, mask=m)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
        normed = (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + row * N + offs, (w * normed).to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def _rope_cache_kernel(Q, K, V, COS, SIN, QO, KC, VC, SLOT, QW, KW, eps, H, HKV, s_b, s_h, s_s, s_q, s_k, s_v,
                           D: tl.constexpr, HALF: tl.constexpr, QK_NORM: tl.constexpr):
        """Program (row, head): heads < H rotate q into QO; the rest rotate k and write k, v at cache slot SLOT.
        s_q, s_k, s_v: row strides of q, k, v (column slices of one fused qkv output)."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        offs = tl.arange(0, HALF)
        c1 = tl.load(COS + row * D + offs)
        c2 = tl.load(COS + row * D + HALF + offs)
        s1 = tl.load(SIN + row * D + offs)
        s2 = tl.load(SIN + row * D + HALF + offs)
        if head < H:
            src = Q + row * s_q + head * D
            NW = QW
        else:
            src = K + row * s_k + (head - H) * D
            NW = KW
        x1 = tl.load(src + offs)
        x2 = tl.load(src + HALF + offs)
        if QK_NORM:  # Qwen3: per-head RMSNorm before RoPE
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / D + eps)
            w1 = tl.load(NW + offs).to(tl.float32)
            w2 = tl.load(NW + HALF + offs).to(tl.float32)
            x1 = (w1 * (f1 * rstd).to(x1.dtype).to(tl.float32)).to(x1.dtype)
            x2 = (w2 * (f2 * rstd).to(x2.dtype).to(tl.float32)).to(x2.dtype)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        o1 = (f1 * c1 - f2 * s1).to(x1.dtype)
        o2 = (f2 * c2 + f1 * s2).to(x1.dtype)
        if head < H:
            q_out = QO + row * H * D + head * D
            tl.store(q_out + offs, o1)
            tl.store(q_out + HALF + offs, o2)
        else:
            kvh = head - H
            at = row.to(tl.int64) * s_b + kvh * s_h + tl.load(SLOT) * s_s  # int64: big caches pass 2**31 elements
            tl.store(KC + at + offs, o1.to(KC.dtype.element_ty))
            tl.store(KC + at + HALF + offs, o2.to(KC.dtype.element_ty))
            v_in = V + row * s_v + kvh * D
            tl.store(VC + at + offs, tl.load(v_in + offs).to(VC.dtype.element_ty))
            tl.store(VC + at + HALF + offs, tl.load(v_in + HALF + offs).to(VC.dtype.element_ty))

    @triton.jit
    def _silu_mul_kernel(G, U, O, n, s_g, s_u, BLOCK: tl.constexpr):
        """Program (row, block): O[row] = silu(G[row]) * U[row] over n columns; s_g, s_u: row strides of G and U
        (the two halves of one fused gate_up output), O contiguous."""
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        g = tl.load(G + row * s_g + offs, mask=m, other=0.0)
        u = tl.load(U + row * s_u + offs, mask=m, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        tl.store(O + row * n + offs, (act * u.to(tl.float32)).to(O.dtype.element_ty), mask=m)


def fused_add_rmsnorm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + residual, written into x; weight * rmsnorm(x + residual)) for contiguous [rows, N]."""
    rows, n = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    block = triton.next_power_of_2(n)
    _add_rmsnorm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, n, eps,
                                 HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 512)))
    return x, out


def fused_rope_cache(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, slot: Tensor, k_cache: Tensor,
                     v_cache: Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                     q_norm: nn.Module | None = None, k_norm: nn.Module | None = None) -> Tensor:
    """Rotated q [rows, H*D] (contiguous); rotated k and v written into rows :rows of the caches at slot `slot` [1].
    q, k, v may be column slices of one [rows, (H + 2 Hkv) D] projection (unit stride along a row)."""
    rows = q.shape[0]
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError(f"fused_rope_cache needs unit stride along a row, got strides {t.stride()}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    norm = q_norm is not None
    _rope_cache_kernel[(rows, num_heads + num_kv_heads)](
        q, k, v, cos, sin, out, k_cache, v_cache, slot, q_norm.weight if norm else q, k_norm.weight if norm else q,
        q_norm.eps if norm else 0.0, num_heads, num_kv_heads, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        q.stride(0), k.stride(0), v.stride(0), D=head_dim, HALF=head_dim // 2, QK_NORM=norm, num_warps=1)
    return out


def fused_silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up for [rows, n] inputs with unit stride along a row (e.g. the halves of one gate_up output);
    the result is contiguous."""
    for t in (gate, up):
        if t.dim() != 2 or t.stride(-1) != 1:
            raise ValueError(f"fused_silu_mul needs [rows, n] with unit stride along a row, got {tuple(t.shape)} "
                             f"strides {t.stride()}")
    rows, n = gate.shape
    out = torch.empty((rows, n), dtype=gate.dtype, device=gate.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate, up, out, n, gate.stride(0), up.stride(0), BLOCK=block,
                                                     num_warps=4)
    return out


def kernels_run_on(device: torch.device) -> bool:
    """Whether the kernels can run on tensors of `device`: Triton imported, and CUDA or the CPU interpreter."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1")
