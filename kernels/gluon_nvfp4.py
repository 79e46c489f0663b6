"""A warp-specialized NVFP4 decode GEMM for Hopper (sm_90a), written in Gluon: y[M, N] = x[M, K] @ W^T, M <= 64.

Why a second kernel. At decode the GEMM is a stream of weight bytes; our Triton kernel (kernels/_triton_nvfp4.py)
reaches about half the copy bandwidth because Triton's `tl` keeps each tile's load -> decode -> MMA chain serial
within a program. Here the chain is split across warps:

- one producer warp (24 registers) streams the packed codes, the block scales and the activation tile of each
  128-wide K step (`Config.sub` of them per stage) into a ring of shared-memory stages with TMA, signalling an
  mbarrier per stage (and waiting on one per stage that the consumers release once the wgmma reading it has
  completed);
- `W` consumer warpgroups (the default partition) each own 64 weight rows: they read their codes and scales from
  shared memory with 128-bit (codes) and 64-bit (scales) loads, decode E2M1 x E4M3 straight into the registers of
  wgmma's A operand (swap-AB: weight rows are the MMA's M = 64 side, tokens the N = 8..64 side), and keep one wgmma
  in flight while decoding the next stage.

The weight layout ("shuffled"): for each 64-row x 128-column block, the 1024 int32 words of codes are ordered so
that the word a thread needs for each 16-wide K step of its wgmma fragment sits in a 16-byte run with the next three
K steps (`shuffle_weight`). Each word's 8 nibbles are the thread's 8 fragment elements in register order, so
decoding needs no data movement between threads (the kernel asserts this at compile time: `assert_trivial`).
The scales are shuffled the same way, one int16 per (row pair g, g + 8; K step), shared by the 4 lanes that hold
the same rows (a shared-memory broadcast, not a copy). The shuffle is a one-time permutation of the
compressed-tensors tensors; `unshuffle_weight` inverts it exactly (checkpoints keep the canonical layout).

Persistent and stream-K: a fixed number of programs (`Config.per_sm` per SM: at decode sizes three programs of one
consumer warpgroup per SM beat one of two, since they hide each other's partition barriers) take equal shares of
the (tile, K step) units in tile-major order, so every SM streams the same number of weight bytes whatever the
layer's shape (no tail wave, no split factor to tune). A tile shared by several programs is summed by the last of
them to finish (a counter it resets; slots summed in fixed order: bitwise reproducible), in the same launch, the
fp32 shares staying in L2. `schedule()` mirrors the kernel's arithmetic for the tests.

Importing never fails: `IMPORT_ERROR` holds why Gluon is missing, `available()` says whether the kernel can run.
The layout functions and `shuffled_block_dequant_kernel` (plain Triton, the dequantize + cuBLAS backend for
M > 64) work without Gluon. Status and measurements: BENCHMARKS.md, "The Gluon decode GEMM".
"""

from __future__ import annotations

import torch

from .pdl import launch as launch_pdl

try:
    import triton
    import triton.language as tl

    from ._triton_nvfp4 import _e4m3_decode
except Exception:  # no triton: the layout functions still work
    triton = None

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # programmatic dependent launch
except Exception as e:  # no triton, or a Triton without Gluon
    IMPORT_ERROR: Exception | None = e
else:
    IMPORT_ERROR = None

ROWS = 64  # weight rows per consumer warpgroup (wgmma's M)
# The decoded [W, half, t6, t5, g, q, r, b0, b1, b2] tensor -> rows (W, t6, t5, b1, g), cols (half, r, b2, q, b0):
# the order `_decode` permutes it into before the [64 W, 128] reshape (tests emulate the kernel with it).
A_PERMUTE = (0, 2, 3, 8, 4, 1, 6, 9, 5, 7)
BK = 128  # K per pipeline stage (8 wgmma K steps of 16)
MAX_M = 64  # rows per launch
MAX_M_CHUNKED = 256  # linear_forward runs up to this many rows as launches of MAX_M (each streams the weight again:
# still less traffic than dequantize + cuBLAS at decode; the dispatch measures where it stops paying)


def available() -> bool:
    return IMPORT_ERROR is None and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def fits(n: int, k: int) -> bool:
    return n % ROWS == 0 and k % BK == 0


# -- the weight layout (plain PyTorch: runs anywhere) ---------------------------------------------------------------
# Within one (64-row, 128-column) block, weight element (row, col) is held by consumer thread t of warpgroup-local
# warp wq = t // 32, lane = t % 32 = 4 g + q, as element i = b0 + 2 b1 + 4 b2 of its fragment for K step
# j = 4 half + r, where  row = 16 wq + 8 b1 + g,  col = 64 half + 16 r + 8 b2 + 2 q + b0  (wgmma's A fragment).
# Word index in the block: e = ((((half * 2 + t6) * 2 + t5) * 8 + g) * 4 + q) * 4 + r, with wq = 2 t6 + t5: the
# kernel reads it as a [2, 2, 2, 8, 4, 4] tensor, r (4 words = 16 bytes) innermost.

def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    p = packed.view(torch.uint8)
    return torch.stack((p & 15, p >> 4), dim=-1).flatten(-2)  # [N, K]: byte b holds cols 2b (low), 2b + 1


