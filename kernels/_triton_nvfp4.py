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
_B1 = tl.constexpr(0.7499999403953552)  # nextafter(0.75, 0)
_B3 = tl.constexpr(1.7499998807907104)  # nextafter(1.75, 0)
_B5 = tl.constexpr(3.4999997615814210)  # nextafter(3.5, 0)

# Inline PTX, 4 words (32 codes) per call (pack=4): $16..$19 = words w0..w3, $20/$21 = block-scale pairs for
# (w0, w1)/(w2, w3); output slot j (= column 8g+j) gets registers $(2j) = (w0, w1) and $(2j+1) = (w2, w3) as
# packed pairs. Per pair: PRMT gathers nibble j of both words into bits 0-3 / 16-19 (the sign-replicate selector
# of a masked byte gives the zero bytes), one IMAD by 0x1040 copies each nibble to <<6 (magnitude -> bf16 bits
# 6-8) and <<12 (sign -> bit 15) without overlap, one LOP3 masks, one packed FMA applies the scale.
_SEL = ("0x8480", "0x8480", "0x9591", "0x9591", "0xA6A2", "0xA6A2", "0xB7B3", "0xB7B3")  # byte j//2


def _deq_asm(bf16: bool) -> str:
    lines = ["{", ".reg .b32 l0, l1, h0, h1, v, t, z;", "mov.b32 z, 0x80008000;"]
    for half, (wa, wb, sc) in enumerate((("$16", "$17", "$20"), ("$18", "$19", "$21"))):
        lines += [f"and.b32 l0, {wa}, 0x0F0F0F0F; shr.b32 h0, {wa}, 4; and.b32 h0, h0, 0x0F0F0F0F;",
                  f"and.b32 l1, {wb}, 0x0F0F0F0F; shr.b32 h1, {wb}, 4; and.b32 h1, h1, 0x0F0F0F0F;"]
        for j in range(8):
            src = "h0, h1" if j % 2 else "l0, l1"
            if bf16:
                bits = "mul.lo.u32 v, v, 0x1040; and.b32 v, v, 0x81C081C0;"
                fma = "fma.rn.bf16x2"
            else:  # fp16: magnitude -> bits 9-11 overlaps the sign's copy, so two shifts
                bits = "shl.b32 t, v, 9; and.b32 t, t, 0x0E000E00; shl.b32 v, v, 12; and.b32 v, v, 0x80008000; or.b32 v, v, t;"
                fma = "fma.rn.f16x2"
            lines.append(f"prmt.b32 v, {src}, {_SEL[j]}; {bits} {fma} ${2 * j + half}, v, {sc}, z;")
    return "\n".join(lines + ["}"])


def _scale_asm(bf16: bool) -> str:
    """4 e4m3 scale bytes ($2) -> 4 bf16 (fp16) values s * 2^119 (s * 2^7) in $0, $1; exact. The hardware
    e4m3x2 -> f16x2 convert, then a re-bias of the exponent (bf16: shift the f16 fields down by 3); zero
    scales are masked back to zero (PRMT replicates each half's 'nonzero' bit)."""
    rebias = ("shr.b32 a, a, 3; and.b32 a, a, 0x0FFF0FFF; add.u32 a, a, 0x73807380;" if bf16
              else "add.u32 a, a, 0x1C001C00;")
    lines = ["{", ".reg .b16 lo, hi; .reg .b32 a, m;", "mov.b32 {lo, hi}, $2;"]
    for out, src in (("$0", "lo"), ("$1", "hi")):
        lines.append(f"cvt.rn.f16x2.e4m3x2 a, {src}; add.u32 m, a, 0x7FFF7FFF; prmt.b32 m, m, 0, 0xBB99; "
                     f"{rebias} and.b32 {out}, a, m;")
    return "\n".join(lines + ["}"])


