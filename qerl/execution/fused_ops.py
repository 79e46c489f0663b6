"""Triton kernels of the fused decode step (`Transformer.decode_step(fused=True)`), with their launchers.

Each kernel mirrors the PyTorch ops it replaces, including the intermediate roundings to the activation dtype
(RMSNorm rounds the normalized x before the weight multiply; RoPE runs in fp32; SiLU rounds before the product),
so the fused step stays within ~1 ulp of `Transformer.forward`. They run on CUDA, and on CPU tensors under
Triton's interpreter (TRITON_INTERPRET=1, tests). The model calls them; the rollout engine does not.

LoRA in the decode step (see `qerl.model.lora.DeferredLoRA`): `lora_shrink` computes h = x·Aᵀ in one launch, and
the kernel that reads a projection's output next (RoPE + KV write for q/k/v, SiLU·up for gate/up, add + RMSNorm for
o and down) adds s·h·Bᵀ to it before its rounding, as one addmm would: no launch of its own for LoRA's B product.

Here rather than in `kernels/`: that package holds the NVFP4 GEMM kernels behind `QuantLinear` (optional, loaded
lazily); these belong to the model's decode step and are small enough to read next to it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qerl import debug
from qerl.kernels import pdl

try:  # optional: the fused decode kernels (CUDA, or CPU under TRITON_INTERPRET=1 in tests)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - no triton, or a broken install
    triton = None


if triton is not None:
    try:  # Triton >= 3.4: programmatic dependent launch (kernels/pdl.py)
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except Exception:  # pragma: no cover - never called: kernels/pdl.py then launches with PDL false
        gdc_launch_dependents = gdc_wait = None

    @triton.jit
    def _after_previous(PDL: tl.constexpr):
        """Under programmatic dependent launch (kernels/pdl.py): wait until the previous kernel in the stream has
        finished and its writes are visible, then let the next kernel's programs start. Called first: these kernels
        read their inputs, or write a buffer the previous one may read, from the start."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def _add_rmsnorm_kernel(X, R, W, Y, N, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """X[row] += R[row] (in place, rounded like a bf16 add), Y[row] = W * rmsnorm(X[row])."""
        _after_previous(PDL)
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
                           HL, LB, s_hl, s_lb, lr_scale, q_col, q_rank, k_col, k_rank, v_col, v_rank, k_row0, v_row0,
                           D: tl.constexpr, HALF: tl.constexpr, QK_NORM: tl.constexpr, LOW_RANK: tl.constexpr,
                           RP: tl.constexpr, KV8: tl.constexpr, PDL: tl.constexpr):
        """`_rope_cache` with one token per cache row, every row at the one cache slot SLOT [1] (a decode step).
        Its own kernel rather than `_rope_cache_rows_kernel` at QPR 1 and slot stride 0: those are constants here,
        folded away, so this launch compiles to the code it had before per-row slots existed."""
        _after_previous(PDL)
        _rope_cache(Q, K, V, COS, SIN, QO, KC, VC, SLOT, 0, 1, QW, KW, eps, H, s_b, s_h, s_s, s_q, s_k, s_v, HL, LB,
                    s_hl, s_lb, lr_scale, q_col, q_rank, k_col, k_rank, v_col, v_rank, k_row0, v_row0, D, HALF,
                    QK_NORM, LOW_RANK, RP, KV8)

    @triton.jit
    def _rope_cache_rows_kernel(Q, K, V, COS, SIN, QO, KC, VC, SLOT, s_slot, QPR, QW, KW, eps, H, HKV, s_b, s_h, s_s,
                                s_q, s_k, s_v, HL, LB, s_hl, s_lb, lr_scale, q_col, q_rank, k_col, k_rank, v_col,
                                v_rank, k_row0, v_row0, D: tl.constexpr, HALF: tl.constexpr, QK_NORM: tl.constexpr,
                                LOW_RANK: tl.constexpr, RP: tl.constexpr, KV8: tl.constexpr, PDL: tl.constexpr):
        """`_rope_cache` with QPR query rows per cache row, query row i at slot SLOT[i * s_slot] (speculative
        decoding's verify step: a row's drafted tokens at consecutive slots; or rows at slots of their own)."""
        _after_previous(PDL)
        _rope_cache(Q, K, V, COS, SIN, QO, KC, VC, SLOT, s_slot, QPR, QW, KW, eps, H, s_b, s_h, s_s, s_q, s_k, s_v,
                    HL, LB, s_hl, s_lb, lr_scale, q_col, q_rank, k_col, k_rank, v_col, v_rank, k_row0, v_row0, D,
                    HALF, QK_NORM, LOW_RANK, RP, KV8)

    @triton.jit
    def _rope_cache(Q, K, V, COS, SIN, QO, KC, VC, SLOT, s_slot, QPR, QW, KW, eps, H, s_b, s_h, s_s, s_q, s_k, s_v,
                    HL, LB, s_hl, s_lb, lr_scale, q_col, q_rank, k_col, k_rank, v_col, v_rank, k_row0, v_row0,
                    D: tl.constexpr, HALF: tl.constexpr, QK_NORM: tl.constexpr, LOW_RANK: tl.constexpr,
                    RP: tl.constexpr, KV8: tl.constexpr):
        """Program (query row, head): heads < H rotate q into QO; the rest rotate k and write k, v into cache row
        row // QPR at slot SLOT[row * s_slot] (s_slot 0: one slot for every row). s_q, s_k, s_v: row strides of q,
        k, v (column slices of one fused qkv output). LOW_RANK: q, k, v are the fused output's base part; LoRA's
        update s·h·LBᵀ (rows of LB: q from 0, k from k_row0, v from v_row0; each member's rank block from its
        column) is added first, with the rounding of one addmm. KV8: the caches are in the FP8 layout of
        qerl.execution.kv8 (uint8; strides in bytes), k and v written as their bf16 roundings' codes and scales."""
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
        if LOW_RANK:
            if head < H:
                n0 = head * D
                col = q_col
                rank = q_rank
            else:
                n0 = k_row0 + (head - H) * D
                col = k_col
                rank = k_rank
            hr = HL + row * s_hl
            x1 = (x1.to(tl.float32) + lr_scale * _low_rank_rows(hr, LB, s_lb, n0 + offs, col, rank, RP)).to(x1.dtype)
            x2 = (x2.to(tl.float32)
                  + lr_scale * _low_rank_rows(hr, LB, s_lb, n0 + HALF + offs, col, rank, RP)).to(x2.dtype)
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
            # int64: big caches pass 2**31 elements
            at = (row // QPR).to(tl.int64) * s_b + kvh * s_h + tl.load(SLOT + row * s_slot) * s_s
            if KV8:
                _store_kv8(KC + at, o1, o2, offs, HALF, D)
            else:
                tl.store(KC + at + offs, o1.to(KC.dtype.element_ty))
                tl.store(KC + at + HALF + offs, o2.to(KC.dtype.element_ty))
            v_in = V + row * s_v + kvh * D
            v1 = tl.load(v_in + offs)
            v2 = tl.load(v_in + HALF + offs)
            if LOW_RANK:
                hv = HL + row * s_hl
                n0v = v_row0 + kvh * D
                v1 = (v1.to(tl.float32) + lr_scale * _low_rank_rows(hv, LB, s_lb, n0v + offs, v_col, v_rank, RP)
                      ).to(v1.dtype)
                v2 = (v2.to(tl.float32)
                      + lr_scale * _low_rank_rows(hv, LB, s_lb, n0v + HALF + offs, v_col, v_rank, RP)).to(v2.dtype)
            if KV8:
                _store_kv8(VC + at, v1, v2, offs, HALF, D)
            else:
                tl.store(VC + at + offs, v1.to(VC.dtype.element_ty))
                tl.store(VC + at + HALF + offs, v2.to(VC.dtype.element_ty))

    @triton.jit
    def _store_kv8(dst, x1, x2, offs, HALF: tl.constexpr, D: tl.constexpr):
        """One vector (its halves x1, x2) in the FP8 KV layout at dst (uint8), as qerl.execution.kv8.pack writes it:
        E4M3 codes of x / s (round to nearest even), then s = max |x| / 448 as fp32 (0 for a zero vector)."""
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(f1), axis=0), tl.max(tl.abs(f2), axis=0)) / 448.0
        c1 = tl.where(s > 0, f1 / s, 0.0).to(tl.float8e4nv)
        c2 = tl.where(s > 0, f2 / s, 0.0).to(tl.float8e4nv)
        tl.store(dst + offs, c1.to(tl.uint8, bitcast=True))
        tl.store(dst + HALF + offs, c2.to(tl.uint8, bitcast=True))
        tl.store((dst + D).to(tl.pointer_type(tl.float32), bitcast=True), s)

    @triton.jit
    def _silu_mul_kernel(G, U, O, n, s_g, s_u, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Program (row, block): O[row] = silu(G[row]) * U[row] over n columns; s_g, s_u: row strides of G and U
        (the two halves of one fused gate_up output), O contiguous."""
        _after_previous(PDL)
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        g = tl.load(G + row * s_g + offs, mask=m, other=0.0)
        u = tl.load(U + row * s_u + offs, mask=m, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        tl.store(O + row * n + offs, (act * u.to(tl.float32)).to(O.dtype.element_ty), mask=m)


if triton is not None:

    @triton.jit
    def _lora_shrink_kernel(X, A, H, PART, COUNT, M, K, R, s_x, s_h, chunk, splits, BM: tl.constexpr,
                            RP: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
        """Program (split, row block, rank block): h[rows, ranks] = x[rows] · A[ranks]ᵀ over K in `splits` chunks.
        Each program writes its fp32 share to a slot; the last of a tile's programs to finish (a counter it resets
        for the next launch) sums the slots in slot order and rounds once: the same bits whichever program ran
        last, and one launch instead of cuBLAS' split-K GEMM + reduce."""
        _after_previous(PDL)
        split, mb, rb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = mb * BM + tl.arange(0, BM)
        ranks = rb * RP + tl.arange(0, RP)
        acc = tl.zeros((BM, RP), tl.float32)
        k_end = tl.minimum((split + 1) * chunk, K)
        for k0 in range(split * chunk, k_end, BK):
            ks = k0 + tl.arange(0, BK)
            x = tl.load(X + rows[:, None] * s_x + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < k_end),
                        other=0.0)
            a = tl.load(A + ranks[None, :] * K + ks[:, None], mask=(ranks[None, :] < R) & (ks[:, None] < k_end),
                        other=0.0)
            acc += tl.dot(x, a, input_precision="ieee")
        tile = mb * tl.num_programs(2) + rb
        cells = tl.arange(0, BM)[:, None] * RP + tl.arange(0, RP)[None, :]
        slots = PART + tile.to(tl.int64) * splits * BM * RP
        tl.store(slots + split * BM * RP + cells, acc)
        tl.debug_barrier()  # every thread's share is stored before the counter's release
        done = tl.atomic_add(COUNT + tile, 1, sem="acq_rel", scope="gpu")
        if done == splits - 1:
            total = tl.zeros((BM, RP), tl.float32)
            for s_ in range(0, splits):
                total += tl.load(slots + s_ * BM * RP + cells, cache_modifier=".cg")
            tl.store(H + rows[:, None] * s_h + ranks[None, :], total.to(H.dtype.element_ty),
                     mask=(rows[:, None] < M) & (ranks[None, :] < R))
            tl.atomic_xchg(COUNT + tile, 0)  # ready for the next launch (CUDA-graph replays)

    @triton.jit
    def _low_rank_rows(HR, B, s_b, n, col, rank, RP: tl.constexpr):
        """Σ_r h[r] · B[n, col + r] for the rows n [BLOCK] of B and one row's h (HR points at h[row, 0]), fp32."""
        r = tl.arange(0, RP)
        live = r < rank
        hv = tl.load(HR + col + r, mask=live, other=0.0).to(tl.float32)
        b = tl.load(B + n[:, None] * s_b + (col + r)[None, :], mask=live[None, :], other=0.0).to(tl.float32)
        return tl.sum(b * hv[None, :], axis=1)

    @triton.jit
    def _add_low_rank_rmsnorm_kernel(X, R, HL, B, W, Y, PART, COUNT, A, HO, N, eps, s_hl, s_b, col, rank, lr_scale,
                                     rank_out, s_ho, HAS_RES: tl.constexpr, HAS_IN: tl.constexpr,
                                     HAS_OUT: tl.constexpr, RP: tl.constexpr, RPO: tl.constexpr, CH: tl.constexpr,
                                     CHUNKS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Program (row, chunk of CH columns) of add + RMSNorm with LoRA on both sides:
        HAS_IN: the residual R is a LoRA projection's base output, finished here (R + s·h·Bᵀ, rounded as one addmm
        rounds) before it is added into X (in place, rounded like a bf16 add);
        HAS_OUT: the next projection's x·Aᵀ (A [rank_out, N]) of the normed row goes to HO, as
        rstd · Σ_chunks (W ⊙ X)·Aᵀ (RMSNorm's row scale commutes with the product: each program sums its chunk
        before rstd is known), rounded once.
        Each program stores its chunk's sum of squares (and its share of x·Aᵀ) to slots; the last of the row's
        programs to finish (a counter it resets) writes Y[row] = W * rmsnorm(X[row]) and HO[row]. B's and A's rows
        are spread over the row's programs instead of read by one."""
        _after_previous(PDL)
        row, chunk = tl.program_id(0), tl.program_id(1)
        n = chunk * CH + tl.arange(0, CH)
        m = n < N
        x = tl.load(X + row * N + n, mask=m, other=0.0)
        if HAS_RES:
            res = tl.load(R + row * N + n, mask=m, other=0.0)
            if HAS_IN:
                upd = _low_rank_rows(HL + row * s_hl, B, s_b, tl.where(m, n, 0), col, rank, RP)
                res = (res.to(tl.float32) + lr_scale * upd).to(res.dtype)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(X.dtype.element_ty)
            tl.store(X + row * N + n, x, mask=m)
        xf = tl.where(m, x.to(tl.float32), 0.0)  # masked lanes may hold B row 0's update
        tl.store(PART + row * CHUNKS + chunk, tl.sum(xf * xf, axis=0))
        if HAS_OUT:
            ro = tl.arange(0, RPO)
            a = tl.load(A + ro[None, :] * N + n[:, None], mask=m[:, None] & (ro < rank_out)[None, :], other=0.0)
            xw = xf * tl.load(W + n, mask=m, other=0.0).to(tl.float32)
            shares_at = PART + tl.num_programs(0) * CHUNKS + (row * CHUNKS + chunk) * RPO
            tl.store(shares_at + ro, tl.sum(a.to(tl.float32) * xw[:, None], axis=0))
        tl.debug_barrier()  # every thread's stores are issued before the counter's release
        done = tl.atomic_add(COUNT + row, 1, sem="acq_rel", scope="gpu")
        if done == CHUNKS - 1:
            c = tl.arange(0, BLOCK // CH)  # BLOCK // CH >= CHUNKS: both powers of two
            sq = tl.load(PART + row * CHUNKS + c, mask=c < CHUNKS, other=0.0, cache_modifier=".cg")
            rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / N + eps)
            offs = tl.arange(0, BLOCK)
            mm = offs < N
            xs = tl.load(X + row * N + offs, mask=mm, other=0.0, cache_modifier=".cg")
            normed = (xs.to(tl.float32) * rstd).to(X.dtype.element_ty).to(tl.float32)
            w = tl.load(W + offs, mask=mm, other=0.0).to(tl.float32)
            tl.store(Y + row * N + offs, (w * normed).to(Y.dtype.element_ty), mask=mm)
            if HAS_OUT:
                ro = tl.arange(0, RPO)
                shares = tl.load(PART + tl.num_programs(0) * CHUNKS + (row * CHUNKS + c[:, None]) * RPO + ro[None, :],
                                 mask=(c < CHUNKS)[:, None], other=0.0, cache_modifier=".cg")
                tl.store(HO + row * s_ho + ro, (tl.sum(shares, axis=0) * rstd).to(HO.dtype.element_ty),
                         mask=ro < rank_out)
            tl.atomic_xchg(COUNT + row, 0)  # ready for the next launch (CUDA-graph replays)

    @triton.jit
    def _low_rank_tile(HL, LB, s_hl, s_lb, rows, row_live, n, n_live, col, rank, RP: tl.constexpr):
        """h[rows, col:col+rank] · LB[n, col:col+rank]ᵀ, a [rows, n] fp32 tile (one tensor-core product)."""
        r = tl.arange(0, RP)
        live = r < rank
        h = tl.load(HL + rows[:, None] * s_hl + (col + r)[None, :], mask=row_live[:, None] & live[None, :], other=0.0)
        bt = tl.load(LB + n[None, :] * s_lb + (col + r)[:, None], mask=live[:, None] & n_live[None, :], other=0.0)
        return tl.dot(h, bt, input_precision="ieee")

    @triton.jit
    def _silu_mul_low_rank_kernel(G, U, O, HL, LB, M, n, s_g, s_u, s_hl, s_lb, lr_scale, g_col, g_rank, u_col,
                                  u_rank, u_row0, BM: tl.constexpr, RP: tl.constexpr, BLOCK: tl.constexpr,
                                  PDL: tl.constexpr):
        """Program (row block, column block): `_silu_mul_kernel` on gate and up that are a fused gate_up output's
        base part: LoRA's update s·h·LBᵀ (gate's rows of LB from 0, up's from u_row0) is added to each first, with
        the rounding of one addmm. BM rows per program, so B's tile is read once per BM rows."""
        _after_previous(PDL)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        row_live, col_live = rows < M, cols < n
        m = row_live[:, None] & col_live[None, :]
        g = tl.load(G + rows[:, None] * s_g + cols[None, :], mask=m, other=0.0)
        u = tl.load(U + rows[:, None] * s_u + cols[None, :], mask=m, other=0.0)
        g = (g.to(tl.float32) + lr_scale * _low_rank_tile(HL, LB, s_hl, s_lb, rows, row_live, cols, col_live, g_col,
                                                          g_rank, RP)).to(g.dtype)
        u = (u.to(tl.float32) + lr_scale * _low_rank_tile(HL, LB, s_hl, s_lb, rows, row_live, u_row0 + cols, col_live,
                                                          u_col, u_rank, RP)).to(u.dtype)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        tl.store(O + rows[:, None] * n + cols[None, :], (act * u.to(tl.float32)).to(O.dtype.element_ty), mask=m)


