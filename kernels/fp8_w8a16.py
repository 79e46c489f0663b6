"""y = x Wᵀ for an FP8 base at decode sizes: E4M3 weights widened in registers, 16-bit activations (W8A16).

At a few rows the GEMM is bound by the bytes of W: the FP8 base's stored codes are 1 byte per weight, half of bf16's.
`torch._scaled_mm` reads them too, but only after the activations are rounded to E4M3 per row and the rows padded to
16 (kernels/fp8_gemm.py "fp8_weight"); this kernel reads the codes the same way with the activations as they are:
each program widens a [BLOCK_N, BLOCK_K] tile of codes to x's dtype (exact: every E4M3 value is a bf16 and an fp16
value), multiplies on the tensor cores with fp32 accumulation, and applies the row scales once at the end. Split
along K (atomics into an fp32 buffer) when the weight's rows alone give too few programs to fill the GPU (o_proj,
down_proj at decode). The dispatch measures it against the others per (shape, M bucket); it is not a training GEMM.

Two tiles (TILES): "triton", narrow and deep, for 1-64 rows, where only W's bytes count; "triton_wide", 64-128 rows
by 128 columns, for 17-512 rows (a ragged rollout's first steps, a 512-row batch), where the narrow tile re-reads
x for every 32 columns and ran 2.5x slower than `_scaled_mm` at 64 rows (150 against 60 us, 7B gate_up, H200,
2026-12-04). `dequantize` is the one-pass E4M3 -> bf16 widening the "dequant_cublas" backend needs: the chunked
torch expression it replaces took 1.1 ms for the 7B's gate_up (10x its bytes' time at HBM rate).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_M = 64  # the narrow tile's limit: beyond it the call is no longer bound by W's bytes alone
WIDE_MIN_M, WIDE_MAX_M = 17, 512  # the wide tile's rows; past 512 FP8 tensor cores or dequantize + cuBLAS win
# name -> (max rows per tile, tile columns, tile depth, warps, pipeline stages)
TILES = {"triton": (MAX_M, 32, 256, 4, 4), "triton_wide": (128, 128, 64, 8, 3)}


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :],
                    mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)  # [BLOCK_N, BLOCK_K], K contiguous
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0)[None, :]
    out = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def split_for(n: int, k: int, block_n: int, block_k: int, sms: int, m_tiles: int = 1) -> int:
    """Programs along K: enough for about two per SM, a power of two, each with at least 4 tiles of K to stream."""
    programs = triton.cdiv(n, block_n) * m_tiles
    split = 1
    while programs * split < 2 * sms and k // (block_k * split * 2) >= 4:
        split *= 2
    return split


# The default tile, from benchmarks/diag/sweep_w8a16.py on an H200 (2026-12-03, docs/results/2026-12-03-owed2): at
# M = 1-16 on a 7B's four decode shapes the best configs were 32-wide, 128-256 deep, 4 warps, 3-5 stages, with
# split_for's split; the former 64 x 128 tile took 2-4x longer on qkv, o and down (79 against 18 us on qkv at M = 1).
def linear_forward(x2: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, *, block_n: int = 32,
                   block_k: int = 256, split_k: int | None = None, num_warps: int = 4,
                   num_stages: int | None = 4, max_block_m: int = MAX_M) -> torch.Tensor:
    """x2 [M, K] (bf16/fp16, unit stride along K; any M) @ (w8 [N, K] E4M3 contiguous * scale [N] fp32 per row)ᵀ:
    [M, N] in x2's dtype. `num_stages`: Triton's pipeline depth (its default when None); `max_block_m`: the most
    rows one program computes (larger M: more programs)."""
    m, k = x2.shape
    n = w8.shape[0]
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    block_m = max(16, min(max_block_m, triton.next_power_of_2(m)))  # 16: tl.dot's smallest tile
    split = split_k or split_for(n, k, block_n, block_k, _sm_count(x2.device), triton.cdiv(m, block_m))
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device) if split == 1 else \
        torch.zeros(m, n, dtype=torch.float32, device=x2.device)
    grid = (triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))
    _w8a16_kernel[grid](x2, w8, scale, y, m, n, k, x2.stride(0), y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                        BLOCK_K=block_k, SPLIT_K=split, num_warps=num_warps,
                        **({} if num_stages is None else {"num_stages": num_stages}))
    return y if split == 1 else y.to(x2.dtype)


def tiled_forward(tile: str, x2: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """linear_forward with the tile TILES names."""
    max_block_m, block_n, block_k, num_warps, num_stages = TILES[tile]
    return linear_forward(x2, w8, scale, block_n=block_n, block_k=block_k, num_warps=num_warps,
                          num_stages=num_stages, max_block_m=max_block_m)


def tiles_for(m: int) -> tuple[str, ...]:
    """The TILES worth measuring at m rows."""
    return tuple(t for t, fits in (("triton", m <= MAX_M), ("triton_wide", WIDE_MIN_M <= m <= WIDE_MAX_M)) if fits)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, y_ptr, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs = rows[:, None].to(tl.int64) * K + cols[None, :]
    mask = cols[None, :] < K  # no row mask: BLOCK_R divides N, so the grid covers exactly N rows
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = w * tl.load(s_ptr + rows)[:, None]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def dequantize(w8: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [N, K] (bf16/fp16, contiguous) = w8 [N, K] E4M3 * scale [N] fp32, in one pass (the product in fp32 and
    rounded once, as `w8.float() * scale[:, None]` then `.to(out.dtype)`)."""
    n, k = w8.shape
    block_r = 1
    while block_r < 8 and n % (block_r * 2) == 0:  # rows per program: a divisor of N, so no row mask is needed
        block_r *= 2
    block_k = min(1024, triton.next_power_of_2(k))
    _dequant_kernel[(n // block_r, triton.cdiv(k, block_k))](w8, scale, out, k, BLOCK_R=block_r, BLOCK_K=block_k)
    return out
