"""Triton kernels for NVFP4 (compressed-tensors layout) weights: quantize, fused-dequant GEMM, dx GEMM.

Dequantization trick (both GEMMs). The packed weight is read as int32 words: 8 E2M1 codes, k = 8g..8g+7,
nibble j = column 8g+j. Shifting a code's 3 magnitude bits into the top of a bf16 (fp16) exponent+mantissa
gives a float equal to e2m1 * 2^-126 (2^-14) *including* the subnormal code 0.5, so decoding needs no table:
two shifts, two masks and an OR build two bf16 values at once (nibbles j and j+4 land in the two halves of
one 32-bit register), and one packed FMA applies the block scale. The block scale is pre-multiplied by
2^119 (2^7) so that every product e2m1 * s * 2^-7 is an exact, normal bf16/fp16 value; the GEMMs accumulate
in fp32 and multiply by 2^7 / global_scale once in the epilogue. Exact operands + fp32 accumulation make
the result at least as accurate as dequantize-to-bf16-then-cuBLAS.

USE_ASM=False computes the same exact values with plain Triton ops (the CPU interpreter cannot run PTX).
"""

from __future__ import annotations

import triton
import triton.language as tl

# E2M1 rounding boundaries exactly as qerl.quant.nvfp4.e2m1_round: index = #boundaries strictly below |x|;
# the ties-up boundaries (0.75, 1.75, 3.5) are nudged one fp32 ulp down (values are exact fp32 numbers).
_B1 = 0.7499999403953552  # nextafter(0.75, 0)
_B3 = 1.7499998807907104  # nextafter(1.75, 0)
_B5 = 3.4999997615814210  # nextafter(3.5, 0)

# magnitude bits -> (bf16 | fp16) top of exponent/mantissa; see module docstring. Operand $8 = word,
# $9 = block scale (already *2^119 or *2^7); outputs $0..$7 = columns 8g+0..8g+7.
_ASM_TMPL = """
{
.reg .b32 qs, qz, qa, qb, qt;
mov.b32 qs, {$9, $9};
mov.b32 qz, 0x80008000;
shl.b32 qa, $8, 12; and.b32 qa, qa, 0x80008000; shl.b32 qb, $8, M0; and.b32 qb, qb, MASK; or.b32 qt, qa, qb;
fma.rn.TY qt, qt, qs, qz; mov.b32 {$0, $4}, qt;
shl.b32 qa, $8, 8; and.b32 qa, qa, 0x80008000; SH1 qb, $8, M1; and.b32 qb, qb, MASK; or.b32 qt, qa, qb;
fma.rn.TY qt, qt, qs, qz; mov.b32 {$1, $5}, qt;
shl.b32 qa, $8, 4; and.b32 qa, qa, 0x80008000; SH2 qb, $8, M2; and.b32 qb, qb, MASK; or.b32 qt, qa, qb;
fma.rn.TY qt, qt, qs, qz; mov.b32 {$2, $6}, qt;
and.b32 qa, $8, 0x80008000; shr.b32 qb, $8, M3; and.b32 qb, qb, MASK; or.b32 qt, qa, qb;
fma.rn.TY qt, qt, qs, qz; mov.b32 {$3, $7}, qt;
}
"""


def _asm(bf16: bool) -> str:
    # bf16: magnitude to bits 6..8 (shifts 6, 2, -2, -6); fp16: to bits 9..11 (shifts 9, 5, 1, -3)
    sub = (
        dict(TY="bf16x2", MASK="0x01C001C0", M0="6", SH1="shl.b32", M1="2", SH2="shr.b32", M2="2", M3="6")
        if bf16
        else dict(TY="f16x2", MASK="0x0E000E00", M0="9", SH1="shl.b32", M1="5", SH2="shl.b32", M2="1", M3="3")
    )
    s = _ASM_TMPL
    for key in ("MASK", "SH1", "SH2", "TY", "M0", "M1", "M2", "M3"):  # longer/unique names first
        s = s.replace(key, sub[key])
    return s