if triton is not None:

    @triton.jit
    def _sample_kernel(LOGITS, SEED, PART, COUNT, TOK, LOGP, V, stride, inv_t, chunk, splits, SP: tl.constexpr,
                       BLOCK: tl.constexpr, PER_ROW: tl.constexpr):
        """Program (row, split): one token drawn from softmax(logits * inv_t) by the exponential race (argmax of
        x - log(E), E = -log(U) ~ Exp(1), U ~ Philox uniforms keyed by SEED and the entry's index; PER_ROW (0 or 1):
        keyed by the row's own SEED[row] and the entry's index in its row), and its
        log-probability. Each program runs an online log-sum-exp and the race over its `chunk` of the vocabulary
        and stores (max, sum, best score, best index) to a slot; the last of the row's programs to finish (a
        counter it resets) combines them: the race's winner is the best of the splits' (the first on ties, as one
        pass would pick it), so the token does not depend on the split count."""
        row, split = tl.program_id(0), tl.program_id(1)
        seed = tl.load(SEED + row * PER_ROW)
        base = LOGITS + row.to(tl.int64) * stride
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        best = tl.full((), float("-inf"), tl.float32)
        best_idx = tl.zeros((), tl.int32)
        end = tl.minimum(split * chunk + chunk, V)
        for start in range(split * chunk, end, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < end
            x = tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, tl.max(x, axis=0))
            # Blocks of -inf (a logits processor's mask) before any finite entry: shift by 0, not by -inf, so that
            # exp(-inf - -inf) = NaN never enters the sum (it made the drawn token's log-prob NaN)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - shift) + tl.sum(tl.where(valid, tl.exp(x - shift), 0.0), axis=0)
            m = m_new
            u = tl.rand(seed, row * V * (1 - PER_ROW) + offs)
            score = tl.where(valid, x - tl.log(-tl.log(u)), float("-inf"))
            block_best = tl.max(score, axis=0)
            block_idx = tl.argmax(score, axis=0).to(tl.int32) + start
            best_idx = tl.where(block_best > best, block_idx, best_idx)
            best = tl.maximum(best, block_best)
        slot = PART + (row * splits + split) * 4
        tl.store(slot, m)
        tl.store(slot + 1, s)
        tl.store(slot + 2, best)
        tl.store(slot + 3, best_idx.to(tl.float32))  # exact: vocabularies are far below 2^24
        tl.debug_barrier()  # the slot is written before the counter's release
        if tl.atomic_add(COUNT + row, 1, sem="acq_rel", scope="gpu") == splits - 1:
            sp = tl.arange(0, SP)
            live = sp < splits
            slots = PART + (row * splits + sp) * 4
            ms = tl.load(slots, mask=live, other=float("-inf"), cache_modifier=".cg")
            ss = tl.load(slots + 1, mask=live, other=0.0, cache_modifier=".cg")
            bests = tl.load(slots + 2, mask=live, other=float("-inf"), cache_modifier=".cg")
            m_all = tl.max(ms, axis=0)
            s_all = tl.sum(tl.where(ms == float("-inf"), 0.0, ss * tl.exp(ms - m_all)), axis=0)
            tok = tl.load(PART + (row * splits + tl.argmax(bests, axis=0)) * 4 + 3, cache_modifier=".cg").to(tl.int32)
            x_tok = tl.load(base + tok).to(tl.float32) * inv_t
            tl.store(TOK + row, tok.to(tl.int64))
            tl.store(LOGP + row, x_tok - m_all - tl.log(s_all))
            tl.atomic_xchg(COUNT + row, 0)  # ready for the next launch


