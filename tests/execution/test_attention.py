"""The attention seam (`qerl.execution.attention`): both entries against softmax attention written out, the cached
one's SDPA path against the uncached one, and its split-KV kernel (the fused decode step's) against its SDPA path,
one query token per row and several (speculative decoding's verify step).

Without CUDA the kernel runs in Triton's CPU interpreter in fp32 (its tl.dot on bf16 gives garbage there): Triton
picks interpreter or compiler once, when it is first imported, so the kernel test reruns this file in a subprocess
with TRITON_INTERPRET=1 (as tests/execution/test_decode.py does)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from qerl.execution import attention
from qerl.execution import fused_ops as K  # imports Triton now: compiled mode unless TRITON_INTERPRET=1 was set
from tests.patience import patience

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
RUNS = K.triton is not None and K.kernels_run_on(DEV)  # CUDA, or this process is the interpreter's
TOL = 3e-3 if CUDA else 1e-5  # on CUDA tl.dot rounds fp32 operands to TF32


def written_out(q, k, v, allowed, scale=None):
    """softmax(q kᵀ · scale, masked) v per head, query head h on kv head h // (H / Hkv); [B, T, H * D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    out = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def qkv(batch, heads, kv_heads, seq, keys, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, seq, dim, generator=g), torch.randn(batch, kv_heads, keys, dim, generator=g),
            torch.randn(batch, kv_heads, keys, dim, generator=g))


@pytest.mark.parametrize("masked, scale", [(False, None), (True, None), (True, 0.3)])
def test_attend_is_softmax_attention_and_cpu_gqa_changes_no_forward_bit(masked, scale):
    q, k, v = qkv(2, 6, 2, 7, 7)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    allowed = causal & (torch.rand(2, 1, 7, 7, generator=torch.Generator().manual_seed(1)) > 0.3) | torch.eye(7).bool()
    mask = allowed if masked else None
    out = attention.attend(q, k, v, mask, scale)
    assert out.shape == (2, 7, 6 * 16)
    torch.testing.assert_close(out, written_out(q, k, v, allowed if masked else causal, scale), rtol=0, atol=1e-5)
    assert torch.equal(attention.attend(q, k, v, mask, scale, cpu_gqa=True), out)


def test_attend_cached_over_a_caches_slots_is_attend():
    """Several query tokens per row over a cache (prefill, the plain decode and verify steps): the query groups
    folded into the query axis compute attention over the cache's slots, masks per query."""
    q, k, v = qkv(3, 4, 2, 3, 11, seed=2)
    allowed = torch.rand(3, 1, 3, 11, generator=torch.Generator().manual_seed(3)) > 0.4
    allowed[..., 0] = True
    out = attention.attend_cached(q, k, v, allowed, 0.25)
    torch.testing.assert_close(out, written_out(q, k, v, allowed, 0.25), rtol=0, atol=1e-5)
    torch.testing.assert_close(out, attention.attend(q, k, v, allowed, 0.25), rtol=0, atol=1e-6)


def test_additive_mask():
    allowed = torch.tensor([[True, False, True]])
    assert attention.additive_mask(allowed, torch.float16).tolist() == [[0.0, float("-inf"), 0.0]]


def test_interpreter_subprocess():
    """The kernel test, in a fresh process under Triton's interpreter (this one imported Triton compiled)."""
    if RUNS or K.triton is None:
        pytest.skip("the kernel test runs in this process (or there is no Triton)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k", "split"],
                       capture_output=True, text=True, timeout=patience(600), env=env)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]


@pytest.mark.skipif(not RUNS, reason="the kernels run in test_interpreter_subprocess")
@pytest.mark.parametrize("queries", [1, 3])
def test_split_kv_kernel_is_the_sdpa_path(queries):
    """The fused decode step's kernel behind `attend_cached(split_kv=True)`: q a transposed view of the fused RoPE
    kernel's [rows, Q, H, D], caches with more rows and slots than it reads, the additive mask built once; the SDPA
    path's numbers over the same slots."""
    rows, heads, kv_heads, dim, window, slots = 2, 4, 2, 16, 20, 24
    g = torch.Generator().manual_seed(4)
    q = torch.randn(rows, queries, heads, dim, generator=g).to(DEV).transpose(1, 2)
    k_cache, v_cache = (torch.randn(rows + 1, kv_heads, slots, dim, generator=g).to(DEV) for _ in range(2))
    allowed = torch.rand(rows, 1, queries, window, generator=g).to(DEV) > 0.3
    allowed[..., 0] = True
    got = attention.attend_cached(q, k_cache, v_cache, attention.additive_mask(allowed, q.dtype), 0.3, split_kv=True)
    want = attention.attend_cached(q, k_cache[:rows, :, :window], v_cache[:rows, :, :window], allowed, 0.3)
    assert got.shape == want.shape == (rows, queries, heads * dim)
    assert (got - want).abs().max() < TOL * want.abs().max()