DEQ_BF16 = tl.constexpr(_deq_asm(True))  # jit code may only read constexpr globals
DEQ_FP16 = tl.constexpr(_deq_asm(False))
SCALE_BF16 = tl.constexpr(_scale_asm(True))
SCALE_FP16 = tl.constexpr(_scale_asm(False))


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
    """int32 words [R, C/8] + e4m3 scale bytes [R, C/16] -> [R, C] in dtype, = W * global_scale * 2^-7,
    columns in tile order kappa = j * C/8 + g for k = 8g + j. The GEMMs give x the same
    order (a dot product does not care), and then every register the decoder packs (slot j of words g, g+1)
    holds two adjacent columns: the tile goes to shared memory for the MMA as is, with no repacking of
    halves and no layout-conversion round trips (measured on the SASS: 683 -> 480 instructions per
    128x128 decode tile, 33 -> 2 barriers)."""
    if USE_ASM:
        if dtype == tl.bfloat16:
            s = tl.inline_asm_elementwise(SCALE_BF16, "=r,=r,r", [sbytes], dtype=tl.bfloat16, is_pure=True, pack=4)
            s2 = tl.interleave(s, s)  # one scale per 16 columns = per 2 words
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                DEQ_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r", [words, s2],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=4)
        else:
            s = tl.inline_asm_elementwise(SCALE_FP16, "=r,=r,r", [sbytes], dtype=tl.float16, is_pure=True, pack=4)
            s2 = tl.interleave(s, s)
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                DEQ_FP16, "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r", [words, s2],
                dtype=(tl.float16,) * 8, is_pure=True, pack=4)
    else:
        s2 = _e4m3_decode(sbytes) * 0.0078125  # * 2^-7
        s2 = tl.interleave(s2, s2)
        o0 = _nib(words, 0, s2, dtype)
        o1 = _nib(words, 1, s2, dtype)
        o2 = _nib(words, 2, s2, dtype)
        o3 = _nib(words, 3, s2, dtype)
        o4 = _nib(words, 4, s2, dtype)
        o5 = _nib(words, 5, s2, dtype)
        o6 = _nib(words, 6, s2, dtype)
        o7 = _nib(words, 7, s2, dtype)
    R: tl.constexpr = words.shape[0]
    G: tl.constexpr = words.shape[1]
    # joins append dims (j&1, j&2, j&4): t[r, g, b0, b1, b2] = o_{b0 + 2 b1 + 4 b2}[r, g]
    t = tl.join(tl.join(tl.join(o0, o1), tl.join(o2, o3)), tl.join(tl.join(o4, o5), tl.join(o6, o7)))
    return tl.reshape(tl.permute(t, (0, 4, 3, 2, 1)), [R, 8 * G])