def fused_sample(logits: Tensor, temperature: float, generator: torch.Generator | None = None,
                 block: int = 1024, target_programs: int = 528, seeds: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(tokens [B] int64, log-probs [B] fp32) drawn from softmax(logits / temperature), logits [B, V] with unit
    stride along V: one kernel instead of the ~7 full-vocabulary passes of the PyTorch sampler. Draws the same
    distribution with other random numbers: one Philox seed per call, taken from `generator` on the device (no host
    synchronization), so seeded runs repeat exactly. The vocabulary is split so that about `target_programs`
    programs share the rows (a few rows alone would leave most SMs idle); `block`: entries per loop step (a power
    of two). The tokens do not depend on either. `seeds` (int64 [B] on the device, in [0, 2^31), instead of
    `generator`): each row's own Philox key, so a row draws the same token whatever rows share its batch."""
    if logits.stride(-1) != 1:
        raise ValueError(f"fused_sample needs unit stride along the vocabulary, got strides {logits.stride()}")
    rows, vocab = logits.shape
    seed = seeds if seeds is not None else torch.randint(0, 2**31 - 1, (1,), device=logits.device, generator=generator)
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    block = min(block, triton.next_power_of_2(vocab))
    blocks = triton.cdiv(vocab, block)
    splits = max(1, min(blocks, triton.cdiv(target_programs, max(rows, 1))))
    chunk = triton.cdiv(blocks, splits) * block
    splits = triton.cdiv(vocab, chunk)
    part = torch.empty((rows * splits * 4,), dtype=torch.float32, device=logits.device)
    _sample_kernel[(rows, splits)](logits, seed, part, _counters(logits.device, rows), tokens, logprobs, vocab,
                                   logits.stride(0), 1.0 / temperature, chunk, splits,
                                   SP=triton.next_power_of_2(splits), BLOCK=block, PER_ROW=int(seeds is not None),
                                   num_warps=4)
    return tokens, logprobs


if triton is not None:

    @triton.jit
    def _decode_attention_partial_kernel(Q, KC, VC, MASK, PO, PML, O, s_q, s_kb, s_kh, s_ks, s_m, window, chunk,
                                         scale, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                                         BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, KV8: tl.constexpr,
                                         PDL: tl.constexpr):
        """`_decode_attention_partial` with one query row per cache row (a decode step). Its own kernel, as
        `_rope_cache_kernel` is: QPR 1 is a constant here, so this launch compiles to the code it had before."""
        _after_previous(PDL)
        _decode_attention_partial(Q, KC, VC, MASK, PO, PML, O, s_q, s_kb, s_kh, s_ks, s_m, window, chunk, scale, 1, G,
                                  GP, D, BLOCK_N, DIRECT, KV8)

    @triton.jit
    def _decode_attention_partial_rows_kernel(Q, KC, VC, MASK, PO, PML, O, s_q, s_kb, s_kh, s_ks, s_m, window, chunk,
                                              scale, QPR, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                                              BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, KV8: tl.constexpr,
                                              PDL: tl.constexpr):
        """`_decode_attention_partial` with QPR query rows per cache row (speculative decoding's verify step)."""
        _after_previous(PDL)
        _decode_attention_partial(Q, KC, VC, MASK, PO, PML, O, s_q, s_kb, s_kh, s_ks, s_m, window, chunk, scale, QPR,
                                  G, GP, D, BLOCK_N, DIRECT, KV8)

    @triton.jit
    def _decode_attention_partial(Q, KC, VC, MASK, PO, PML, O, s_q, s_kb, s_kh, s_ks, s_m, window, chunk, scale, QPR,
                                  G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                                  DIRECT: tl.constexpr, KV8: tl.constexpr):
        """Program (query row, kv head, split): the G query heads of one kv head against slots
        [split * chunk, (split + 1) * chunk) of the window of cache row row // QPR, with the query row's additive
        mask; writes the unnormalized output and the running max and sum of that split (flash-decoding's first
        pass). DIRECT (one split): the normalized output straight into O [rows, H * D], no second pass. KV8: the
        caches are in the FP8 layout of qerl.execution.kv8 (uint8, strides in bytes): each slot's scale multiplies
        its score (keys) and its probability (values); codes, q and probabilities go to the tensor cores in fp16,
        the one type E4M3 converts to in one instruction per pair on Hopper (to bf16 it takes three, and the kernel
        was bound by them: 50% of the copy bandwidth, no faster than a bf16 cache)."""
        row, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        g, d = tl.arange(0, GP), tl.arange(0, D)
        q = tl.load(Q + row * s_q + (kvh * G + g)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
        if KV8:
            q = q.to(tl.float16)
        kv_base = (row // QPR).to(tl.int64) * s_kb + kvh * s_kh  # the query row's cache row
        start = split * chunk
        end = tl.minimum(start + chunk, window)
        m_i = tl.full((GP,), float("-inf"), tl.float32)
        l_i = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < end
            bias = tl.load(MASK + row * s_m + n, mask=valid, other=float("-inf")).to(tl.float32)
            if KV8:
                k = tl.load(KC + kv_base + n[:, None] * s_ks + d[None, :], mask=valid[:, None], other=0)
                v = tl.load(VC + kv_base + n[:, None] * s_ks + d[None, :], mask=valid[:, None], other=0)
                k = k.to(tl.float8e4nv, bitcast=True).to(tl.float16)
                v = v.to(tl.float8e4nv, bitcast=True).to(tl.float16)
                k_scale = tl.load((KC + kv_base + n * s_ks + D).to(tl.pointer_type(tl.float32), bitcast=True),
                                  mask=valid, other=0.0)
                v_scale = tl.load((VC + kv_base + n * s_ks + D).to(tl.pointer_type(tl.float32), bitcast=True),
                                  mask=valid, other=0.0)
                scores = tl.dot(q, tl.trans(k)) * (k_scale * scale)[None, :] + bias[None, :]
            else:
                k = tl.load(KC + kv_base + n[:, None] * s_ks + d[None, :], mask=valid[:, None], other=0.0)
                v = tl.load(VC + kv_base + n[:, None] * s_ks + d[None, :], mask=valid[:, None], other=0.0)
                scores = tl.dot(q, tl.trans(k)) * scale + bias[None, :]
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked block: no NaN from -inf - -inf
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if KV8:
                p = p * v_scale[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if DIRECT:
            tl.store(O + row * tl.num_programs(1) * G * D + (kvh * G + g)[:, None] * D + d[None, :],
                     (acc / l_i[:, None]).to(O.dtype.element_ty), mask=(g < G)[:, None])
        else:
            at = (row * tl.num_programs(1) + kvh) * tl.num_programs(2) + split
            tl.store(PO + at * GP * D + g[:, None] * D + d[None, :], acc)
            tl.store(PML + at * 2 * GP + g, m_i)
            tl.store(PML + at * 2 * GP + GP + g, l_i)

    @triton.jit
    def _decode_attention_combine_kernel(PO, PML, O, splits, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                                         SPLITS: tl.constexpr, PDL: tl.constexpr):
        """Program (row, kv head): softmax-weighted sum of the splits' partial outputs into O [rows, H * D]."""
        _after_previous(PDL)
        row, kvh = tl.program_id(0), tl.program_id(1)
        sp, g, d = tl.arange(0, SPLITS), tl.arange(0, GP), tl.arange(0, D)
        at = (row * tl.num_programs(1) + kvh) * splits + sp
        live = sp < splits
        m = tl.load(PML + at[:, None] * 2 * GP + g[None, :], mask=live[:, None], other=float("-inf"))  # [S, GP]
        ell = tl.load(PML + at[:, None] * 2 * GP + GP + g[None, :], mask=live[:, None], other=0.0)
        m_all = tl.max(m, axis=0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all[None, :]))
        denom = tl.sum(ell * w, axis=0)
        out = tl.zeros((GP, D), tl.float32)
        for s_ in range(0, splits):
            part = tl.load(PO + ((row * tl.num_programs(1) + kvh) * splits + s_) * GP * D + g[:, None] * D + d[None, :])
            m_s = tl.load(PML + ((row * tl.num_programs(1) + kvh) * splits + s_) * 2 * GP + g)
            w_s = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m_all))
            out += part * w_s[:, None]
        out = out / denom[:, None]
        tl.store(O + row * tl.num_programs(1) * G * D + (kvh * G + g)[:, None] * D + d[None, :],
                 out.to(O.dtype.element_ty), mask=(g < G)[:, None])


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor, num_heads: int, num_kv_heads: int,
                     head_dim: int, target_programs: int = 256, scale: float | None = None, block_n: int = 64,
                     num_warps: int = 4, num_stages: int | None = None, queries_per_row: int = 1) -> Tensor:
    """One query token per query row against the first `mask.shape[-1]` cache slots: q [N, H * D] (contiguous),
    k_cache / v_cache [>= N / Q, Hkv, >= window, D] (unit stride along D), mask [N, window] additive (0 or -inf),
    query row i reading cache row i // Q (Q = `queries_per_row`: 1 in a decode step, the tokens verified per row
    in speculative decoding's verify step, each with its own mask row).
    Returns [N, H * D] as `scaled_dot_product_attention` over the grouped heads would. Split-KV (flash-decoding):
    the window is cut into splits so that N * Hkv * splits reaches about `target_programs` programs, then one
    small kernel combines the splits: a decode step has too few (row, head) pairs to fill the GPU otherwise.
    `scale`: the softmax scale (default head_dim ** -0.5; Gemma's is query_pre_attn_scalar ** -0.5).
    `block_n`, `num_warps`, `num_stages`: the partial kernel's launch (benchmarks/bench_decode_attention.py)."""
    rows, window = mask.shape
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1 or mask.stride(-1) != 1:
        raise ValueError("decode_attention needs k and v caches of one layout with unit stride along head_dim")
    if queries_per_row != 1 and (queries_per_row < 1 or rows % queries_per_row or q.shape[0] != rows
                                 or k_cache.shape[0] < rows // queries_per_row):
        raise ValueError(f"decode_attention: q {tuple(q.shape)} and mask {tuple(mask.shape)} need one row per query "
                         f"row, a multiple of queries_per_row={queries_per_row}, and a cache row for each "
                         f"{queries_per_row} of them (caches have {k_cache.shape[0]})")
    kv8 = check_kv8(k_cache, v_cache, head_dim)
    group = num_heads // num_kv_heads
    gp = max(16, triton.next_power_of_2(group))  # tl.dot needs 16 rows
    block_n = block_n if window >= block_n else 16
    blocks = triton.cdiv(window, block_n)
    splits = max(1, min(blocks, triton.cdiv(target_programs, rows * num_kv_heads)))
    chunk = triton.cdiv(blocks, splits) * block_n
    splits = triton.cdiv(window, chunk)
    out = torch.empty((rows, num_heads * head_dim), dtype=q.dtype, device=q.device)
    direct = splits == 1  # many rows fill the GPU alone: no partials, no combine (256 rows: 26 µs per layer less)
    parts = 1 if direct else rows * num_kv_heads * splits
    partial = torch.empty((parts, gp, head_dim), dtype=torch.float32, device=q.device)
    stats = torch.empty((parts, 2, gp), dtype=torch.float32, device=q.device)
    # A decode step (Q = 1): the kernel whose cache row is the row itself (QPR a constant), launched as before.
    # Q > 1: one program per query row, each reading its cache row's whole window, so a row's Q queries read the
    # same k, v Q times (from L2 after the first): on an H200, bf16, 64 rows x 4 queries over 2048 slots took
    # 173 µs against 76 µs at one query per row. Packing a row's queries into one tile (G * Q query heads, the mask
    # per query inside it) would read them once; not done yet.
    kernel, per_row = ((_decode_attention_partial_kernel, ()) if queries_per_row == 1
                       else (_decode_attention_partial_rows_kernel, (queries_per_row,)))
    kernel[(rows, num_kv_heads, splits)](
        q, k_cache, v_cache, mask, partial, stats, out, q.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), mask.stride(0), window, chunk, head_dim ** -0.5 if scale is None else scale, *per_row,
        G=group, GP=gp, D=head_dim, BLOCK_N=block_n, DIRECT=direct, KV8=kv8, num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}), **_pdl(q.device))
    if not direct:  # the partials are per query row: the combine is the same whatever cache row a query read
        _decode_attention_combine_kernel[(rows, num_kv_heads)](partial, stats, out, splits, G=group, GP=gp,
                                                               D=head_dim, SPLITS=triton.next_power_of_2(splits),
                                                               num_warps=4, **_pdl(q.device))
    return out


