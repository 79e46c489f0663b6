"""One row of LM-head logits reduced in one pass: its log-sum-exp, the log-prob of one token, its entropy, and
optionally its softmax written over the logits in place.

The update's head (`qerl.rl.grpo._HeadLogProbs`) needs, per completion token, the log-prob of the sampled token,
the entropy of the distribution (a logged metric) and, where only the hidden state needs a gradient, the softmax
itself for d logp / d hidden = (W[id] − softmax @ W) / T. In PyTorch that is ~12 passes over an fp32 copy of every
chunk of logits (the upcast, logsumexp's max / subtract / exp / sum, the subtract, exp, product and sum of the
entropy, the cast of the softmax): ~0.3 s of a 7B update at its 65k tokens × 152k vocabulary, and a launch for each.
This kernel reads each row of the GEMM's bf16 logits twice (statistics, then the softmax) and writes it once,
in fp32 registers throughout. Liger-kernel's `fused_selective_log_softmax` does the first pass's log-prob alone
(no entropy, no softmax), so it cannot replace this one; the benchmark (`benchmarks/bench_head.py`) measures both.

The statistics are the online softmax's, kept as scalars per block of the row: with m the running maximum,
s = Σ exp(z − m) and u = Σ exp(z − m)·(z − m), both rescaled when m grows; then lse = m + log s and the entropy
−Σ p·log p = log s − u / s. The temperature divides the logits (IEEE division, as `logits.div_(T)` does), so the
log-probs are those of the tempered distribution the sampler drew from.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
# The largest vocabulary-sized block `chunk_rows` allows: the logits of one chunk of tokens in the head's dtype.
# Bigger chunks run the head's two GEMMs nearer the tensor cores' rate (a 7B vocabulary of 152k at 128 tokens per
# chunk ran them at ~55% of it); the update's memory plan keeps >1 GiB for the head (`qerl.model.recompute`).
CHUNK_BYTES = 320 * 2**20


@triton.jit
def _row_kernel(logits_ptr, ids_ptr, logp_ptr, lse_ptr, entropy_ptr, V, stride, temperature,
                BLOCK: tl.constexpr, WANT_ENTROPY: tl.constexpr, WRITE_PROBS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    # A finite start: (m - m_new) * s with s = 0 is then 0, not inf * 0; logits of a linear layer are finite.
    m = -1e30
    s = 0.0
    u = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < V
        z = tl.math.div_rn(tl.load(base + cols, mask=valid, other=0.0).to(tl.float32), temperature)
        m_new = tl.maximum(m, tl.max(tl.where(valid, z, -1e30), axis=0))
        alpha = tl.exp(m - m_new)
        shifted = z - m_new
        e = tl.where(valid, tl.exp(shifted), 0.0)
        if WANT_ENTROPY:
            u = alpha * (u + (m - m_new) * s) + tl.sum(e * shifted, axis=0)
        s = s * alpha + tl.sum(e, axis=0)
        m = m_new
    log_s = tl.log(s)
    lse = m + log_s
    token = tl.load(ids_ptr + row)
    picked = tl.math.div_rn(tl.load(base + token).to(tl.float32), temperature)
    tl.store(logp_ptr + row, picked - lse)
    tl.store(lse_ptr + row, lse)
    if WANT_ENTROPY:
        tl.store(entropy_ptr + row, log_s - u / s)
    if WRITE_PROBS:  # each block read before it is overwritten, by this program only
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < V
            z = tl.math.div_rn(tl.load(base + cols, mask=valid, other=0.0).to(tl.float32), temperature)
            tl.store(base + cols, tl.exp(z - lse).to(logits_ptr.dtype.element_ty), mask=valid)


def chunk_rows(vocab: int, itemsize: int, floor: int = 128) -> int:
    """Tokens per head chunk: the largest power of two whose logits fit CHUNK_BYTES (at least `floor`)."""
    rows = max(1, CHUNK_BYTES // max(1, vocab * itemsize))
    return max(floor, 1 << (rows.bit_length() - 1))


def row_stats(logits: torch.Tensor, ids: torch.Tensor, temperature: float, want_entropy: bool,
              probs_in_place: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logp, lse, entropy or None), each ``[N]`` float32, of the ``[N, V]`` logits divided by ``temperature``, at
    the token ``ids[n]`` of each row. With ``probs_in_place`` the logits are overwritten by softmax(logits / T) in
    their own dtype (what the head's backward GEMM takes)."""
    if logits.ndim != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [N, V] with unit stride along V, got {tuple(logits.shape)}")
    n, vocab = logits.shape
    logp = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if want_entropy else None
    if n:
        _row_kernel[(n,)](logits, ids.contiguous(), logp, lse, entropy if want_entropy else logp, vocab,
                          logits.stride(0), float(temperature), BLOCK=min(BLOCK, triton.next_power_of_2(vocab)),
                          WANT_ENTROPY=want_entropy, WRITE_PROBS=probs_in_place, num_warps=8)
    return logp, lse, entropy