@triton.jit
def _perm_cols(x):
    """[R, C] natural columns -> tile order: kappa = j * C/8 + g holds column 8g + j."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    return tl.reshape(tl.permute(tl.reshape(x, [R, C // 8, 8]), (0, 2, 1)), [R, C])


@triton.jit
def _unperm_cols(x):
    """[R, C] tile-order columns (kappa = j * C/8 + g) back to natural order (column 8g + j)."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    return tl.reshape(tl.permute(tl.reshape(x, [R, 8, C // 8]), (0, 2, 1)), [R, C])


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
    M, N, K, stride_xm, stride_ym, stride_wn, stride_sn, split_k,
    HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, X_MODE: tl.constexpr,
):
    """y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W dequantized tile by tile in registers.

    SWAP_AB computes y^T = W @ x^T so that the weight rows fill the MMA's 64-row side and a decode batch
    of 1..64 tokens is the narrow side (no wasted tensor-core rows, weights streamed once).
    x must meet W in _dequant's tile column order (X_MODE): 0 = the caller permuted x once (permute_x_cols),
    tiles go global -> shared by cp.async untouched; 1 = gathered with permuted addresses (2-byte loads, not
    pipelined); 2 = loaded contiguously and permuted in registers. With 0 and 1 the decoded W tile feeds the
    wgmma A registers directly (SASS: no STS/LDSM for W); with 2 Triton routes W through shared memory,
    but x loads stay pipelined (fastest at M <= 16 on H200).
    SPLIT (split_k > 1 programs along grid axis 1): program (tile, k) writes an fp32 partial; the last program of a tile (counter) sums the
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
    if X_MODE == 1:  # x straight in tile column order: kappa = j * BK/8 + g reads column 8g + j
        x_col = 8 * (ar_k % (BLOCK_K // 8)) + ar_k // (BLOCK_K // 8)
    else:
        x_col = ar_k
    x_base = x_ptr + rm[:, None] * stride_xm + x_col[None, :]
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    KW = K // 8
    KS = K // 16

    iters = tl.cdiv(tl.cdiv(K, BLOCK_K), split_k)
    k_begin = pid_k * iters * BLOCK_K
    k_end = tl.minimum(K, k_begin + iters * BLOCK_K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:  # K % BLOCK_K == 0: only row masks (constant along each vector: 16-byte loads)
            words = tl.load(w_base + k0 // 8, mask=n_mask[:, None], other=0)
            sb = tl.load(s_base + k0 // 16, mask=n_mask[:, None], other=0)
            xa = tl.load(x_base + k0, mask=m_mask[:, None], other=0.0)
        else:
            words = tl.load(w_base + k0 // 8, mask=n_mask[:, None] & (ar_w[None, :] < KW - k0 // 8), other=0)
            sb = tl.load(s_base + k0 // 16, mask=n_mask[:, None] & (ar_s[None, :] < KS - k0 // 16), other=0)
            xa = tl.load(x_base + k0, mask=m_mask[:, None] & (x_col[None, :] < K - k0), other=0.0)
        w = _dequant(words, sb, dtype, USE_ASM)  # [BLOCK_N, BLOCK_K], tile column order
        if X_MODE == 2:
            xa = _perm_cols(xa)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(xa), acc)
        else:
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
    if not SPLIT:
        if HAS_BIAS:
            acc = acc + bias
        tl.store(y_ptr + y_off, acc.to(dtype), mask=mask)
    else:
        MN = (tl.zeros([], tl.int64) + M) * N  # int64 (M may arrive as a constexpr 1)
        tl.store(ws_ptr + pid_k.to(tl.int64) * MN + mn_off, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is issued before the counter's release
        tile = pid_m * grid_n + pid_n
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == split_k - 1:
            tot = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(split_k):  # fixed order: bitwise reproducible
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
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr,
):
    """dx[M, K] = dy[M, N] @ W[N, K]: reduction over the weight's rows; W tiles [BLOCK_N, BLOCK_K] are
    dequantized in registers as the MMA's B operand (never materialized in bf16 in global memory); their
    columns come in tile order, so the accumulator is un-permuted once before the store."""
    dtype = dx_ptr.dtype.element_ty
    pid = tl.program_id(0)
    pid_m, pid_k = _swizzle(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_K), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    kw = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    ks = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    rm = offs_m.to(tl.int64)
    m_mask = offs_m < M
    kw_mask = (kw < K // 8) | EVEN_K
    ks_mask = (ks < K // 16) | EVEN_K
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
    acc = _unperm_cols(acc * (128.0 / tl.load(gs_ptr)))  # W's output columns came in tile order
    tl.store(dx_ptr + rm[:, None] * stride_dxm + offs_k[None, :], acc.to(dtype),
             mask=m_mask[:, None] & (offs_k[None, :] < K))


@triton.jit
def nvfp4_quant_kernel(
    w_ptr, gs_ptr, q_ptr, s_ptr, N, K, stride_wn,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, OBS_BF16: tl.constexpr,
):
    """Bit-exact twin of qerl.quant.nvfp4.quantize given the global scale (one pass over W).

    OBS_BF16: bf16 weights round amax/6 in bf16 (the observer dtype). Every division is IEEE (div_rn), as
    torch's on both devices: a multiply by fp32(1/6) instead flips 2033 of 1M block scales of an fp16 weight.
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