def check_kv8(k_cache: Tensor, v_cache: Tensor, head_dim: int) -> bool:
    """Whether the caches are in the FP8 layout (qerl.execution.kv8); raises on a mix or a wrong last dimension."""
    from qerl.execution import kv8

    packed = kv8.is_packed(k_cache)
    if packed != kv8.is_packed(v_cache) or (packed and k_cache.shape[-1] != kv8.packed_dim(head_dim)):
        raise ValueError(f"k and v caches must both be bf16/fp16/fp32 [..., {head_dim}] or both FP8 layout "
                         f"[..., {kv8.packed_dim(head_dim)}] uint8, got {k_cache.dtype} {tuple(k_cache.shape)} and "
                         f"{v_cache.dtype} {tuple(v_cache.shape)}")
    return packed


def _pdl(device: torch.device) -> dict:
    return pdl.launch(device, debug.pdl())  # QERL_PDL=0 turns it off for an A/B measurement


def _rank_block(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # tl.dot's and the tiles' power-of-two rank axis


_COUNTERS: dict[str, Tensor] = {}


def _counters(device: torch.device, n: int) -> Tensor:
    """`lora_shrink`'s tile counters: zeroed once, then reset by the kernel itself (graph-capture friendly). One
    buffer per device: launches on different streams at once would race on it (the decode step runs on one)."""
    key = str(device)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


def lora_shrink(x: Tensor, a: Tensor, target_programs: int = 96) -> Tensor:
    """h = x · aᵀ [rows, R] for x [rows, K] (unit stride along K) and a LoRA A [R, K] (contiguous): one launch,
    split along K into about `target_programs` programs, whose fp32 shares the last to finish sums in a fixed order
    and rounds once (cuBLAS runs these skinny products as a split-K GEMM plus a reduce kernel)."""
    rows, k = x.shape
    rank = a.shape[0]
    if x.stride(-1) != 1 or not a.is_contiguous() or a.shape[1] != k or x.dtype != a.dtype:
        raise ValueError(f"lora_shrink needs x [rows, K] with unit stride along K and a contiguous A [R, K] of its "
                         f"dtype, got x {tuple(x.shape)} {x.stride()} {x.dtype}, A {tuple(a.shape)} {a.dtype}")
    h = torch.empty((rows, rank), dtype=x.dtype, device=x.device)
    if rows == 0:
        return h
    bm, bk = 16, 128
    rp = min(64, _rank_block(rank))
    row_blocks, rank_blocks, k_iters = triton.cdiv(rows, bm), triton.cdiv(rank, rp), triton.cdiv(k, bk)
    splits = max(1, min(32, k_iters, triton.cdiv(target_programs, row_blocks * rank_blocks)))
    chunk = triton.cdiv(k_iters, splits) * bk
    splits = triton.cdiv(k, chunk)
    tiles = row_blocks * rank_blocks
    part = torch.empty((tiles * splits * bm * rp,), dtype=torch.float32, device=x.device)
    _lora_shrink_kernel[(splits, row_blocks, rank_blocks)](
        x, a, h, part, _counters(x.device, tiles), rows, k, rank, x.stride(0), h.stride(0), chunk, splits, BM=bm,
        RP=rp, BK=bk, num_warps=4, **_pdl(x.device))
    return h


def _member_blocks(low_rank, n: int) -> list[tuple[int, int, int]]:
    """(first row of B, first column of h and B, rank) of each of n members of a `DeferredLoRA`."""
    if len(low_rank.blocks) != n:
        raise ValueError(f"expected a LoRA update of {n} members, got {len(low_rank.blocks)}")
    return list(low_rank.blocks)


# Above this many rows fused_add_rmsnorm leaves LoRA's products to cuBLAS (measured: H200, 7B, 2026-11-28).
LOW_RANK_IN_NORM_MAX_ROWS = 64


def fused_add_rmsnorm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, low_rank=None,
                      shrink: Tensor | None = None) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """(x + residual, written into x; weight * rmsnorm(x + residual)) for contiguous [rows, N]. With `low_rank`
    (a `qerl.model.lora.DeferredLoRA` of one member whose `out` is `residual`), the residual is first finished with
    LoRA's update; with `shrink` (the next projection's LoRA A [R, N], contiguous), also returns h = normed·Aᵀ
    [rows, R] (as rstd · (weight ⊙ x)·Aᵀ: the norm's row scale applied after the product), all in one kernel."""
    rows, n = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    block = triton.next_power_of_2(n)
    has_in = low_rank is not None and residual is not None
    if rows > LOW_RANK_IN_NORM_MAX_ROWS and (has_in or shrink is not None):
        # Many rows: the one-kernel form reads LoRA's A and B once per row (256 rows: ~117 MB, 30 µs per norm on an
        # H200); cuBLAS's addmm and GEMM read them once per tile of rows (three launches, ~8 µs).
        if has_in:  # as DeferredLoRA.finish, out of place: the caller's residual is only read, as by the kernel
            residual = torch.addmm(residual, low_rank.h, low_rank.b.t(), alpha=low_rank.scale)
        x, out = fused_add_rmsnorm(x, residual, weight, eps)
        return (x, out) if shrink is None else (x, out, F.linear(out, shrink))
    if has_in or shrink is not None:
        (_, col, rank), = _member_blocks(low_rank, 1) if has_in else ((0, 0, 0),)
        h, b = (low_rank.h, low_rank.b) if has_in else (x, x)
        rank_out = shrink.shape[0] if shrink is not None else 0
        if shrink is not None and (not shrink.is_contiguous() or shrink.shape[1] != n or shrink.dtype != x.dtype):
            raise ValueError(f"fused_add_rmsnorm: shrink must be a contiguous [R, {n}] {x.dtype} LoRA A, got "
                             f"{tuple(shrink.shape)} {shrink.dtype}")
        h_out = torch.empty((rows, rank_out), dtype=x.dtype, device=x.device)
        ch = min(128 if rank_out > 16 else 256, block)
        chunks, rpo = triton.cdiv(n, ch), _rank_block(rank_out)
        slots = torch.empty((rows * chunks * (1 + (rpo if shrink is not None else 0)),), dtype=torch.float32,
                            device=x.device)
        _add_low_rank_rmsnorm_kernel[(rows, chunks)](
            x, residual if residual is not None else x, h, b, weight, out, slots, _counters(x.device, rows),
            shrink if shrink is not None else x, h_out, n, eps, h.stride(0), b.stride(0), col, rank,
            low_rank.scale if has_in else 0.0, rank_out, max(h_out.stride(0), 1), HAS_RES=residual is not None,
            HAS_IN=has_in, HAS_OUT=shrink is not None, RP=_rank_block(rank), RPO=rpo, CH=ch, CHUNKS=chunks,
            BLOCK=block, num_warps=4, **_pdl(x.device))
        return (x, out) if shrink is None else (x, out, h_out)
    _add_rmsnorm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, n, eps,
                                 HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 512)),
                                 **_pdl(x.device))
    return x, out