def shuffle_weight(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int32 [N/64, K/128, 1024], scales int16 [N/64, K/128, 256]) from compressed-tensors
    weight_packed uint8 [N, K/2] and weight_scale e4m3 [N, K/16]."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if not fits(n, k):
        raise ValueError(f"the Gluon NVFP4 layout needs N % {ROWS} == 0 and K % {BK} == 0, got {n}x{k}")
    nib = _unpack_nibbles(packed)
    # rows -> (rb, t6, t5, b1, g); cols -> (kb, half, r, b2, q, b0)
    nib = nib.reshape(n // ROWS, 2, 2, 2, 8, k // BK, 2, 4, 2, 4, 2)
    #                 rb       t6 t5 b1 g  kb     half r b2 q  b0
    nib = nib.permute(0, 5, 6, 1, 2, 4, 9, 7, 8, 3, 10)  # rb kb half t6 t5 g q r | b2 b1 b0 (nibble i)
    nib = nib.reshape(-1, 4, 2).to(torch.int32)
    byte = nib[..., 0] | (nib[..., 1] << 4)  # nibble 2j low, 2j + 1 high
    words = byte[..., 0] | (byte[..., 1] << 8) | (byte[..., 2] << 16) | (byte[..., 3] << 24)
    codes = words.reshape(n // ROWS, k // BK, 1024).contiguous()
    s = scale.view(torch.uint8).reshape(n // ROWS, 2, 2, 2, 8, k // BK, 2, 4)
    #                                   rb       t6 t5 b1 g  kb      half r
    s = s.permute(0, 5, 6, 1, 2, 4, 7, 3).contiguous()  # rb kb half t6 t5 g r | b1 (byte 0: row g, 1: g + 8)
    scales = s.view(torch.int16).reshape(n // ROWS, k // BK, 256)
    return codes, scales


def unshuffle_weight(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of shuffle_weight: (weight_packed uint8 [N, K/2], weight_scale e4m3 [N, K/16])."""
    nrb, nkb = codes.shape[0], codes.shape[1]
    n, k = nrb * ROWS, nkb * BK
    w = codes.reshape(-1).view(torch.uint8).reshape(-1, 4)  # little-endian bytes of each word
    nib = torch.stack((w & 15, w >> 4), dim=-1).reshape(nrb, nkb, 2, 2, 2, 8, 4, 4, 2, 2, 2)
    #                                                    rb   kb   half t6 t5 g q r b2 b1 b0
    nib = nib.permute(0, 3, 4, 9, 5, 1, 2, 7, 8, 6, 10).reshape(n, k)  # rb t6 t5 b1 g | kb half r b2 q b0
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(torch.uint8)
    s = scales.contiguous().view(torch.uint8).reshape(nrb, nkb, 2, 2, 2, 8, 4, 2)
    #                                                 rb   kb   half t6 t5 g r b1
    s = s.permute(0, 3, 4, 7, 5, 1, 2, 6).reshape(n, k // 16)
    return packed, s.contiguous().view(torch.float8_e4m3fn)


if triton is not None:
    @triton.jit
    def shuffled_block_dequant_kernel(codes_ptr, scales_ptr, gs_ptr, out_ptr, inv_ptr, N, K, TRANSPOSED: tl.constexpr,
                                      SCALED: tl.constexpr = False):
        """W (or W^T) in out's dtype from the shuffled layout, one (64-row, 128-column) block per program: its 1024
        code words and 512 scale bytes read once, contiguously, and the layout's permutation done on the decoded
        tile (Triton moves it through shared memory; a per-element gather re-read each word 8 times and was 1.1-1.7x
        slower). Values are e2m1 * (scale / global_scale) in fp32, then one rounding: bit-identical to
        qerl.quant.nvfp4.dequantize. out is [K, N] if TRANSPOSED else [N, K]. SCALED (the FP8 update path): each
        value is first multiplied by inv_ptr's fp32 factor for its output row of out (W's row n, or W^T's row k)."""
        dtype = out_ptr.dtype.element_ty
        rb, kb = tl.program_id(1), tl.program_id(0)
        block = rb.to(tl.int64) * (K // 128) + kb
        # words as [half, t6, t5, g, q, r], 8 nibbles each: i = 4 b2 + 2 b1 + b0
        e = tl.reshape(tl.arange(0, 1024), [2, 2, 2, 8, 4, 4])
        word = tl.load(codes_ptr + block * 1024 + e)
        shift = tl.reshape(tl.arange(0, 8) * 4, [1, 1, 1, 1, 1, 1, 8])
        c = (word[:, :, :, :, :, :, None] >> shift) & 15  # [half, t6, t5, g, q, r, i]
        idx = c & 7
        big = ((((idx >> 1) + 126) << 23) | ((idx & 1) << 22)).to(tl.float32, bitcast=True)
        mag = tl.where(idx < 2, idx.to(tl.float32) * 0.5, big)
        val = (mag.to(tl.int32, bitcast=True) | ((c & 8) << 28)).to(tl.float32, bitcast=True)  # E2M1 -0 kept
        val = tl.reshape(val, [2, 2, 2, 8, 4, 4, 2, 2, 2])  # ..., b2, b1, b0
        # scales as [half, t6, t5, g, r, b1] bytes -> broadcast over q, b2, b0
        sb = tl.load(scales_ptr + block * 512 + tl.reshape(tl.arange(0, 512), [2, 2, 2, 8, 4, 2]))
        eff = tl.math.div_rn(_e4m3_decode(sb), tl.full(sb.shape, 1.0, tl.float32) * tl.load(gs_ptr))
        eff = tl.reshape(eff, [2, 2, 2, 8, 1, 4, 1, 2, 1])
        rows = rb * 64 + tl.arange(0, 64)
        cols = kb * 128 + tl.arange(0, 128)
        if SCALED:  # the factor applies in fp32, before the one rounding (to FP8)
            w = tl.reshape(tl.permute(val * eff, (1, 2, 7, 3, 0, 5, 6, 4, 8)), [64, 128])
            if TRANSPOSED:
                w = w * tl.load(inv_ptr + cols)[None, :]
            else:
                w = w * tl.load(inv_ptr + rows)[:, None]
            w = w.to(dtype)
        else:
            w = (val * eff).to(dtype)
            # rows (t6, t5, b1, g), cols (half, r, b2, q, b0)
            w = tl.reshape(tl.permute(w, (1, 2, 7, 3, 0, 5, 6, 4, 8)), [64, 128])
        if TRANSPOSED:
            tl.store(out_ptr + cols.to(tl.int64)[:, None] * N + rows[None, :], tl.trans(w))
        else:
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], w)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, gs: torch.Tensor, dtype: torch.dtype,
               transposed: bool = False, out: torch.Tensor | None = None,
               inv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """W [N, K] (W^T [K, N] if transposed) from the shuffled layout, in dtype, into `out` (N * K elements) if
    given: the dequantize + cuBLAS backend's first half for layers held in this layout. `inv_scale` (fp32, one per
    row of the result: [N], or [K] if transposed) multiplies each row before the rounding: W / row scale in FP8."""
    n, k = codes.shape[0] * ROWS, codes.shape[1] * BK
    shape = (k, n) if transposed else (n, k)
    out = torch.empty(shape, dtype=dtype, device=codes.device) if out is None else out.view(shape)
    inv = gs if inv_scale is None else inv_scale  # unread unless SCALED
    shuffled_block_dequant_kernel[(k // BK, n // ROWS)](codes, scales.view(torch.uint8), gs.reshape(1).float(), out,
                                                        inv, n, k, TRANSPOSED=transposed,
                                                        SCALED=inv_scale is not None)
    return out


# -- the kernel --------------------------------------------------------------------------------------------------
# One word (8 E2M1 codes) and one int16 of two E4M3 scales (rows g, g + 8) -> the 8 bf16 fragment elements,
# each = e2m1 * scale * 2^-7 (exact; the epilogue multiplies by 2^7 / global_scale). The same bit tricks as
# kernels/_triton_nvfp4.py: the hardware e4m3x2 -> f16x2 convert re-biased to bf16 * 2^119 (zeros masked back),
# a code's magnitude shifted into bf16 bits 6-8 (= e2m1 * 2^-126, subnormal 0.5 included) by PRMT + IMAD + LOP3,
# one packed FMA per pair.
_DECODE_ASM = """{
.reg .b32 a, m, sg, sh, l, h, v, p, z;
cvt.rn.f16x2.e4m3x2 a, $9;
add.u32 m, a, 0x7FFF7FFF; prmt.b32 m, m, 0, 0xBB99;
shr.b32 a, a, 3; and.b32 a, a, 0x0FFF0FFF; add.u32 a, a, 0x73807380; and.b32 a, a, m;
prmt.b32 sg, a, 0, 0x1010; prmt.b32 sh, a, 0, 0x3232;
mov.b32 z, 0x80008000;
and.b32 l, $8, 0x0F0F0F0F; shr.b32 h, $8, 4; and.b32 h, h, 0x0F0F0F0F;
prmt.b32 v, l, h, 0x8480; mul.lo.u32 v, v, 0x1040; and.b32 v, v, 0x81C081C0; fma.rn.bf16x2 p, v, sg, z; mov.b32 {$0, $1}, p;
prmt.b32 v, l, h, 0x9591; mul.lo.u32 v, v, 0x1040; and.b32 v, v, 0x81C081C0; fma.rn.bf16x2 p, v, sh, z; mov.b32 {$2, $3}, p;
prmt.b32 v, l, h, 0xA6A2; mul.lo.u32 v, v, 0x1040; and.b32 v, v, 0x81C081C0; fma.rn.bf16x2 p, v, sg, z; mov.b32 {$4, $5}, p;
prmt.b32 v, l, h, 0xB7B3; mul.lo.u32 v, v, 0x1040; and.b32 v, v, 0x81C081C0; fma.rn.bf16x2 p, v, sh, z; mov.b32 {$6, $7}, p;
}"""

# The same decode with the scales already converted (SCALE_LANES): $9 / $10 hold bf16x2 (s_g, s_g) / (s_g8, s_g8).
_DECODE_SCALED_ASM = _DECODE_ASM.split("mov.b32 z, 0x80008000;")[1].replace(", sg, z", ", $9, z").replace(", sh, z",
                                                                                                    ", $10, z")
_DECODE_SCALED_ASM = "{\n.reg .b32 l, h, v, p, z;\nmov.b32 z, 0x80008000;" + _DECODE_SCALED_ASM
# One int16 of two E4M3 scales -> the two replicated bf16x2 scale registers (x 2^119, zeros kept zero).
_SCALE_ASM = """{
.reg .b32 a, m;
cvt.rn.f16x2.e4m3x2 a, $2;
add.u32 m, a, 0x7FFF7FFF; prmt.b32 m, m, 0, 0xBB99;
shr.b32 a, a, 3; and.b32 a, a, 0x0FFF0FFF; add.u32 a, a, 0x73807380; and.b32 a, a, m;
prmt.b32 $0, a, 0, 0x1010; prmt.b32 $1, a, 0, 0x3232;
}"""

if IMPORT_ERROR is None:
    DECODE_ASM = gl.constexpr(_DECODE_ASM)
    DECODE_SCALED_ASM = gl.constexpr(_DECODE_SCALED_ASM)
    SCALE_ASM = gl.constexpr(_SCALE_ASM)  # jit code may only read constexpr globals
    # Triton 3.6 (the GPU machines) names the TMA load async_copy_global_to_shared; later ones async_load
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed after 3.6
    _ROWS = gl.constexpr(ROWS)
    _A_PERMUTE = gl.constexpr(A_PERMUTE)
    _BK = gl.constexpr(BK)

    if hasattr(gl.shared_memory_descriptor, "reinterpret"):  # Triton >= 3.7 (ours on the CPU)
        @gluon.jit
        def _view(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
            return smem.reinterpret(dtype, shape, layout)
    else:  # Triton 3.6 (the GPU machines)
        @gluon.jit
        def _view(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
            return smem._reinterpret(dtype, shape, layout)

    @gluon.jit
    def _joined_a(e0, e1, e2, e3, e4, e5, e6, e7, a_layout: gl.constexpr, W: gl.constexpr):
        # nibble i = b0 + 2 b1 + 4 b2; joins append b0, then b1, then b2
        t = gl.join(gl.join(gl.join(e0, e1), gl.join(e2, e3)), gl.join(gl.join(e4, e5), gl.join(e6, e7)))
        # [W, half, t6, t5, g, q, r, b0, b1, b2] -> rows (W, t6, t5, b1, g), cols (half, r, b2, q, b0)
        t = gl.permute(t, _A_PERMUTE.value)
        t = gl.reshape(t, [_ROWS * W, _BK])
        return gl.convert_layout(t, a_layout, assert_trivial=True)

    @gluon.jit
    def _decode(words, pairs, a_layout: gl.constexpr, W: gl.constexpr):
        """[W, 2, 2, 2, 8, 4, 4] int32 words + int16 scale pairs -> the wgmma A operand [64 W, 128] bf16."""
        e0, e1, e2, e3, e4, e5, e6, e7 = gl.inline_asm_elementwise(
            DECODE_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, pairs], dtype=(gl.bfloat16,) * 8, is_pure=True,
            pack=1)
        return _joined_a(e0, e1, e2, e3, e4, e5, e6, e7, a_layout, W)

    @gluon.jit
    def _decode_scaled(words, s_lo, s_hi, a_layout: gl.constexpr, W: gl.constexpr):
        """The same with the scales converted already (bf16x2 registers for rows g and g + 8)."""
        e0, e1, e2, e3, e4, e5, e6, e7 = gl.inline_asm_elementwise(
            DECODE_SCALED_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, s_lo, s_hi], dtype=(gl.bfloat16,) * 8,
            is_pure=True, pack=1)
        return _joined_a(e0, e1, e2, e3, e4, e5, e6, e7, a_layout, W)

    @gluon.jit
    def _program_of(unit, n_programs, total_units):
        """The program whose unit range [u0, u1) holds `unit` (u0(p) = p * U // P). Mirrored by program_of()."""
        return ((unit + 1) * n_programs + total_units - 1) // total_units - 1

    @gluon.jit
    def _advance(tile, kb, s, phase, k_iters, STAGES: gl.constexpr):
        """The next unit's (tile, K step) and ring (stage, phase)."""
        wrap = (kb == k_iters - 1).to(gl.int32)
        turn = (s == STAGES - 1).to(gl.int32)
        return tile + wrap, (kb + 1) * (1 - wrap), (s + 1) * (1 - turn), phase ^ turn

    @gluon.jit
    def _add_low_rank(acc, tile, h_ptr, b_ptr, lora_scale, M, W: gl.constexpr, MP: gl.constexpr,
                      R: gl.constexpr, RC: gl.constexpr, num_warps: gl.constexpr):
        """acc [64 W rows, MP tokens] + lora_scale * B[rows, :] @ h[tokens, :]^T, in fp32: LoRA's second product
        (h = x A^T [M, R], B [N, R], both bf16 and contiguous) in the epilogue, so the adapter costs no launch of
        its own. R is taken RC at a time (the products [8, tokens, RC] per thread stay in registers). A thread's 8
        rows sit at stride R in B: scalar loads, one reason this path measured slower (kernels/gemm.py)."""
        l3: gl.constexpr = gl.BlockedLayout([8, 1, RC], [8 * W, 32 // (8 * W), 1], [1, num_warps, 1], [2, 0, 1])
        l2: gl.constexpr = gl.SliceLayout(2, l3)
        rows = tile * (_ROWS * W) + gl.arange(0, _ROWS * W, layout=gl.SliceLayout(1, l2))
        toks = gl.arange(0, MP, layout=gl.SliceLayout(0, l2))
        rows3 = gl.expand_dims(gl.expand_dims(rows, 1), 2)
        toks3 = gl.expand_dims(gl.expand_dims(toks, 0), 2)
        lo = gl.zeros([_ROWS * W, MP], gl.float32, l2)
        for c in gl.static_range(R // RC):
            rr = c * RC + gl.arange(0, RC, layout=gl.SliceLayout(0, gl.SliceLayout(0, l3)))
            rr3 = gl.expand_dims(gl.expand_dims(rr, 0), 0)
            b = gl.load(b_ptr + rows3 * R + rr3).to(gl.float32)  # [64 W, 1, RC]
            h = gl.load(h_ptr + toks3 * R + rr3, mask=toks3 < M, other=0.0).to(gl.float32)
            lo += gl.sum(b * h, axis=2)
        return acc + gl.convert_layout(lo, acc.type.layout) * lora_scale

    @gluon.jit
    def _finish_segment(acc, tile, p, n_programs, total_units, k_iters, gs_ptr, y_ptr, ws_ptr,
                        cnt_ptr, M, N, h_ptr, b_ptr, lora_scale, bias_ptr, W: gl.constexpr, MP: gl.constexpr,
                        R: gl.constexpr, RC: gl.constexpr, HAS_BIAS: gl.constexpr, num_warps: gl.constexpr):
        """acc holds this program's share of `tile` (64 W weight rows). If the program did the whole K range, store
        y; else write the share to its contributor slot, and the last contributor to arrive (a counter it resets)
        sums the slots in fixed order (bitwise reproducible) and stores y. With R > 0, LoRA's low-rank term is
        added to the finished tile before its one rounding to bf16, and so is the bias with HAS_BIAS (no
        elementwise kernel after the GEMM; one rounding, as cuBLAS' bias epilogue makes)."""
        # 8 consecutive rows (16-byte stores along N) per thread, few tokens per thread: the loop-invariant part
        # of the offsets (token * N) stays a handful of registers (one per token held)
        out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [8 * W, 32 // (8 * W)], [1, num_warps], [0, 1])
        acc = gl.convert_layout(acc, out_layout) * (128.0 / gl.load(gs_ptr))
        rows = tile * (_ROWS * W) + gl.arange(0, _ROWS * W, layout=gl.SliceLayout(1, out_layout))
        toks = gl.arange(0, MP, layout=gl.SliceLayout(0, out_layout))
        off = toks[None, :] * N + rows[:, None]  # int32: M <= 64 rows of N < 2^25 (int64 offsets would spill)
        mask = (toks[None, :] < M) & (rows[:, None] >= 0)  # tiles cover N exactly: only the token side is ragged
        p_first = _program_of(tile * k_iters, n_programs, total_units)
        n_contrib = _program_of(tile * k_iters + k_iters - 1, n_programs, total_units) - p_first + 1
        if n_contrib == 1:
            if R > 0:
                acc = _add_low_rank(acc, tile, h_ptr, b_ptr, lora_scale, M, W, MP, R, RC, num_warps)
            if HAS_BIAS:
                acc += gl.load(bias_ptr + rows).to(gl.float32)[:, None]
            gl.store(y_ptr + off, acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            MN = N.to(gl.int64) * M
            gl.store(ws_ptr + (p - p_first).to(gl.int64) * MN + off, acc, mask=mask)
            _cta_barrier()  # every thread's share is issued before the counter's release
            done = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == n_contrib - 1:
                acc = gl.zeros_like(acc)  # our own share is re-read from its slot: the sum is in slot order
                for c in range(n_contrib):
                    acc += gl.load(ws_ptr + c.to(gl.int64) * MN + off, mask=mask, other=0.0, cache_modifier=".cg")
                if R > 0:
                    acc = _add_low_rank(acc, tile, h_ptr, b_ptr, lora_scale, M, W, MP, R, RC, num_warps)
                if HAS_BIAS:
                    acc += gl.load(bias_ptr + rows).to(gl.float32)[:, None]
                gl.store(y_ptr + off, acc.to(y_ptr.dtype.element_ty), mask=mask)
                gl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch (CUDA-graph replays)

    @gluon.jit
    def _consumer(x_smem, w_smem, s_smem, ready, empty, u0, u1, p, n_programs, total_units, k_iters, gs_ptr, y_ptr,
                  ws_ptr, cnt_ptr, M, N, h_ptr, b_ptr, lora_scale, bias_ptr, W: gl.constexpr, MP: gl.constexpr,
                  STAGES: gl.constexpr, SUB: gl.constexpr, SCALE_LANES: gl.constexpr, R: gl.constexpr,
                  RC: gl.constexpr, HAS_BIAS: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr):
        if PDL:  # before any read of the activations' ring, h, the workspace or the counters (kernels/pdl.py)
            gdc_wait()
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * W, 1],
                                                             instr_shape=[16, MP, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
        # the [W, half, t6, t5, g, q, r] word tensor: r (4 words) and half per thread, (g, q) the lane, (t5, t6,
        # warpgroup) the warp: exactly the words each thread's wgmma fragments need
        frag: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2, 1, 1, 1, 1, 4],
                                              threads_per_warp=[1, 1, 1, 1, 8, 4, 1],
                                              warps_per_cta=[W, 1, 2, 2, 1, 1, 1], order=[6, 5, 4, 3, 2, 1, 0])
        # the scale pairs spread over the row pair's 4 lanes (r on the lanes q), for SCALE_LANES
        spread: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2, 1, 1, 1, 1, 1],
                                                threads_per_warp=[1, 1, 1, 1, 8, 1, 4],
                                                warps_per_cta=[W, 1, 2, 2, 1, 1, 1], order=[6, 5, 4, 3, 2, 1, 0])
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[6, 5, 4, 3, 2, 1, 0])
        acc = gl.zeros([_ROWS * W, MP], gl.float32, mma_layout)
        first = u0
        # (tile, K step) and (stage, phase) advance by counting: no integer division in the loop
        tile = u0 // k_iters
        kb = u0 - tile * k_iters
        s = 0
        phase = 0
        prev = STAGES - 1
        for u in range(u0, u1):
            mbarrier.wait(ready.index(s), phase)
            for j in gl.static_range(SUB):  # SUB 128-wide K steps per stage: one barrier round-trip for all
                b = s * SUB + j
                words = _view(w_smem.index(b), gl.int32, [W, 2, 2, 2, 8, 4, 4], flat).load(frag)
                if SCALE_LANES:  # each of the 4 lanes sharing a row pair converts 2 of its 8 scale pairs, then
                    # shuffles
                    pairs = _view(s_smem.index(b), gl.int16, [W, 2, 2, 2, 8, 1, 4], flat).load(spread)
                    s_lo, s_hi = gl.inline_asm_elementwise(SCALE_ASM, "=r,=r,h", [pairs],
                                                           dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
                    s_lo = gl.broadcast(gl.convert_layout(s_lo, frag), words)[0]
                    s_hi = gl.broadcast(gl.convert_layout(s_hi, frag), words)[0]
                    a = _decode_scaled(words, s_lo, s_hi, a_layout, W)
                else:  # each lane converts its own 8 (the 4 lanes of a row pair repeat the work)
                    pairs = _view(s_smem.index(b), gl.int16, [W, 2, 2, 2, 8, 1, 4], flat).load(frag)
                    a = _decode(words, gl.broadcast(pairs, words)[0], a_layout, W)
                # a segment's first unit starts a fresh accumulator
                acc = warpgroup_mma(a, x_smem.index(b).permute((1, 0)), acc, use_acc=(u != first) | (j > 0),
                                    is_async=True)
                # one wgmma stays in flight; the ones before it are done (after the first K step, all of the
                # previous stage's)
                acc, a = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a))
            fence_async_shared()  # order our shared-memory reads before the TMA that refills the stage
            mbarrier.arrive(empty.index(prev), count=1, pred=u > u0)
            if (kb == k_iters - 1) | (u == u1 - 1):  # the segment of this tile ends here
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                _finish_segment(acc, tile, p, n_programs, total_units, k_iters, gs_ptr, y_ptr, ws_ptr,
                                cnt_ptr, M, N, h_ptr, b_ptr, lora_scale, bias_ptr, W, MP, R, RC, HAS_BIAS, num_warps)
                first = u + 1
            prev = s
            tile, kb, s, phase = _advance(tile, kb, s, phase, k_iters, STAGES)
        if PDL:
            gdc_launch_dependents()

    @gluon.jit
    def _producer(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, u0, u1, k_iters, W: gl.constexpr,
                  STAGES: gl.constexpr, SUB: gl.constexpr, PDL: gl.constexpr):
        tile = u0 // k_iters
        kb = u0 - tile * k_iters
        s = 0
        phase = 0
        start = u0
        if PDL:  # the first stages' weights do not depend on the previous kernel: stream them in while it ends
            first = gl.minimum(u1 - u0, STAGES)
            t, k = tile, kb
            for i in range(0, first):  # fresh stages: nothing to wait for
                bar = ready.index(i)
                mbarrier.expect(bar, SUB * (x_desc.block_type.nbytes + w_desc.block_type.nbytes
                                            + s_desc.block_type.nbytes))
                for j in gl.static_range(SUB):
                    _tma_load(w_desc, [t * W, (k * SUB + j) * 4, 0], bar, w_smem.index(i * SUB + j))
                    _tma_load(s_desc, [t * W, k * SUB + j, 0], bar, s_smem.index(i * SUB + j))
                wrap = (k == k_iters - 1).to(gl.int32)  # the next unit's (tile, K step), as _advance steps them
                t, k = t + wrap, (k + 1) * (1 - wrap)
            gdc_wait()  # the activations are the previous kernel's output
            for i in range(0, first):
                for j in gl.static_range(SUB):
                    _tma_load(x_desc, [0, (kb * SUB + j) * _BK], ready.index(i), x_smem.index(i * SUB + j))
                tile, kb, s, phase = _advance(tile, kb, s, phase, k_iters, STAGES)
            start = u0 + first
        for u in range(start, u1):
            mbarrier.wait(empty.index(s), phase ^ 1)  # a fresh barrier counts as released
            bar = ready.index(s)
            mbarrier.expect(bar, SUB * (x_desc.block_type.nbytes + w_desc.block_type.nbytes
                                        + s_desc.block_type.nbytes))
            for j in gl.static_range(SUB):
                k128 = kb * SUB + j
                _tma_load(x_desc, [0, k128 * _BK], bar, x_smem.index(s * SUB + j))
                _tma_load(w_desc, [tile * W, k128 * 4, 0], bar, w_smem.index(s * SUB + j))
                _tma_load(s_desc, [tile * W, k128, 0], bar, s_smem.index(s * SUB + j))
            tile, kb, s, phase = _advance(tile, kb, s, phase, k_iters, STAGES)

    # k_iters or total_units equal to 1 (K = 128 SUB, one tile) would be specialized to a constant, and Triton 3.6
    # then fails an assertion lowering the loop (ConvertTritonGPUToLLVM, SmallVector idx < size())
    @gluon.jit(do_not_specialize=["k_iters", "total_units"])
    def nvfp4_decode_gemm_kernel(x_desc, w_desc, s_desc, gs_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, k_iters,
                                 total_units, h_ptr, b_ptr, lora_scale, bias_ptr, W: gl.constexpr, MP: gl.constexpr,
                                 STAGES: gl.constexpr, SUB: gl.constexpr, SCALE_LANES: gl.constexpr,
                                 R: gl.constexpr, RC: gl.constexpr, HAS_BIAS: gl.constexpr, PDL: gl.constexpr,
                                 num_warps: gl.constexpr):
        """Persistent, stream-K: the (tile, K step) units in tile-major order are cut into one equal range per
        program, so every program streams the same number of weight bytes whatever the shape (no tail wave);
        a tile shared by several programs is summed by the last of them. R > 0: y += lora_scale * h @ B^T (LoRA's
        update, h = x A^T [M, R], B [N, R]) in the epilogue; HAS_BIAS: y += bias [N] there too. PDL
        (kernels/pdl.py): the producer streams the first ring stages' weights before it waits for the previous
        kernel; the next kernel may start once every program has left its main loop (not earlier: its waiting
        programs would take issue slots from this one's)."""
        p = gl.program_id(0)
        n_programs = gl.num_programs(0)
        u0 = (p * total_units) // n_programs
        u1 = ((p + 1) * total_units) // n_programs

        x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * SUB, MP, _BK], x_desc.layout)
        w_smem = gl.allocate_shared_memory(gl.int32, [STAGES * SUB, W, 4, 256], w_desc.layout)
        s_smem = gl.allocate_shared_memory(gl.int16, [STAGES * SUB, W, 1, 256], s_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)

        gl.warp_specialize([
            (_consumer, (x_smem, w_smem, s_smem, ready, empty, u0, u1, p, n_programs, total_units, k_iters, gs_ptr,
                         y_ptr, ws_ptr, cnt_ptr, M, N, h_ptr, b_ptr, lora_scale, bias_ptr, W, MP, STAGES, SUB,
                         SCALE_LANES, R, RC, HAS_BIAS, PDL, num_warps)),
            (_producer, (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, u0, u1, k_iters, W, STAGES,
                         SUB, PDL)),
        ], [1], [24])


# -- the host side -------------------------------------------------------------------------------------------------
class Config:
    """Launch shape: W consumer warpgroups (64 W weight rows per tile), STAGES ring depth, SUB 128-wide K steps
    per stage (one mbarrier round-trip, and the partition barriers Gluon puts around it, per SUB steps; the K
    of the layer must divide by 128 SUB), `per_sm` persistent programs per SM (several programs per SM hide each
    other's partition barriers and segment ends; they need `maxnreg` low enough and a ring small enough to fit
    together), or `programs` in all; at most one program per 4 units. `maxnreg`: registers per thread at launch
    (None = Triton's default, room for one program per SM); the producer warpgroup gives all but 24 of its share
    to the consumers (maxnreg 80: consumers run with 136, 128: 232)."""

    def __init__(self, w: int = 2, stages: int = 4, programs: int | None = None, maxnreg: int | None = None,
                 scale_lanes: bool = False, sub: int = 1, per_sm: int = 1):
        self.w, self.stages, self.programs, self.maxnreg, self.sub = w, stages, programs, maxnreg, sub
        self.per_sm = per_sm
        self.scale_lanes = scale_lanes  # convert each scale once per row pair, not once per lane (SCALE_LANES)

    def __repr__(self) -> str:
        return (f"Config(w={self.w}, stages={self.stages}, sub={self.sub}, per_sm={self.per_sm}, "
                f"programs={self.programs}, maxnreg={self.maxnreg}, scale_lanes={self.scale_lanes})")

    def launch_options(self) -> dict:
        opts = {"num_warps": 4 * self.w}
        if self.maxnreg is not None:
            opts["maxnreg"] = self.maxnreg
        return opts


def padded_m(m: int) -> int:
    """Tokens side of the MMA: 8, 16, 32 or 64."""
    if not 1 <= m <= MAX_M:
        raise ValueError(f"the Gluon decode GEMM takes 1..{MAX_M} rows, got {m}")
    return max(8, 1 << (m - 1).bit_length())


def descriptors(x2: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, w: int, mp: int):
    """TMA descriptors for one call (x's changes with M; the weight's could be cached per layer)."""
    x_layout = gl.NVMMASharedLayout.get_default_for([mp, BK], gl.bfloat16)
    x_desc = TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [mp, BK], x_layout)
    codes = codes.view(codes.shape[0], codes.shape[1] * 4, 256)  # TMA boxes are at most 256 wide
    w_desc = TensorDescriptor(codes, list(codes.shape), list(codes.stride()), [w, 4, 256],
                              gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3))
    s_desc = TensorDescriptor(scales, list(scales.shape), list(scales.stride()), [w, 1, 256],
                              gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3))
    return x_desc, w_desc, s_desc