@triton.jit
def nvfp4_dequant_kernel(
    w_ptr, s_ptr, gs_ptr, out_ptr, N, K, stride_wn, stride_sn,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, USE_ASM: tl.constexpr,
):
    """W[N, K] = e2m1 * scale / global_scale in out's dtype (bf16/fp16), one pass: the fast replacement for
    the PyTorch dequantize (LoRA merges, exports, the dequant+cuBLAS comparison in the benchmark)."""
    dtype = out_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c0 = tl.program_id(1) * BLOCK_C
    cw = c0 // 8 + tl.arange(0, BLOCK_C // 8)
    cs = c0 // 16 + tl.arange(0, BLOCK_C // 16)
    r_mask = rows[:, None] < N
    rr = rows.to(tl.int64)[:, None]
    words = tl.load(w_ptr + rr * stride_wn + cw[None, :], mask=r_mask & (cw[None, :] < K // 8), other=0)
    sb = tl.load(s_ptr + rr * stride_sn + cs[None, :], mask=r_mask & (cs[None, :] < K // 16), other=0)
    w = _unperm_cols(_dequant(words, sb, dtype, USE_ASM).to(tl.float32) * (128.0 / tl.load(gs_ptr)))
    cols = c0 + tl.arange(0, BLOCK_C)
    tl.store(out_ptr + rr * K + cols[None, :], w.to(dtype), mask=r_mask & (cols[None, :] < K))


@triton.jit
def table_layout_dequant_kernel(
    w_ptr, s_ptr, gs_ptr, code_tbl_ptr, scale_tbl_ptr, out_ptr, N, K, XOR,
    BLOCK_KB: tl.constexpr, BLOCK_NB: tl.constexpr, TRANSPOSED: tl.constexpr,
):
    """W (or W^T) in out's dtype from an NVFP4 weight stored in a tiled, permuted layout (humming-kernels'):
    for k-block kb = k // 16 and n-block nb = n // 64, the 1024 codes of that 16 x 64 patch live in 128 int32
    words at kb * 2N + nb * 128, code (n, k) in word code_tbl[n % 64, k % 16] >> 3, nibble & 7 (xor'ed with
    XOR); its e4m3 block scale at kb * N + nb * 64 + scale_tbl[n % 64]. Both tables are probed from the
    library once (kernels/humming_nvfp4.py). Values are e2m1 * (scale / global_scale) in fp32, then one
    rounding: bit-identical to qerl.quant.nvfp4.dequantize. out is [K, N] if TRANSPOSED else [N, K]."""
    dtype = out_ptr.dtype.element_ty
    kk = tl.program_id(0) * (BLOCK_KB * 16) + tl.arange(0, BLOCK_KB * 16)
    nn = tl.program_id(1) * (BLOCK_NB * 64) + tl.arange(0, BLOCK_NB * 64)
    mask = (kk[:, None] < K) & (nn[None, :] < N)
    kb = (kk // 16).to(tl.int64)
    nr = nn % 64
    t = tl.load(code_tbl_ptr + nr[None, :] * 16 + (kk % 16)[:, None])
    word = tl.load(w_ptr + kb[:, None] * (2 * N) + (nn - nr)[None, :] * 2 + (t >> 3), mask=mask, other=0)
    c = ((word >> ((t & 7) * 4)) & 15) ^ XOR
    idx = c & 7
    big = ((((idx >> 1) + 126) << 23) | ((idx & 1) << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(idx < 2, idx.to(tl.float32) * 0.5, big)
    # the sign as a bit: `-mag` compiles to 0 - mag on the GPU, which turns E2M1's -0 into +0
    val = (mag.to(tl.int32, bitcast=True) | ((c & 8) << 28)).to(tl.float32, bitcast=True)
    sp = tl.load(scale_tbl_ptr + nr)
    sb = tl.load(s_ptr + kb[:, None] * N + (nn - nr + sp)[None, :], mask=mask, other=0)
    gs = tl.load(gs_ptr)
    eff = tl.math.div_rn(_e4m3_decode(sb), tl.full(sb.shape, 1.0, tl.float32) * gs)
    w = (val * eff).to(dtype)
    if TRANSPOSED:
        tl.store(out_ptr + kk.to(tl.int64)[:, None] * N + nn[None, :], w, mask=mask)
    else:
        tl.store(out_ptr + nn.to(tl.int64)[None, :] * K + kk[:, None], w, mask=mask)