def fused_rope_cache(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, slot: Tensor, k_cache: Tensor,
                     v_cache: Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                     q_norm: nn.Module | None = None, k_norm: nn.Module | None = None, low_rank=None,
                     queries_per_row: int = 1) -> Tensor:
    """Rotated q [N, H*D] (contiguous) of N query rows; rotated k and v of query row i written into cache row
    i // Q (Q = `queries_per_row`) at its slot: `slot` [1] (every row's: a decode step, Q = 1) or [N] (query row
    i at slot[i]: rows at slots of their own, or a row's Q drafted tokens at theirs). cos, sin [N, D].
    q, k, v may be column slices of one [N, (H + 2 Hkv) D] projection (unit stride along a row). With
    `low_rank` (a `qerl.model.lora.DeferredLoRA` of the q, k, v members), q, k and v are the base part of the
    projection and the kernel adds LoRA's update to them first."""
    rows = q.shape[0]
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError(f"fused_rope_cache needs unit stride along a row, got strides {t.stride()}")
    shared = queries_per_row == 1 and slot.numel() == 1  # rows == 1: one slot either way
    if not shared and (queries_per_row < 1 or rows % queries_per_row or slot.dim() != 1 or slot.shape[0] != rows):
        # Q > 1 with one slot would write a row's Q tokens over each other at that slot
        raise ValueError(f"fused_rope_cache: slot must be [1] (queries_per_row 1) or [{rows}] (one per query row), "
                         f"and {rows} query rows a multiple of queries_per_row={queries_per_row}; got slot "
                         f"{tuple(slot.shape)}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    norm = q_norm is not None
    if low_rank is not None:
        (_, q_col, q_rank), (k_row0, k_col, k_rank), (v_row0, v_col, v_rank) = _member_blocks(low_rank, 3)
        lr = (low_rank.h, low_rank.b, low_rank.h.stride(0), low_rank.b.stride(0), low_rank.scale)
        rp = _rank_block(max(q_rank, k_rank, v_rank))
    else:
        q_col = q_rank = k_col = k_rank = v_col = v_rank = k_row0 = v_row0 = 0
        lr, rp = (q, q, 0, 0, 0.0), 16
    kv8 = check_kv8(k_cache, v_cache, head_dim)
    # a decode step: the kernel without a slot stride or QPR (constants there, folded away), launched as before
    kernel, per_row = ((_rope_cache_kernel, ()) if shared
                       else (_rope_cache_rows_kernel, (slot.stride(0), queries_per_row)))
    kernel[(rows, num_heads + num_kv_heads)](
        q, k, v, cos, sin, out, k_cache, v_cache, slot, *per_row, q_norm.weight if norm else q,
        k_norm.weight if norm else q, q_norm.eps if norm else 0.0, num_heads, num_kv_heads, k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), q.stride(0), k.stride(0), v.stride(0), *lr, q_col, q_rank, k_col, k_rank,
        v_col, v_rank, k_row0, v_row0, D=head_dim, HALF=head_dim // 2, QK_NORM=norm, LOW_RANK=low_rank is not None,
        RP=rp, KV8=kv8, num_warps=1 if low_rank is None else 2, **_pdl(q.device))
    return out