def shared_bytes(cfg: Config, mp: int) -> int:
    """Shared memory the kernel allocates (the ring, the epilogue's layout-conversion scratch, the barriers): what
    Triton reports, computed before compiling so a configuration that cannot fit is refused up front."""
    ring = cfg.stages * cfg.sub * (mp * BK * 2 + cfg.w * (4096 + 512))
    return ring + ROWS * cfg.w * mp * 4 + 16 * cfg.stages + 64


SHARED_PER_SM = 227 * 1024  # what an H100/H200 SM gives the programs on it (each also pays ~1 KB to the driver)


def default_config(n: int, k: int, m: int) -> Config:
    """The fastest configuration measured on an H200 for 7B/32B gate_up and down (BENCHMARKS.md, "The Gluon decode
    GEMM"), by the token count: at M <= 16 three 1-warpgroup programs per SM, 2 K steps per stage; at M = 32 two;
    at M = 64 one program of 2 warpgroups (the activation tile, 16 KB per K step, is shared by 128 weight rows)."""
    mp = padded_m(m)
    sub = 2 if k % (2 * BK) == 0 else 1
    if mp <= 16:
        return Config(w=1, stages=8 // sub, sub=sub, per_sm=3, maxnreg=80, scale_lanes=True)
    if mp == 32:
        return Config(w=1, stages=8 // sub, sub=sub, per_sm=2, maxnreg=128, scale_lanes=True)
    if n % (2 * ROWS) == 0:
        return Config(w=2, stages=3 if sub == 2 else 4, sub=sub, scale_lanes=True)
    return Config(w=1, stages=4, sub=sub, scale_lanes=True)


# -- the stream-K schedule, mirrored from the kernel (tests check it covers every unit once) -------------------------
def program_of(unit: int, n_programs: int, total_units: int) -> int:
    return ((unit + 1) * n_programs + total_units - 1) // total_units - 1


def schedule(tiles: int, k_iters: int, n_programs: int) -> list[list[tuple[int, int, int, int, int]]]:
    """Per program, its segments (tile, first K step, end K step, contributor slot, contributors of the tile),
    computed exactly as the kernel does."""
    total = tiles * k_iters
    out = []
    for p in range(n_programs):
        u0, u1 = p * total // n_programs, (p + 1) * total // n_programs
        segs, first = [], u0
        for u in range(u0, u1):
            tile, kb = divmod(u, k_iters)
            if kb == k_iters - 1 or u == u1 - 1:
                p_first = program_of(tile * k_iters, n_programs, total)
                n_contrib = program_of(tile * k_iters + k_iters - 1, n_programs, total) - p_first + 1
                segs.append((tile, first - tile * k_iters, kb + 1, p - p_first, n_contrib))
                first = u + 1
        out.append(segs)
    return out


def n_programs(cfg: Config, tiles: int, k_iters: int, device: torch.device | None = None) -> int:
    if cfg.programs is not None:
        return max(1, min(cfg.programs, tiles * k_iters))
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device is not None else 132
    return max(1, min(sms * cfg.per_sm, tiles * k_iters // 4))


def low_rank_chunk(rank: int, mp: int) -> int:
    """The rank taken per step of the epilogue's low-rank loop: the largest power of two dividing it that keeps a
    thread's B chunk and products (8 rows x its tokens x chunk) in registers (a thread holds MP / 16 tokens, at
    least one): 4 at M <= 16, 2 at 32, 1 at 64 (measured free of spills with `compile_sm90`)."""
    most = max(1, 4 // max(1, mp // 16))
    return next(c for c in (4, 2, 1) if c <= most and rank % c == 0)


def linear_forward(x2: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, gs: torch.Tensor,
                   config: Config | None = None,
                   low_rank: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                   out: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                   pdl: bool = True) -> torch.Tensor:
    """y[M, N] (bf16) = x2[M, K] @ W^T (+ bias [N]) for the shuffled weight (codes, scales) and its global scale;
    with `low_rank = (h [M, R], B [N, R], s)` (bf16), y = x2 @ W^T + s * h @ B^T: LoRA's update in the epilogue.
    M up to MAX_M_CHUNKED, in launches of MAX_M rows; into `out` (contiguous [M, N] bf16) if given. `pdl`: launch
    with programmatic dependent launch where the GPU has it (kernels/pdl.py)."""
    if x2.dtype != torch.bfloat16 or x2.dim() != 2 or x2.stride(1) != 1:
        raise ValueError(f"x must be a 2-D bf16 tensor with unit stride along K, got {x2.dtype} "
                         f"{tuple(x2.shape)} {x2.stride()}")
    m, k = x2.shape
    n = codes.shape[0] * ROWS
    if MAX_M < m <= MAX_M_CHUNKED:
        y = torch.empty(m, n, dtype=torch.bfloat16, device=x2.device) if out is None else out
        for i in range(0, m, MAX_M):
            part = None if low_rank is None else (low_rank[0][i:i + MAX_M], low_rank[1], low_rank[2])
            linear_forward(x2[i:i + MAX_M], codes, scales, gs, config, part, out=y[i:i + MAX_M], bias=bias, pdl=pdl)
        return y
    if codes.shape[1] * BK != k:
        raise ValueError(f"x has K = {k}, the weight {codes.shape[1] * BK}")
    h, b, lora_scale, rank = x2, x2, 0.0, 0  # no low-rank term: the pointers are never read
    if low_rank is not None:
        h, b, lora_scale = low_rank
        rank = h.shape[-1]
        if h.shape != (m, rank) or b.shape != (n, rank) or h.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
            raise ValueError(f"low rank: h must be bf16 [{m}, R] and B bf16 [{n}, R], got {h.dtype} "
                             f"{tuple(h.shape)} and {b.dtype} {tuple(b.shape)}")
        h, b = h.contiguous(), b.contiguous()
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}] vector, got {tuple(bias.shape)} {bias.stride()}")
    if x2.data_ptr() % 16 or (x2.stride(0) * 2) % 16:  # TMA reads 16-byte-aligned rows
        x2 = x2.clone()
    mp = padded_m(m)
    cfg = config or default_config(n, k, m)
    if k % (BK * cfg.sub):
        raise ValueError(f"{cfg}: K = {k} is not a multiple of {BK} x sub")
    if shared_bytes(cfg, mp) > SHARED_PER_SM:
        raise ValueError(f"{cfg} at M = {m} needs {shared_bytes(cfg, mp)} bytes of shared memory, more than an SM "
                         f"has ({SHARED_PER_SM}): fewer stages or a smaller sub")
    tiles, k_iters = n // (ROWS * cfg.w), k // (BK * cfg.sub)
    programs = n_programs(cfg, tiles, k_iters, x2.device)
    most = max_contributors(tiles, k_iters, programs)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x2.device) if out is None else out
    ws = torch.empty(most * m * n if most > 1 else 1, dtype=torch.float32, device=x2.device)
    from .nvfp4 import _counters  # the split-K counters our Triton kernel resets the same way: one buffer per GPU

    counters = _counters(x2.device, tiles)
    x_desc, w_desc, s_desc = descriptors(x2, codes, scales, cfg.w, mp)
    nvfp4_decode_gemm_kernel[(programs,)](
        x_desc, w_desc, s_desc, gs.reshape(1).float(), y, ws, counters, m, n, k_iters, tiles * k_iters,
        h, b, float(lora_scale), bias if bias is not None else gs, W=cfg.w, MP=mp, STAGES=cfg.stages, SUB=cfg.sub,
        SCALE_LANES=cfg.scale_lanes, R=rank, RC=low_rank_chunk(rank, mp) if rank else 1, HAS_BIAS=bias is not None,
        **cfg.launch_options(), **launch_pdl(x2.device, pdl))
    return y


def max_contributors(tiles: int, k_iters: int, n_programs: int) -> int:
    """The most programs any tile is shared by (the workspace holds that many slots): k_iters consecutive units
    meet at most ceil((k_iters - 1) / L) + 1 ranges of L >= floor(U / P) units."""
    per = max(1, tiles * k_iters // n_programs)
    return min(n_programs, -(-(k_iters - 1) // per) + 1)


def compile_sm90(m: int, n: int, k: int, config: Config | None = None, rank: int = 0, pdl_calls: bool = True,
                 bias: bool = False):
    """Compile the kernel for an H100/H200 (sm_90a) on any machine, GPU or not: Gluon -> TTGIR -> PTX -> cubin
    with the ptxas that ships with Triton. Returns Triton's compiled kernel (`.asm["ttgir" | "ptx" | "cubin"]`,
    `.metadata.shared`). A layout mistake (e.g. a decode that would need data movement) fails here."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    cfg = config or default_config(n, k, m)
    mp = padded_m(m)
    x = torch.empty(m, k, dtype=torch.bfloat16)
    codes = torch.empty(n // ROWS, k // BK, 1024, dtype=torch.int32)
    scales = torch.empty(n // ROWS, k // BK, 256, dtype=torch.int16)
    x_desc, w_desc, s_desc = descriptors(x, codes, scales, cfg.w, mp)
    signature = {"x_desc": mangle_type(x_desc), "w_desc": mangle_type(w_desc), "s_desc": mangle_type(s_desc),
                 "gs_ptr": "*fp32", "y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32",
                 "N": "i32", "k_iters": "i32", "total_units": "i32", "h_ptr": "*bf16", "b_ptr": "*bf16",
                 "lora_scale": "fp32", "bias_ptr": "*bf16"}
    constexprs = {"W": cfg.w, "MP": mp, "STAGES": cfg.stages, "SUB": cfg.sub, "SCALE_LANES": cfg.scale_lanes,
                  "R": rank, "RC": low_rank_chunk(rank, mp) if rank else 1, "HAS_BIAS": bias, "PDL": pdl_calls,
                  "num_warps": 4 * cfg.w}
    signature.update({name: "constexpr" for name in constexprs})
    src = GluonASTSource(nvfp4_decode_gemm_kernel, signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=cfg.launch_options())
