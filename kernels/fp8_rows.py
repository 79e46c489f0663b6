"""Per-row FP8 (E4M3) quantization of activations and gradients for the FP8 update's `torch._scaled_mm`.

q = x / s in E4M3 with s = max|row| / 448 (fp32), rows padded with zeros (scale 1) to a multiple of 16, which
`_scaled_mm` requires. One program per row: a first pass finds the row's max, a second (from L2: a row of the
7B's widest input, 18,944 bf16 values, is 37 KB) scales and writes it. torch.compile's version of the same
expression (`gemm.fp8_rows_reference`) ran at ~35-40% of the memory bandwidth (48 µs for [5120, 3584], 187 µs for
[5120, 18944] on an H100, 0.39 s of a 7B update's 6.2 s of kernels) and paid Dynamo's guards on every call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def _rows_kernel(x_ptr, c_ptr, q_ptr, s_ptr, M, K, stride_x, BLOCK: tl.constexpr, FP8_LIMIT: tl.constexpr,
                 COLUMN_SCALE: tl.constexpr):
    row = tl.program_id(0)  # rows M.. are the padding: zeros with scale 1 (no separate fill kernels)
    real = row < M
    k_in = tl.where(real, K, 0)  # how much of the row to read: nothing of a padding row
    x_row = x_ptr + row.to(tl.int64) * stride_x
    q_row = q_ptr + row.to(tl.int64) * K
    offs = tl.arange(0, BLOCK)
    peak = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        v = tl.load(x_row + k0 + offs, mask=k0 + offs < k_in, other=0.0).to(tl.float32)
        if COLUMN_SCALE:
            v = v * tl.load(c_ptr + k0 + offs, mask=k0 + offs < K, other=0.0)
        peak = tl.maximum(peak, tl.abs(v))
    s = tl.where(real, tl.maximum(tl.max(peak, axis=0), 1e-30) / FP8_LIMIT, 1.0)
    tl.store(s_ptr + row, s)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        v = tl.load(x_row + k0 + offs, mask=k0 + offs < k_in, other=0.0).to(tl.float32)
        if COLUMN_SCALE:
            v = v * tl.load(c_ptr + k0 + offs, mask=mask, other=0.0)
        tl.store(q_row + k0 + offs, tl.math.div_rn(v, s).to(q_ptr.dtype.element_ty), mask=mask)  # x / s as torch


def fp8_rows(x: torch.Tensor, column_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M', K] E4M3, s [M', 1] fp32) for x [M, K] (unit stride along K), M' = M rounded up to 16: x's rows
    divided by their scale, then zero rows with scale 1. With `column_scale` (fp32 [K]), x · diag(column_scale) in
    its place, multiplied in fp32 as it is read (the FP8 base's dx: kernels/fp8_gemm.py), with no copy of it."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    rows = m + (-m % 16)
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = min(4096, triton.next_power_of_2(k))
        c = x if column_scale is None else column_scale.float().contiguous()  # unread without COLUMN_SCALE
        _rows_kernel[(rows,)](x, c, q, s, m, k, x.stride(0), BLOCK=block, FP8_LIMIT=FP8_MAX,
                              COLUMN_SCALE=column_scale is not None, num_warps=8 if block >= 2048 else 4)
    return q, s


@triton.jit
def _weight_kernel(w_ptr, inv_ptr, q_ptr, N, K, TRANSPOSED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    if TRANSPOSED:  # q = (W * inv[k])ᵀ, [K, N]: the tile goes through shared memory to be written along n
        q = w * tl.load(inv_ptr + rk, mask=rk < K, other=0.0)[None, :]
        tl.store(q_ptr + rk[:, None].to(tl.int64) * N + rn[None, :], tl.trans(q).to(q_ptr.dtype.element_ty),
                 mask=tl.trans(mask))
    else:
        q = w * tl.load(inv_ptr + rn, mask=rn < N, other=0.0)[:, None]
        tl.store(q_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)


def weight_fp8(w: torch.Tensor, inv: torch.Tensor, transposed: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """W [N, K] (contiguous) times `inv` per row (inv [N]), or Wᵀ [K, N] times `inv` per row of Wᵀ (inv [K]), in
    E4M3, contiguous: the operand `_scaled_mm` takes for y = x Wᵀ, or for dx = dy W. Into `out` (N * K E4M3
    elements) if given."""
    n, k = w.shape
    shape = (k, n) if transposed else (n, k)
    q = torch.empty(shape, dtype=torch.float8_e4m3fn, device=w.device) if out is None else out.view(shape)
    grid = (triton.cdiv(n, 64), triton.cdiv(k, 64))
    _weight_kernel[grid](w, inv, q, n, k, TRANSPOSED=transposed, BN=64, BK=64, num_warps=4)
    return q