def fused_silu_mul(gate: Tensor, up: Tensor, low_rank=None) -> Tensor:
    """silu(gate) * up for [rows, n] inputs with unit stride along a row (e.g. the halves of one gate_up output);
    the result is contiguous. With `low_rank` (a `qerl.model.lora.DeferredLoRA` of the gate and up members), gate
    and up are the base part of the projection and the kernel adds LoRA's update to them first."""
    for t in (gate, up):
        if t.dim() != 2 or t.stride(-1) != 1:
            raise ValueError(f"fused_silu_mul needs [rows, n] with unit stride along a row, got {tuple(t.shape)} "
                             f"strides {t.stride()}")
    rows, n = gate.shape
    out = torch.empty((rows, n), dtype=gate.dtype, device=gate.device)
    if low_rank is not None:
        (_, g_col, g_rank), (u_row0, u_col, u_rank) = _member_blocks(low_rank, 2)
        h, b, bm, block = low_rank.h, low_rank.b, 16, 256
        _silu_mul_low_rank_kernel[(triton.cdiv(rows, bm), triton.cdiv(n, block))](
            gate, up, out, h, b, rows, n, gate.stride(0), up.stride(0), h.stride(0), b.stride(0), low_rank.scale,
            g_col, g_rank, u_col, u_rank, u_row0, BM=bm, RP=_rank_block(max(g_rank, u_rank)), BLOCK=block,
            num_warps=4, **_pdl(gate.device))
        return out
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate, up, out, n, gate.stride(0), up.stride(0), BLOCK=block,
                                                     num_warps=4, **_pdl(gate.device))
    return out


def kernels_run_on(device: torch.device) -> bool:
    """Whether the kernels can run on tensors of `device`: Triton imported, and CUDA or the CPU interpreter (the
    kernels built for it: TRITON_INTERPRET=1 when Triton was imported)."""
    interpreted = triton is not None and not isinstance(_add_rmsnorm_kernel, triton.runtime.JITFunction)
    return triton is not None and (device.type == "cuda" or interpreted)