ASM_BF16 = _asm(True)
ASM_FP16 = _asm(False)


@triton.jit
def _e4m3_decode(code):
    """uint8/int32 e4m3fn bits (sign ignored: NVFP4 scales are >= 0) -> fp32, exact."""
    code = code.to(tl.int32)
    e = (code >> 3) & 15
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9


@triton.jit
def _e4m3_rne(v):
    """fp32 in [0, 448] -> e4m3fn bits (int32), round to nearest even (as torch's .to(float8_e4m3fn))."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    t = v * 512.0  # subnormal grid step 2^-9; exact
    f = tl.floor(t)
    d = t - f
    fi = f.to(tl.int32)
    up = (d > 0.5) | ((d == 0.5) & ((fi & 1) == 1))
    sub = fi + up.to(tl.int32)
    return tl.where(v < 0.015625, sub, normal)


@triton.jit
def _nib(w, J: tl.constexpr, s, dtype: tl.constexpr):
    """Pure-Triton decode of nibble J of int32 words w, times fp32 scale s (= block scale * 2^-7)."""
    c = (w >> (4 * J)) & 15
    idx = c & 7
    big = ((((idx >> 1) + 126) << 23) | ((idx & 1) << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(idx < 2, idx.to(tl.float32) * 0.5, big)
    return (tl.where((c & 8) != 0, -mag, mag) * s).to(dtype)


@triton.jit
def _dequant(words, sbytes, dtype: tl.constexpr, USE_ASM: tl.constexpr):
    """int32 words [R, C/8] + e4m3 scale bytes [R, C/16] -> [R, C] in dtype, = W * global_scale * 2^-7."""
    s = _e4m3_decode(sbytes)
    if USE_ASM:
        if dtype == tl.bfloat16:
            s2 = (s * 6.646139978924579e35).to(dtype)  # * 2^119
            s2 = tl.interleave(s2, s2)  # one scale per 16 columns = per 2 words
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, s2], dtype=(tl.bfloat16,) * 8,
                is_pure=True, pack=1)
        else:
            s2 = (s * 128.0).to(dtype)  # * 2^7
            s2 = tl.interleave(s2, s2)
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                ASM_FP16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, s2], dtype=(tl.float16,) * 8,
                is_pure=True, pack=1)
    else:
        s2 = s * 0.0078125  # * 2^-7
        s2 = tl.interleave(s2, s2)
        o0 = _nib(words, 0, s2, dtype)
        o1 = _nib(words, 1, s2, dtype)
        o2 = _nib(words, 2, s2, dtype)
        o3 = _nib(words, 3, s2, dtype)
        o4 = _nib(words, 4, s2, dtype)
        o5 = _nib(words, 5, s2, dtype)
        o6 = _nib(words, 6, s2, dtype)
        o7 = _nib(words, 7, s2, dtype)
    # column 8g+j <- o_j: interleave's lowest index bit selects its first argument
    even = tl.interleave(tl.interleave(o0, o4), tl.interleave(o2, o6))
    odd = tl.interleave(tl.interleave(o1, o5), tl.interleave(o3, o7))
    return tl.interleave(even, odd)


@triton.jit
def _swizzle(pid, grid_a, grid_b, GROUP: tl.constexpr):
    """Grouped tile order: GROUP consecutive a-tiles share each b-tile while it is hot in L2."""
    width = GROUP * grid_b
    first = (pid // width) * GROUP
    size = tl.minimum(grid_a - first, GROUP)
    return first + (pid % width) % size, (pid % width) // size


@triton.jit
def nvfp4_fwd_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_ym, stride_wn, stride_sn,
    HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, USE_ASM: tl.constexpr,
):
    """y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W dequantized tile by tile in registers.

    SWAP_AB computes y^T = W @ x^T so that the weight rows fill the MMA's 64-row side and a decode batch
    of 1..64 tokens is the narrow side (no wasted tensor-core rows, weights streamed once).
    SPLIT_K > 1: program (tile, k) writes an fp32 partial; the last program of a tile (counter) sums the
    partials in fixed order (deterministic) and resets the counter, so one launch does it all.
    """
    dtype = y_ptr.dtype.element_ty
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _swizzle(pid, grid_m, grid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = offs_m.to(tl.int64)
    m_mask = offs_m < M
    n_mask = offs_n < N
    ar_k = tl.arange(0, BLOCK_K)
    ar_w = tl.arange(0, BLOCK_K // 8)
    ar_s = tl.arange(0, BLOCK_K // 16)
    w_base = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + ar_w[None, :]
    s_base = s_ptr + offs_n.to(tl.int64)[:, None] * stride_sn + ar_s[None, :]
    if SWAP_AB:
        x_base = x_ptr + rm[None, :] * stride_xm + ar_k[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        x_base = x_ptr + rm[:, None] * stride_xm + ar_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    KW = K // 8
    KS = K // 16

    iters = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_begin = pid_k * iters * BLOCK_K
    k_end = tl.minimum(K, k_begin + iters * BLOCK_K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        words = tl.load(w_base + k0 // 8, mask=n_mask[:, None] & (ar_w[None, :] < KW - k0 // 8), other=0)
        sb = tl.load(s_base + k0 // 16, mask=n_mask[:, None] & (ar_s[None, :] < KS - k0 // 16), other=0)
        w = _dequant(words, sb, dtype, USE_ASM)  # [BLOCK_N, BLOCK_K]
        if SWAP_AB:
            xt = tl.load(x_base + k0, mask=m_mask[None, :] & (ar_k[:, None] < K - k0), other=0.0)
            acc = tl.dot(w, xt, acc)
        else:
            xa = tl.load(x_base + k0, mask=m_mask[:, None] & (ar_k[None, :] < K - k0), other=0.0)
            acc = tl.dot(xa, tl.trans(w), acc)

    acc = acc * (128.0 / tl.load(gs_ptr))  # undo the 2^-7 folded into the operands, apply 1/global_scale
    if SWAP_AB:
        mn_off = rm[None, :] * N + offs_n[:, None]
        y_off = rm[None, :] * stride_ym + offs_n[:, None]
        mask = n_mask[:, None] & m_mask[None, :]
    else:
        mn_off = rm[:, None] * N + offs_n[None, :]
        y_off = rm[:, None] * stride_ym + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if SWAP_AB:
            bias = bias[:, None]
        else:
            bias = bias[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc = acc + bias
        tl.store(y_ptr + y_off, acc.to(dtype), mask=mask)
    else:
        MN = (tl.zeros([], tl.int64) + M) * N  # int64 (M may arrive as a constexpr 1)
        tl.store(ws_ptr + pid_k.to(tl.int64) * MN + mn_off, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is issued before the counter's release
        tile = pid_m * grid_n + pid_n
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            tot = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(SPLIT_K):  # fixed order: bitwise reproducible
                tot += tl.load(ws_ptr + s * MN + mn_off, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot = tot + bias
            tl.store(y_ptr + y_off, tot.to(dtype), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch (CUDA-graph replays)


@triton.jit
def nvfp4_bwd_kernel(
    dy_ptr, w_ptr, s_ptr, gs_ptr, dx_ptr,
    M, N, K, stride_dym, stride_dxm, stride_wn, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, USE_ASM: tl.constexpr,
):
    """dx[M, K] = dy[M, N] @ W[N, K]: reduction over the weight's rows; W tiles [BLOCK_N, BLOCK_K] are
    dequantized in registers in their natural orientation (the MMA's B operand), never stored in bf16."""
    dtype = dx_ptr.dtype.element_ty
    pid = tl.program_id(0)
    pid_m, pid_k = _swizzle(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_K), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    kw = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    ks = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    rm = offs_m.to(tl.int64)
    m_mask = offs_m < M
    kw_mask = kw < K // 8
    ks_mask = ks < K // 16
    ar_n = tl.arange(0, BLOCK_N)
    dy_base = dy_ptr + rm[:, None] * stride_dym + ar_n[None, :]
    w_base = w_ptr + ar_n.to(tl.int64)[:, None] * stride_wn + kw[None, :]
    s_base = s_ptr + ar_n.to(tl.int64)[:, None] * stride_sn + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n_mask = ar_n < N - n0
        dy = tl.load(dy_base + n0, mask=m_mask[:, None] & n_mask[None, :], other=0.0)
        words = tl.load(w_base + n0 * stride_wn, mask=n_mask[:, None] & kw_mask[None, :], other=0)
        sb = tl.load(s_base + n0 * stride_sn, mask=n_mask[:, None] & ks_mask[None, :], other=0)
        acc = tl.dot(dy, _dequant(words, sb, dtype, USE_ASM), acc)
    acc = acc * (128.0 / tl.load(gs_ptr))
    tl.store(dx_ptr + rm[:, None] * stride_dxm + offs_k[None, :], acc.to(dtype),
             mask=m_mask[:, None] & (offs_k[None, :] < K))


@triton.jit
def nvfp4_quant_kernel(
    w_ptr, gs_ptr, q_ptr, s_ptr, N, K, stride_wn,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, OBS_BF16: tl.constexpr, RECIP6: tl.constexpr,
):
    """Bit-exact twin of qerl.quant.nvfp4.quantize given the global scale (one pass over W).

    OBS_BF16: bf16 weights round amax/6 in bf16 (the observer dtype). RECIP6: torch on CUDA divides by the
    Python scalar 6 as a multiply by fp32(1/6); on the CPU it divides. All other divisions are IEEE (div_rn).
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    r_mask = rows < N
    mask = r_mask[:, None] & (cols[None, :] < K)
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0)
    w = tl.reshape(w.to(tl.float32), [BLOCK_R, BLOCK_C // 16, 16])
    amax = tl.max(tl.abs(w), axis=2)
    if RECIP6:
        q = amax * 0.16666667163372040  # fp32(1/6)
    else:
        q = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
    if OBS_BF16:  # round to bf16, nearest-even, with integer ops (the interpreter's cast truncates)
        qb = q.to(tl.int32, bitcast=True)
        q = ((qb + 0x7FFF + ((qb >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    gs = tl.load(gs_ptr)
    code = _e4m3_rne(tl.minimum(gs * q, 448.0))
    code = tl.where(code == 0, 0x20, code)  # all-zero block -> scale 0.125 (e4m3 0x20)
    eff = tl.math.div_rn(_e4m3_decode(code), tl.full(code.shape, 1.0, tl.float32) * gs)
    v = tl.math.div_rn(w, eff[:, :, None] + tl.zeros(w.shape, tl.float32))
    a = tl.abs(v)
    idx = ((a > 0.25).to(tl.int32) + (a > _B1).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a > _B3).to(tl.int32) + (a > 2.5).to(tl.int32) + (a > _B5).to(tl.int32)
           + (a > 5.0).to(tl.int32))
    c = idx | tl.where(v < 0, 8, 0)
    lo, hi = tl.split(tl.reshape(c, [BLOCK_R, BLOCK_C // 2, 2]))
    pc = pid_c * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * (K // 2) + pc[None, :], (lo | (hi << 4)).to(tl.uint8),
             mask=r_mask[:, None] & (pc[None, :] < K // 2))
    sc = pid_c * (BLOCK_C // 16) + tl.arange(0, BLOCK_C // 16)
    tl.store(s_ptr + rows.to(tl.int64)[:, None] * (K // 16) + sc[None, :], code.to(tl.uint8),
             mask=r_mask[:, None] & (sc[None, :] < K // 16))
