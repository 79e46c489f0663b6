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


if triton is not None:

    @triton.jit
    def _sample_kernel(LOGITS, SEED, TOK, LOGP, V, stride, inv_t, BLOCK: tl.constexpr):
        """Program (row): one token drawn from softmax(logits * inv_t) by the exponential race (argmax of
        x - log(E), E = -log(U) ~ Exp(1), U ~ Philox uniforms keyed by SEED), and its log-probability, in one pass
        over the vocabulary (an online log-sum-exp)."""
        row = tl.program_id(0)
        seed = tl.load(SEED)
        base = LOGITS + row.to(tl.int64) * stride
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        best = tl.full((), float("-inf"), tl.float32)
        best_idx = tl.zeros((), tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < V
            x = tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.where(valid, tl.exp(x - m_new), 0.0), axis=0)
            m = m_new
            u = tl.rand(seed, row * V + offs)
            score = tl.where(valid, x - tl.log(-tl.log(u)), float("-inf"))
            block_best = tl.max(score, axis=0)
            block_idx = tl.argmax(score, axis=0).to(tl.int32) + start
            best_idx = tl.where(block_best > best, block_idx, best_idx)
            best = tl.maximum(best, block_best)
        x_tok = tl.load(base + best_idx).to(tl.float32) * inv_t
        tl.store(TOK + row, best_idx.to(tl.int64))
        tl.store(LOGP + row, x_tok - m - tl.log(s))


def fused_sample(logits: Tensor, temperature: float, generator: torch.Generator | None = None,
                 block: int = 4096) -> tuple[Tensor, Tensor]:
    """(tokens [B] int64, log-probs [B] fp32) drawn from softmax(logits / temperature), logits [B, V] with unit
    stride along V: one kernel instead of the ~7 full-vocabulary passes of the PyTorch sampler. Draws the same
    distribution with other random numbers: one Philox seed per call, taken from `generator` on the device (no host
    synchronization), so seeded runs repeat exactly. `block`: vocabulary entries per loop step (a power of two)."""
    if logits.stride(-1) != 1:
        raise ValueError(f"fused_sample needs unit stride along the vocabulary, got strides {logits.stride()}")
    rows, vocab = logits.shape
    seed = torch.randint(0, 2**31 - 1, (1,), device=logits.device, generator=generator)
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _sample_kernel[(rows,)](logits, seed, tokens, logprobs, vocab, logits.stride(0), 1.0 / temperature,
                            BLOCK=min(block, triton.next_power_of_2(vocab)), num_warps=8)
    return tokens, logprobs


if triton is not None:

    @triton.jit
    def _decode_attention_partial_kernel(Q, KC, VC, MASK, PO, PML, s_q, s_kb, s_kh, s_ks, s_m, window, chunk, scale,
                                         G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program (row, kv head, split): the G query heads of one kv head against cache slots
        [split * chunk, (split + 1) * chunk) of the window, with the additive mask; writes the unnormalized output
        and the running max and sum of that split (flash-decoding's first pass)."""
        row, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        g, d = tl.arange(0, GP), tl.arange(0, D)
        q = tl.load(Q + row * s_q + (kvh * G + g)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
        kv_base = row.to(tl.int64) * s_kb + kvh * s_kh
        start = split * chunk
        end = tl.minimum(start + chunk, window)
        m_i = tl.full((GP,), float("-inf"), tl.float32)
        l_i = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < end
            k = tl.load(KC + kv_base + n[:, None] * s_ks + d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(VC + kv_base + n[:, None] * s_ks + d[None, :], mask=valid[:, None], other=0.0)
            bias = tl.load(MASK + row * s_m + n, mask=valid, other=float("-inf")).to(tl.float32)
            scores = tl.dot(q, tl.trans(k)) * scale + bias[None, :]
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked block: no NaN from -inf - -inf
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        at = (row * tl.num_programs(1) + kvh) * tl.num_programs(2) + split
        tl.store(PO + at * GP * D + g[:, None] * D + d[None, :], acc)
        tl.store(PML + at * 2 * GP + g, m_i)
        tl.store(PML + at * 2 * GP + GP + g, l_i)

    @triton.jit
    def _decode_attention_combine_kernel(PO, PML, O, splits, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                                         SPLITS: tl.constexpr):
        """Program (row, kv head): softmax-weighted sum of the splits' partial outputs into O [rows, H * D]."""
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
                     head_dim: int, target_programs: int = 256, scale: float | None = None) -> Tensor:
    """One query token per row against the first `mask.shape[-1]` cache slots: q [rows, H * D] (contiguous),
    k_cache / v_cache [>= rows, Hkv, >= window, D] (unit stride along D), mask [rows, window] additive (0 or -inf).
    Returns [rows, H * D] as `scaled_dot_product_attention` over the grouped heads would. Split-KV (flash-decoding):
    the window is cut into splits so that rows * Hkv * splits reaches about `target_programs` programs, then one
    small kernel combines the splits: a decode step has too few (row, head) pairs to fill the GPU otherwise.
    `scale`: the softmax scale (default head_dim ** -0.5; Gemma's is query_pre_attn_scalar ** -0.5)."""
    rows, window = mask.shape
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1 or mask.stride(-1) != 1:
        raise ValueError("decode_attention needs k and v caches of one layout with unit stride along head_dim")
    group = num_heads // num_kv_heads
    gp = max(16, triton.next_power_of_2(group))  # tl.dot needs 16 rows
    block_n = 64 if window >= 64 else 16
    blocks = triton.cdiv(window, block_n)
    splits = max(1, min(blocks, triton.cdiv(target_programs, rows * num_kv_heads)))
    chunk = triton.cdiv(blocks, splits) * block_n
    splits = triton.cdiv(window, chunk)
    partial = torch.empty((rows * num_kv_heads * splits, gp, head_dim), dtype=torch.float32, device=q.device)
    stats = torch.empty((rows * num_kv_heads * splits, 2, gp), dtype=torch.float32, device=q.device)
    out = torch.empty((rows, num_heads * head_dim), dtype=q.dtype, device=q.device)
    _decode_attention_partial_kernel[(rows, num_kv_heads, splits)](
        q, k_cache, v_cache, mask, partial, stats, q.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), mask.stride(0), window, chunk, head_dim ** -0.5 if scale is None else scale, G=group,
        GP=gp, D=head_dim, BLOCK_N=block_n, num_warps=4)
    _decode_attention_combine_kernel[(rows, num_kv_heads)](partial, stats, out, splits, G=group, GP=gp, D=head_dim,
                                                           SPLITS=triton.next_power_of_2(splits), num_warps=4)
    return out


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
