"""The fused decode step with several query tokens per cache row (speculative decoding's verify step: a row's k
drafted tokens in one forward, each at its own cache slot): `fused_ops.fused_rope_cache` and
`fused_ops.decode_attention` with `queries_per_row` > 1 and per-row slots against plain PyTorch; `decode.decode_step`
with Q query rows per cache row against Q one-token steps; and the one-token step with one shared slot still the
launches it was (against the model's plain step).

Without CUDA the kernels run in Triton's CPU interpreter in fp32 (its tl.dot on bf16 gives garbage there). Triton
picks interpreter or compiler once, when it is first imported: this file imports the decode kernels at collection
(compiled mode, as tests/rollout/test_engine.py does, so the rest of the suite keeps its plain CPU path), and reruns
itself in a subprocess with TRITON_INTERPRET=1, where the kernel tests run in-process. With CUDA they run on the GPU.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from qerl.execution import decode
from qerl.execution import fused_ops as K  # imports Triton now: compiled mode unless TRITON_INTERPRET=1 was set
from qerl.execution.low_rank import DeferredLoRA
from qerl.execution.training_ops import rope_eager
from qerl.model.lora import LoraSettings, apply_lora
from qerl.model.transformer import ModelConfig, RMSNorm, Transformer
from tests.patience import patience

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
RUNS = K.triton is not None and K.kernels_run_on(DEV)  # CUDA, or this process is the interpreter's
kernels = pytest.mark.skipif(not RUNS, reason="the kernels run in test_interpreter_subprocess")
# fp32 throughout; on CUDA tl.dot rounds fp32 operands to TF32 (the attention kernel's products)
TOL = 3e-3 if CUDA else 1e-5


def test_interpreter_subprocess():
    """The kernel tests, in a fresh process under Triton's interpreter (this one imported Triton compiled)."""
    if RUNS or K.triton is None:
        pytest.skip("the kernel tests run in this process (or there is no Triton)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                       capture_output=True, text=True, timeout=patience(600), env=env)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]


def rope_tables(n: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.randn(n, dim // 2, generator=torch.Generator().manual_seed(seed))
    return torch.cat([ang.cos()] * 2, -1).to(DEV), torch.cat([ang.sin()] * 2, -1).to(DEV)


def verify_slots(starts: list[int], queries: int) -> torch.Tensor:
    """[rows * Q] slots: cache row r's query t at starts[r] + t (a row's drafted tokens at consecutive slots)."""
    return (torch.tensor(starts)[:, None] + torch.arange(queries)).reshape(-1).to(DEV)


@kernels
@pytest.mark.parametrize("queries, norm, lora", [(3, False, True), (2, True, False), (1, False, False)])
def test_rope_cache_writes_each_query_row_into_its_cache_row_at_its_slot(queries, norm, lora):
    """Query row i's rotated k and its v land in cache row i // Q at slot[i] (Q = 1: rows at slots of their own),
    rotated q comes back per query row, LoRA's deferred update and Qwen3's q/k norms applied first; nothing else in
    the caches changes."""
    torch.manual_seed(0)
    rows, H, Hkv, D, S = 2, 2, 2, 16, 12  # few programs: the interpreter runs each in ~10 ms
    n = rows * queries
    slot = verify_slots([5, 1], queries)
    fused = torch.randn(n, (H + 2 * Hkv) * D, device=DEV)  # one fused qkv output: q, k, v are its column slices
    q, k, v = fused.split([H * D, Hkv * D, Hkv * D], -1)
    cos, sin = rope_tables(n, D, 1)
    q_norm = k_norm = low_rank = None
    ref = fused
    if norm:
        q_norm, k_norm = RMSNorm(D, 1e-6).to(DEV), RMSNorm(D, 1e-6).to(DEV)
        q_norm.weight.data.uniform_(0.5, 1.5)
        k_norm.weight.data.uniform_(0.5, 1.5)
    if lora:
        h, b = torch.randn(n, 8, device=DEV), torch.randn((H + 2 * Hkv) * D, 8, device=DEV)
        low_rank = DeferredLoRA(fused, h, b, 0.3, ((0, 0, 3), (H * D, 3, 2), ((H + Hkv) * D, 5, 3)))
        b_used = torch.zeros_like(b)  # each member's own rank block of b
        for row0, col, rank, size in ((0, 0, 3, H * D), (H * D, 3, 2, Hkv * D), ((H + Hkv) * D, 5, 3, Hkv * D)):
            b_used[row0:row0 + size, col:col + rank] = b[row0:row0 + size, col:col + rank]
        ref = fused + 0.3 * h @ b_used.T
    q_ref, k_ref, v_ref = (t.reshape(n, -1, D) for t in ref.split([H * D, Hkv * D, Hkv * D], -1))
    if norm:
        q_ref, k_ref = q_norm(q_ref), k_norm(k_ref)
    q_ref, k_ref = (rope_eager(t, cos[:, None], sin[:, None]) for t in (q_ref, k_ref))
    kc, vc = torch.randn(rows + 1, Hkv, S, D, device=DEV), torch.randn(rows + 1, Hkv, S, D, device=DEV)
    k_want, v_want = kc.clone(), vc.clone()
    for i in range(n):
        k_want[i // queries, :, slot[i]] = k_ref[i]
        v_want[i // queries, :, slot[i]] = v_ref[i]
    out = K.fused_rope_cache(q, k, v, cos, sin, slot, kc, vc, H, Hkv, D, q_norm, k_norm, low_rank=low_rank,
                             queries_per_row=queries)
    assert (out.view(n, H, D) - q_ref).abs().max() < 1e-5
    assert (kc - k_want).abs().max() < 1e-5 and (vc - v_want).abs().max() < 1e-5
    written = torch.zeros(kc.shape[0], S, dtype=torch.bool)
    written[torch.arange(n) // queries, slot.cpu()] = True
    assert torch.equal(kc.transpose(1, 2)[~written], k_want.transpose(1, 2)[~written])  # the rest untouched
    assert torch.equal(vc.transpose(1, 2)[~written], v_want.transpose(1, 2)[~written])


def test_rope_cache_rejects_one_slot_for_several_queries_per_row():
    """A row's Q tokens at one shared slot would overwrite each other: refused before any launch."""
    rows, H, Hkv, D = 2, 2, 1, 16
    q, k, v = torch.randn(rows * 2, (H + 2 * Hkv) * D).split([H * D, Hkv * D, Hkv * D], -1)
    cos, sin = rope_tables(rows * 2, D, 0)
    kc = vc = torch.zeros(rows, Hkv, 8, D)
    for slot, queries in ((torch.tensor([3]), 2), (torch.tensor([3, 4, 5]), 2), (torch.tensor([1, 2, 3, 4]), 3)):
        with pytest.raises(ValueError, match="slot must be"):
            K.fused_rope_cache(q, k, v, cos.cpu(), sin.cpu(), slot, kc, vc, H, Hkv, D, queries_per_row=queries)


@kernels
@pytest.mark.parametrize("queries, Hkv, G, window, kv8", [(3, 2, 2, 40, False), (2, 1, 3, 100, False),
                                                          (4, 1, 2, 24, True)])
def test_decode_attention_reads_each_query_rows_cache_row(queries, Hkv, G, window, kv8):
    """Query row i attends over cache row i // Q under its own mask row (left padding, then causality within the
    row's drafted tokens): SDPA over that row's cache, with several splits and with one (the direct write); the
    FP8 cache layout too. Every cache row holds other values, so reading row i (or i's neighbour) fails."""
    from qerl.execution import kv8 as kv8_layout

    torch.manual_seed(0)
    rows, D = 2, 16
    n = rows * queries
    q = torch.randn(n, Hkv * G * D, device=DEV)
    kf = torch.randn(n, Hkv, window + 7, D, device=DEV) * (4 if kv8 else 1)  # n cache rows: a wrong row is real data
    vf = torch.randn(n, Hkv, window + 7, D, device=DEV)
    starts, pads = [window - queries - 9, window - queries], [4, 0]
    slot = verify_slots(starts, queries)
    keys = torch.arange(window, device=DEV)
    pad = torch.tensor(pads, device=DEV).repeat_interleave(queries)
    allowed = (keys >= pad[:, None]) & (keys <= slot[:, None])
    mask = torch.zeros(n, window, device=DEV).masked_fill_(~allowed, float("-inf"))
    kc, vc = (kv8_layout.pack(kf), kv8_layout.pack(vf)) if kv8 else (kf, vf)
    k_ref = kv8_layout.unpack(kc, torch.float32) if kv8 else kf
    v_ref = kv8_layout.unpack(vc, torch.float32) if kv8 else vf
    cache_row = torch.arange(n, device=DEV) // queries
    ref = F.scaled_dot_product_attention(q.view(n, Hkv, G, D), k_ref[cache_row, :, :window],
                                         v_ref[cache_row, :, :window], attn_mask=mask[:, None, None, :])
    ref = ref.reshape(n, -1)
    for programs in (64, 1):  # 1: one split, the output written directly (no combine)
        got = K.decode_attention(q, kc, vc, mask, Hkv * G, Hkv, D, target_programs=programs,
                                 queries_per_row=queries)
        err = (got - ref).abs().max().item()
        assert err < (5e-3 if kv8 else TOL), (programs, err)  # FP8: fp16 operands (q, probabilities)


def tiny_model(model_type: str, lora: bool, fuse: bool, vocab=97, hidden=32, heads=2, kv_heads=1) -> Transformer:
    """A 2-layer random model in fp32 (as tests/rollout/test_engine.py builds them; head_dim 16, few heads: the
    interpreter's time goes by the programs), LoRA live where asked; `fuse`: q/k/v and gate/up as one GEMM each, so
    LoRA's update is left to the kernels (`DeferredLoRA`)."""
    cfg = ModelConfig.from_hf({"model_type": model_type, "hidden_size": hidden, "intermediate_size": 2 * hidden,
                               "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                               "vocab_size": vocab, "max_position_embeddings": 512})
    assert cfg.sliding_window is None  # a [N] slot through step_masks only where no layer slides
    torch.manual_seed(0)
    model = Transformer.from_config(cfg, dtype=torch.float32, device=DEV).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    if lora:
        for p in apply_lora(model, LoraSettings(rank=4, alpha=8)):
            p.data.normal_(0, 0.1)
    if fuse:
        assert model.fuse_projections() == 4
    return model


def random_caches(model: Transformer, rows: int, slots: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k, v) per layer, [rows, kv_heads, slots, head_dim], random: a prefilled prompt's values and garbage past
    it (masked off), either of which a wrong row or slot would read."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    shape = (rows, c.num_key_value_heads, slots, c.head_dim)
    return [(torch.randn(shape, generator=g).to(DEV), torch.randn(shape, generator=g).to(DEV))
            for _ in range(c.num_hidden_layers)]


@kernels
@pytest.mark.parametrize("model_type, lora, fuse", [("llama", True, False), ("qwen2", True, True)])
def test_verify_step_equals_one_token_steps(model_type, lora, fuse):
    """decode_step with Q = 3 query rows per cache row, rows at different slots behind different left padding,
    equals 3 one-token decode_steps (each row at its own slot, Q = 1): the same logits within fp32 rounding and
    the same caches (each query's k, v at its slot of its row, the rest untouched)."""
    model = tiny_model(model_type, lora, fuse)
    rows, queries, slots = 2, 3, 16
    starts, pads = [6, 9], [2, 0]  # row r's first drafted token at slot starts[r]; slots < pads[r] padding
    window = max(starts) + queries
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (rows, queries), generator=g).to(DEV)
    slot = verify_slots(starts, queries).view(rows, queries)
    positions = slot - torch.tensor(pads, device=DEV)[:, None]  # RoPE positions count the real tokens only
    keys = torch.arange(window, device=DEV)
    attend = (keys >= torch.tensor(pads, device=DEV)[:, None, None]) & (keys <= slot[..., None])  # [rows, Q, window]
    one, many = random_caches(model, rows, slots, 2), random_caches(model, rows, slots, 2)
    steps = torch.stack([decode.decode_step(model, tokens[:, t], positions[:, t, None], slot[:, t], attend[:, t], one)
                         for t in range(queries)], 1)  # [rows, Q, vocab]
    verify = decode.decode_step(model, tokens.reshape(-1), positions.reshape(-1, 1), slot.reshape(-1),
                                attend.reshape(rows * queries, window), many, queries_per_row=queries)
    assert verify.shape == (rows * queries, model.config.vocab_size)
    err = (verify.view(rows, queries, -1) - steps).abs().max().item()
    assert err < TOL * steps.abs().max().item(), err
    for (k1, v1), (k2, v2) in zip(one, many):  # not bit-equal: a GEMM over 6 rows may round unlike one over 2
        assert (k1 - k2).abs().max() < TOL * k2.abs().max() and (v1 - v2).abs().max() < TOL * v2.abs().max()
    untouched = random_caches(model, rows, slots, 2)
    written = torch.zeros(rows, slots, dtype=torch.bool)
    written[torch.arange(rows)[:, None], slot.cpu()] = True
    for (k, v), (k0, v0) in zip(many, untouched):
        assert torch.equal(k.transpose(1, 2)[~written], k0.transpose(1, 2)[~written])
        assert not torch.equal(k.transpose(1, 2)[written], k0.transpose(1, 2)[written])


class LaunchLog:
    """A kernel whose launches (`kernel[grid](...)`) are recorded by name and grid, then run as they were."""

    def __init__(self, kernel, name: str, log: list):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append((self.name, tuple(grid)))
        return self.kernel[grid]


@kernels
def test_one_token_step_at_one_slot_is_unchanged(monkeypatch):
    """queries_per_row = 1 with one slot [1] for every row (the rollout's decode step): only the kernels it
    launched before per-row slots (same names, same grids: rows x heads, rows x kv heads x splits), matching the
    model's plain step; and the same bits as the same step given that slot once per row (the per-row-slot kernel
    at Q = 1, which rows at slots of their own take)."""
    model = tiny_model("llama", lora=True, fuse=True)
    c = model.config
    rows, slots, at = 3, 12, 7
    pads = torch.tensor([0, 3, 5], device=DEV)
    tokens = torch.randint(0, c.vocab_size, (rows,), generator=torch.Generator().manual_seed(3)).to(DEV)
    slot = torch.tensor([at], device=DEV)
    positions = (at - pads)[:, None]
    attend = (torch.arange(at + 1, device=DEV) >= pads[:, None])
    log = []
    for name in ("_rope_cache_kernel", "_rope_cache_rows_kernel", "_decode_attention_partial_kernel",
                 "_decode_attention_partial_rows_kernel"):
        monkeypatch.setattr(K, name, LaunchLog(getattr(K, name), name, log))
    fused, plain = random_caches(model, rows, slots, 4), random_caches(model, rows, slots, 4)
    got = model.decode_step(tokens, positions, slot, attend, fused, fused=True)
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    assert [name for name, _ in log] == ["_rope_cache_kernel", "_decode_attention_partial_kernel"] * 2
    assert all(grid == (rows, heads + kv_heads) for name, grid in log[::2])
    assert all(grid[:2] == (rows, kv_heads) for name, grid in log[1::2])
    want = model.decode_step(tokens, positions, slot, attend, plain, fused=False)
    assert (got - want).abs().max() < TOL * want.abs().max()
    for (k1, v1), (k2, v2) in zip(fused, plain):  # the second layer's k, v went through the first's attention
        assert (k1 - k2).abs().max() < TOL * k2.abs().max() and (v1 - v2).abs().max() < TOL * v2.abs().max()
    log.clear()
    per_row = random_caches(model, rows, slots, 4)
    again = decode.decode_step(model, tokens, positions, slot.expand(rows).contiguous(), attend, per_row)
    assert [name for name, _ in log] == ["_rope_cache_rows_kernel", "_decode_attention_partial_kernel"] * 2
    assert torch.equal(again, got)
    for (k1, v1), (k2, v2) in zip(per_row, fused):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_per_row_kernels_pass_the_compiler_frontend_for_sm90():
    """The per-row-slot kernels through Triton's real AST -> TTIR lowering for an H100 (no GPU needed): typing
    errors the interpreter lets through fail here (tests/rollout/test_engine.py lowers the one-slot kernels)."""
    try:
        from triton._C.libtriton import ir
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.compiler import ASTSource
        target = GPUTarget("cuda", 90, 32)
        backend = CUDABackend(target)
    except Exception as e:  # no Triton, or internal API of another Triton version
        pytest.skip(f"Triton compiler internals unavailable: {e}")
    if RUNS and not CUDA:
        pytest.skip("this process runs the interpreter's kernels: the compiled-mode process lowers them")

    def lower(fn, signature, constexprs):
        options = backend.parse_options({"num_warps": 4})
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        ASTSource(fn, {**signature, "PDL": "constexpr"}, constexprs={**constexprs, "PDL": True}).make_ir(
            target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)

    p = "*bf16"
    for qk, low_rank, kv8 in ((False, False, False), (True, True, False), (False, True, True)):
        c = "*u8" if kv8 else p
        i32 = dict.fromkeys(["s_slot", "QPR", "H", "HKV", "s_b", "s_h", "s_s", "s_q", "s_k", "s_v", "s_hl", "s_lb",
                             "q_col", "q_rank", "k_col", "k_rank", "v_col", "v_rank", "k_row0", "v_row0"], "i32")
        lower(K._rope_cache_rows_kernel,
              {"Q": p, "K": p, "V": p, "COS": "*fp32", "SIN": "*fp32", "QO": p, "KC": c, "VC": c, "SLOT": "*i64",
               "QW": p, "KW": p, "eps": "fp32", "HL": p, "LB": p, "lr_scale": "fp32", **i32,
               **dict.fromkeys(["D", "HALF", "QK_NORM", "LOW_RANK", "RP", "KV8"], "constexpr")},
              {"D": 128, "HALF": 64, "QK_NORM": qk, "LOW_RANK": low_rank, "RP": 16, "KV8": kv8})
    for direct, kv8 in ((False, False), (True, False), (True, True), (False, True)):
        c = "*u8" if kv8 else p
        lower(K._decode_attention_partial_rows_kernel,
              {"Q": p, "KC": c, "VC": c, "MASK": p, "PO": "*fp32", "PML": "*fp32", "O": p, "scale": "fp32",
               **dict.fromkeys(["s_q", "s_kb", "s_kh", "s_ks", "s_m", "window", "chunk", "QPR"], "i32"),
               **dict.fromkeys(["G", "GP", "D", "BLOCK_N", "DIRECT", "KV8"], "constexpr")},
              {"G": 7, "GP": 16, "D": 128, "BLOCK_N": 64, "DIRECT": direct, "KV8": kv8})
