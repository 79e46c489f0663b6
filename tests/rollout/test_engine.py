"""Rollout engine: same tokens/log-probs/stop reasons as `qerl.rollout.generate`, live LoRA/AQN, graphs on CUDA.

CPU runs cover everything but the graphs: the fused decode path (module calls off CUDA), batch buckets with padding
rows, compaction of finished rows, KV windows, stop-string checks every k steps. The Triton kernels are checked in
Triton's CPU interpreter in fp32 (its fp32->bf16 casts truncate instead of rounding: bf16 is checked on the GPU).
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qerl.execution import fused_ops  # noqa: F401  (imports Triton now, compiled mode: see below)
from qerl.model.aqn import NoiseInjector
from qerl.model.lora import LoraSettings, adapters_disabled, apply_lora
from qerl.model.transformer import ModelConfig, Transformer
from qerl.rollout.engine import RolloutEngine, engine_for, generate_fast, release_engine
from qerl.rollout.generate import generate
from qerl.rollout.sampling import Rollout
from tests.patience import patience
from tests.reference import policy_logprobs

CUDA = torch.cuda.is_available()
# Triton's interpreter runs the kernels on the CPU (CI); on the GPU image (triton 3.6, numpy 2.5) it mis-reads scalar
# arguments and cannot loop from a program id, and the CUDA tests there cover the same kernels compiled.
interpreter_only = pytest.mark.skipif(CUDA, reason="CUDA present: the GPU tests cover the kernels (and Triton 3.6's "
                                      "interpreter mis-reads scalar arguments on the GPU image)")
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
# Triton chooses interpreter or compiler once, when it is first imported. test_kernels switches this process to the
# interpreter if nothing imported Triton before it; the compiler-frontend test below needs compiled kernels, and the
# CPU engine tests the plain PyTorch path. Importing the decode kernels here (collected before test_kernels) keeps
# the suite in compiled mode; the interpreter runs in subprocesses.


def run_in_interpreter(code: str) -> None:
    """Run `code` in a process of its own under Triton's CPU interpreter (set before triton imports); it prints
    "ok" last when its checks pass."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=patience(300))
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def tiny(model_type="llama", vocab=97, layers=2, hidden=64, heads=4, kv_heads=2, seed=0, device="cpu",
         dtype=torch.float32):
    cfg = ModelConfig.from_hf({"model_type": model_type, "hidden_size": hidden, "intermediate_size": 2 * hidden,
                               "num_hidden_layers": layers, "num_attention_heads": heads,
                               "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 512})
    torch.manual_seed(seed)
    model = Transformer.from_config(cfg, dtype=dtype, device=device).eval()
    with torch.no_grad():  # peaked logits: no near-ties in greedy comparisons
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return model


def prompts(n=5, vocab=97, seed=1, max_len=9):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(n_),), generator=g).tolist()
            for n_ in torch.randint(1, max_len, (n,), generator=g)]


def assert_same(out: Rollout, ref: Rollout, atol=1e-5):
    assert out.completion_ids == ref.completion_ids
    assert out.stop_reasons == ref.stop_reasons
    assert out.texts == ref.texts
    for a, b in zip(out.logprobs, ref.logprobs):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert torch.allclose(a, b, atol=atol)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("fused", [True, False])
def test_greedy_matches_generate(model_type, fused):
    model, ps = tiny(model_type), prompts()
    ref = generate(model, None, ps, 20, temperature=0, eos_token_ids=[])
    engine = RolloutEngine(model, fused=fused, check_every=3, window=8)  # small windows: several per rollout
    assert_same(engine.generate(None, ps, 20, temperature=0, eos_token_ids=[]), ref)
    width = max(map(len, ps)) + 20
    assert engine.cap_rows == 8 and engine.cap_slots == -(-width // 8) * 8  # 5 rows -> bucket 8; windows of 8


def test_eos_rows_are_compacted_and_match_generate():
    model, ps = tiny(), prompts(7)
    free = generate(model, None, ps, 24, temperature=0, eos_token_ids=[])
    eos = [free.completion_ids[0][2], free.completion_ids[3][5]]  # two rows end early, others may too
    ref = generate(model, None, ps, 24, temperature=0, eos_token_ids=eos)
    engine = RolloutEngine(model, check_every=2)
    out = engine.generate(None, ps, 24, temperature=0, eos_token_ids=eos)
    assert_same(out, ref)
    assert "eos" in out.stop_reasons and engine.stats["compactions"] >= 1


def test_stop_strings_and_text_prompts_match_generate(tiny_llama_dir):
    from qerl.model.loading import load_model

    model, tokenizer = load_model(tiny_llama_dir)
    texts = ["The quick brown fox", "Once upon a time, in a land far away, there lived", "2 + 2 ="]
    free = generate(model, tokenizer, texts, 16, temperature=0, eos_token_ids=[])
    stops = [tokenizer.decode(free.completion_ids[0][4:6]).strip()[:3],
             tokenizer.decode(free.completion_ids[2][9:11]).strip()[:2]]
    eos = [free.completion_ids[1][7]]
    ref = generate(model, tokenizer, texts, 16, temperature=0, stop_strings=stops, eos_token_ids=eos)
    assert "stop" in ref.stop_reasons
    for k in (1, 5):  # a stop string is found at the right step whether checked every step or every 5
        out = RolloutEngine(model, check_every=k).generate(tokenizer, texts, 16, temperature=0,
                                                          stop_strings=stops, eos_token_ids=eos)
        assert_same(out, ref)


def test_sampled_logprobs_are_the_policy_logprobs_and_seeded():
    model, ps = tiny("qwen2"), prompts()
    engine = RolloutEngine(model, check_every=4)
    out = engine.generate(None, ps, 10, temperature=0.7, top_p=0.9, top_k=20, seed=3, eos_token_ids=[])
    width = max(len(p) + len(c) for p, c in zip(out.prompt_ids, out.completion_ids))
    for prompt, completion, logprobs in zip(out.prompt_ids, out.completion_ids, out.logprobs):
        expected = policy_logprobs(model, prompt, completion, width, 0.7)
        assert torch.allclose(logprobs, expected, atol=1e-4)
    again = engine.generate(None, ps, 10, temperature=0.7, top_p=0.9, top_k=20, seed=3, eos_token_ids=[])
    assert again.completion_ids == out.completion_ids
    assert engine.generate(None, ps, 10, temperature=0.7, seed=4, eos_token_ids=[]).completion_ids != out.completion_ids


def test_row_seeds_give_each_row_what_a_one_row_run_gives():
    """Data-parallel ranks sample what one process does: with row_seeds each row draws from its own generator, so
    the engine (padding rows, compaction as rows end) gives every row what the reference gives it, and what a run
    of that row alone with its seed gives."""
    model, ps = tiny(), prompts(6)
    group = [p for p in ps for _ in range(2)]  # 12 rows -> bucket 16: 4 padding rows
    seeds = list(range(40, 40 + len(group)))
    kw = dict(temperature=1.0, top_k=40)
    free = generate(model, None, group, 16, eos_token_ids=[], row_seeds=seeds, **kw)
    eos = sorted({row[3] for row in free.completion_ids[::3]})  # some rows end early: compaction
    engine = RolloutEngine(model, check_every=2)
    out = engine.generate(None, group, 16, eos_token_ids=eos, row_seeds=seeds, **kw)
    assert engine.cap_rows == 16 and engine.stats["compactions"] >= 1
    assert_same(out, generate(model, None, group, 16, eos_token_ids=eos, row_seeds=seeds, **kw))
    for i, (prompt, seed) in enumerate(zip(group, seeds)):
        assert_same(engine.generate(None, [prompt], 16, eos_token_ids=eos, row_seeds=[seed], **kw), out.select([i]))
    assert len({tuple(c) for c in out.completion_ids}) > len(ps)  # a prompt's two rows draw apart


def test_each_distinct_prompt_is_prefilled_once_in_the_engine(monkeypatch):
    """GRPO groups repeat every prompt: the engine prefills the distinct prompts only (padding rows are one more) and
    copies their cache rows, giving the same tokens, and log-probs up to float rounding, as a prefill of every row."""
    model, ps = tiny("qwen2"), prompts(n=3)
    group = [p for p in ps for _ in range(4)]  # 12 rows -> bucket 16: 4 padding rows
    engine = RolloutEngine(model, check_every=4)
    prefill_rows = []
    real = RolloutEngine._prefill

    def counting(self, ids, rows, prompt_len):
        prefill_rows.append(rows)
        return real(self, ids, rows, prompt_len)

    monkeypatch.setattr(RolloutEngine, "_prefill", counting)
    kw = dict(temperature=1.0, seed=5, eos_token_ids=[])
    shared = engine.generate(None, group, 12, **kw)
    assert prefill_rows == [len(ps) + 1]
    monkeypatch.setattr(RolloutEngine, "_prefill_once_per_prompt",
                        lambda self, ids, valid, rows, prompt_len: self._prefill(ids.to(self.device), rows, prompt_len))
    every = engine.generate(None, group, 12, **kw)
    assert prefill_rows == [len(ps) + 1, 16]
    assert shared.completion_ids == every.completion_ids
    for a, b in zip(shared.logprobs, every.logprobs):
        assert torch.allclose(a, b, atol=1e-5)


def test_lora_updates_and_aqn_noise_are_read_live():
    """The trainer's pattern: one engine, adapters stepped in place by the optimizer, noise written into norms."""
    model, ps = tiny("qwen2"), prompts()
    params = apply_lora(model, LoraSettings(rank=4, alpha=8, train_norms=True))
    with torch.no_grad():
        for p in params:
            p.add_(0.1 * torch.randn_like(p))
    engine = RolloutEngine(model, check_every=3)
    optimizer = torch.optim.AdamW(params, lr=0.05)
    noise = NoiseInjector(model)
    for step in range(2):
        with noise.noisy(0.05, seed=step):
            assert_same(engine.generate(None, ps, 12, temperature=0, eos_token_ids=[]),
                        generate(model, None, ps, 12, temperature=0, eos_token_ids=[]))
        model.train()
        model(torch.tensor(ps[0])[None]).float().logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        model.eval()
    signature = engine._signature_seen
    with adapters_disabled(model):  # swaps norm storage: the engine must notice (graphs would be stale)
        assert_same(engine.generate(None, ps, 12, temperature=0, eos_token_ids=[]),
                    generate(model, None, ps, 12, temperature=0, eos_token_ids=[]))
        assert engine._signature_seen != signature


def test_graphs_prepared_ahead_are_kept_by_the_first_rollout():
    """`prepare` captures the decode graphs before a rollout; a quantized layer's first GPU call (its prefill)
    repacks its weight and drops its own buffers. The next rollout must see no change, or it recaptures every graph
    inside the rollout (a fresh 7B model's first timed rollout paid that). A buffer replaced on the model's first
    forward stands in for the repack here."""
    model, ps = tiny(), prompts(2)
    layer = model.model.layers[0].mlp
    layer.register_buffer("repacked", torch.zeros(4))

    def repack_once(module, args):
        if not getattr(module, "_repacked_once", False):
            module.repacked = torch.zeros(4)  # a new address, as a GPU GEMM's own copy of the weight
            module._repacked_once = True

    layer.register_forward_pre_hook(repack_once)
    engine = RolloutEngine(model)
    engine.prepare(len(ps), max(map(len, ps)), 6)
    assert engine._signature_seen == engine._signature(sync=False)  # what prepare captured still holds
    seen = engine._signature_seen
    engine.generate(None, ps, 6, temperature=0, eos_token_ids=[])
    assert engine._signature_seen == seen


def test_generate_fast_keeps_one_engine_and_leaves_the_model_clean():
    model, ps = tiny(), prompts(3)
    out = generate_fast(model, None, ps, 6, temperature=0, eos_token_ids=[])
    assert_same(out, generate(model, None, ps, 6, temperature=0, eos_token_ids=[]))
    engine = engine_for(model)
    assert engine.caches is not None and engine.memory_bytes() > 0
    assert all(layer.self_attn.kv_cache is None for layer in model.model.layers)  # training forward unaffected
    assert engine._signature_seen == engine._signature()  # the next rollout finds no change: it keeps its graphs
    assert "_qerl_rollout_engine" not in dict(model.named_modules()) and engine_for(model) is engine
    generate_fast(model, None, ps[:2], 4, temperature=0)
    assert engine_for(model) is engine and engine.cap_rows == 4  # smaller calls reuse the allocation
    empty = generate_fast(model, None, ps, 0)
    assert empty.completion_ids == [[]] * 3 and empty.stop_reasons == ["length"] * 3
    release_engine(model)
    assert engine.caches is None and engine_for(model) is not engine


def test_the_model_takes_its_caches_one_per_layer():
    model = tiny()
    with pytest.raises(ValueError, match="1 KV caches for 2 layers"):
        model.use_kv_caches([None])


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_new_tokens=-1), "max_new_tokens"), (dict(seed=1, generator=torch.Generator()), "seed or generator"),
    (dict(stop_strings=["x"]), "tokenizer")])
def test_rejects_bad_arguments(kwargs, match):
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        RolloutEngine(tiny()).generate(None, prompts(2), **kwargs)


@interpreter_only
def test_triton_kernels_in_the_interpreter():
    """The fused kernels against the ops they replace (fp32), and a whole fused rollout, in Triton's interpreter."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch, torch.nn.functional as F
        from qerl.execution import fused_ops as K
        from qerl.execution.training_ops import rope_eager as apply_rope
        from qerl.model.transformer import RMSNorm
        from qerl.rollout import engine as E
        from qerl.rollout.generate import generate
        from tests.rollout.test_engine import tiny, prompts
        torch.manual_seed(0)
        x, r = torch.randn(3, 48), torch.randn(3, 48)
        norm = RMSNorm(48, 1e-5)
        norm.weight.data.uniform_(0.5, 1.5)
        h, y = K.fused_add_rmsnorm(x.clone(), r, norm.weight, 1e-5)
        assert torch.equal(h, x + r) and (y - norm(x + r)).abs().max() < 1e-6
        g, u = torch.randn(4, 40), torch.randn(4, 40)
        assert (K.fused_silu_mul(g, u) - F.silu(g) * u).abs().max() < 1e-6
        g, u = torch.randn(4, 80).split(40, -1)  # the halves of a fused gate_up output: strided rows
        assert (K.fused_silu_mul(g, u) - F.silu(g) * u).abs().max() < 1e-6
        qn, kn = RMSNorm(16, 1e-6), RMSNorm(16, 1e-6)
        qn.weight.data.uniform_(0.5, 1.5); kn.weight.data.uniform_(0.5, 1.5)
        # LoRA's update left to the kernels (DeferredLoRA): h = x·Aᵀ in one launch (several splits, row and rank
        # blocks; the tile counters end at zero for the next launch), then added by the norm, SiLU·up and RoPE
        from qerl.execution.low_rank import DeferredLoRA
        for n, kdim, rank in ((3, 300, 12), (20, 1000, 40), (33, 700, 80)):
            xs, a = torch.randn(n, kdim), torch.randn(rank, kdim)
            got = K.lora_shrink(xs, a)
            assert (got - xs @ a.T).abs().max() < 1e-3 and torch.equal(got, K.lora_shrink(xs, a))
            assert K._COUNTERS["cpu"].abs().sum() == 0
        x6, base, hh, bb = torch.randn(3, 600), torch.randn(3, 600), torch.randn(3, 4), torch.randn(600, 4)
        norm6 = RMSNorm(600, 1e-5)
        norm6.weight.data.uniform_(0.5, 1.5)
        for _ in range(2):  # 3 chunks per row: the last to finish normalizes the row; its counter is reset
            h2, y2 = K.fused_add_rmsnorm(x6.clone(), base, norm6.weight, 1e-5,
                                         DeferredLoRA(base, hh, bb, 0.5, ((0, 0, 4),)))
            ref = x6 + (base + 0.5 * hh @ bb.T)
            assert (h2 - ref).abs().max() < 1e-5 and (y2 - norm6(ref)).abs().max() < 1e-5
            assert K._COUNTERS["cpu"].abs().sum() == 0
        a6 = torch.randn(40, 600)  # and the next projection's x·Aᵀ of the normed rows, with or without a residual;
        for n in (3, K.LOW_RANK_IN_NORM_MAX_ROWS + 1):  # in one kernel, or (many rows) the products by cuBLAS
            x6, base, hh = torch.randn(n, 600), torch.randn(n, 600), torch.randn(n, 4)
            kept = base.clone()
            for residual, lr in ((base, DeferredLoRA(base, hh, bb, 0.5, ((0, 0, 4),))), (None, None)):
                h3, y3, xa = K.fused_add_rmsnorm(x6.clone(), residual, norm6.weight, 1e-5, lr, a6)
                ref = x6 + (base + 0.5 * hh @ bb.T) if residual is not None else x6
                assert (y3 - norm6(ref)).abs().max() < 1e-5 and (xa - norm6(ref) @ a6.T).abs().max() < 1e-3
                assert (h3 - ref).abs().max() < 1e-5
            assert torch.equal(base, kept)  # the residual is read, never written
        g, u = torch.randn(5, 80).split(40, -1)
        hh, bb = torch.randn(5, 8), torch.zeros(80, 8)
        bb[:40, :3], bb[40:, 3:] = torch.randn(40, 3), torch.randn(40, 5)  # block-diagonal: ranks 3 and 5
        full = torch.cat([g, u], -1) + 0.7 * hh @ bb.T
        got = K.fused_silu_mul(g, u, DeferredLoRA(None, hh, bb, 0.7, ((0, 0, 3), (40, 3, 5))))
        assert (got - F.silu(full[:, :40]) * full[:, 40:]).abs().max() < 1e-5
        rows, H, Hkv, D = 3, 4, 2, 16
        fused_qkv = torch.randn(rows, (H + 2 * Hkv) * D)
        hh, bb = torch.randn(rows, 8), torch.zeros((H + 2 * Hkv) * D, 8)
        bb[:H * D, :4], bb[(H + Hkv) * D:, 4:] = torch.randn(H * D, 4), torch.randn(Hkv * D, 4)  # k has no adapter
        lr = DeferredLoRA(fused_qkv, hh, bb, 0.3, ((0, 0, 4), (H * D, 4, 0), ((H + Hkv) * D, 4, 4)))
        kc, vc = torch.zeros(4, Hkv, 8, D), torch.zeros(4, Hkv, 8, D)
        q, k, v = fused_qkv.split([H * D, Hkv * D, Hkv * D], -1)
        ang = torch.randn(rows, D // 2)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        qo = K.fused_rope_cache(q, k, v, cos, sin, torch.tensor([5]), kc, vc, H, Hkv, D, low_rank=lr)
        q_ref, k_ref, v_ref = (fused_qkv + 0.3 * hh @ bb.T).split([H * D, Hkv * D, Hkv * D], -1)
        assert (qo.view(rows, H, D) - apply_rope(q_ref.reshape(rows, H, D), cos[:, None], sin[:, None])).abs().max() < 1e-5
        assert (kc[:rows, :, 5] - apply_rope(k_ref.reshape(rows, Hkv, D), cos[:, None], sin[:, None])).abs().max() < 1e-5
        assert (vc[:rows, :, 5] - v_ref.reshape(rows, Hkv, D)).abs().max() < 1e-5
        q, k, v = torch.randn(rows, (H + 2 * Hkv) * D).split([H * D, Hkv * D, Hkv * D], -1)  # a fused qkv output
        for q_norm, k_norm in ((None, None), (qn, kn)):
            kc, vc = torch.zeros(4, Hkv, 8, D), torch.zeros(4, Hkv, 8, D)
            qo = K.fused_rope_cache(q, k, v, cos, sin, torch.tensor([5]), kc, vc, H, Hkv, D, q_norm, k_norm)
            q_ref, k_ref = q.view(rows, H, D), k.view(rows, Hkv, D)
            if q_norm is not None:
                q_ref, k_ref = q_norm(q_ref), k_norm(k_ref)
            q_ref, k_ref = apply_rope(q_ref, cos[:, None], sin[:, None]), apply_rope(k_ref, cos[:, None], sin[:, None])
            assert (qo.view(rows, H, D) - q_ref).abs().max() < 1e-5
            assert (kc[:rows, :, 5] - k_ref).abs().max() < 1e-5 and torch.equal(vc[:rows, :, 5], v.view(rows, Hkv, D))
            assert kc[:, :, :5].abs().sum() == 0 and kc[rows:].abs().sum() == 0  # nothing else written
        for rows, Hkv, G, window in ((3, 2, 2, 40), (2, 1, 3, 100)):  # several splits; a group padded to 16
            D = 16
            q = torch.randn(rows, Hkv * G * D)
            kc, vc = torch.randn(rows + 1, Hkv, window + 7, D), torch.randn(rows + 1, Hkv, window + 7, D)
            mask = torch.zeros(rows, window)
            mask[0, :5] = float("-inf")  # left padding
            mask[1, window - 3:] = float("-inf")
            ref = F.scaled_dot_product_attention(q.view(rows, Hkv, G, D), kc[:rows, :, :window], vc[:rows, :, :window],
                                                 attn_mask=mask[:, None, None, :]).reshape(rows, -1)
            for programs in (16, 1):  # 1: one split, the output written directly (no combine)
                got = K.decode_attention(q, kc, vc, mask, Hkv * G, Hkv, D, target_programs=programs)
                assert (got - ref).abs().max() < 1e-4, (programs, (got - ref).abs().max())
        from qerl.model.lora import LoraSettings, apply_lora
        for model_type, fuse in (("qwen2", False), ("qwen3", False), ("qwen2", True), ("qwen3", True)):
            model, ps = tiny(model_type, layers=1), prompts(3)
            for p in apply_lora(model, LoraSettings(rank=4, alpha=8)):  # LoRA's addmm path runs too
                p.data.normal_(0, 0.1)
            if fuse:  # one q/k/v and one gate/up GEMM: the kernels read column slices of their outputs
                assert model.fuse_projections() == 2
            engine = E.RolloutEngine(model, check_every=2)
            assert engine.kernels
            out = engine.generate(None, ps, 5, temperature=0, eos_token_ids=[])
            assert out.completion_ids == generate(model, None, ps, 5, temperature=0, eos_token_ids=[]).completion_ids
        print("ok")
    """)
    run_in_interpreter(code)


def test_fp8_kv_layout_round_trips_within_e4m3_rounding():
    """qerl.execution.kv8: each vector comes back within half an E4M3 step of its scale (2^-4 relative to its largest
    entry), a zero vector stays zero, and the packed row is 16 bytes longer than head_dim."""
    from qerl.execution import kv8
    torch.manual_seed(0)
    x = torch.randn(3, 2, 5, 64) * torch.logspace(-3, 3, 5)[:, None]  # vectors of very different sizes
    x[0, 0, 0] = 0
    packed = kv8.pack(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 2, 5, kv8.packed_dim(64)) == (3, 2, 5, 80)
    back = kv8.unpack(packed, torch.float32)
    err = (back - x).abs() / x.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    assert err.max() <= 2 ** -4 and torch.equal(back[0, 0, 0], torch.zeros(64))
    assert packed[..., 68:].eq(0).all()  # padding after the scale


@interpreter_only
def test_fp8_kv_kernels_in_the_interpreter():
    """The FP8 KV layout in the decode kernels (Triton's interpreter): the RoPE kernel writes each k and v vector as
    kv8.pack writes it (codes within one E4M3 step, the scale exact); attention over packed caches equals SDPA over
    their unpacked values; an engine rollout with kv_cache_dtype=fp8 keeps its cache packed and samples what the
    model-dtype engine samples at temperature 0 for a smooth tiny model."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch, torch.nn.functional as F
        from qerl.execution import fused_ops as K, kv8
        from qerl.execution.training_ops import rope_eager as apply_rope
        torch.manual_seed(0)
        rows, H, Hkv, D = 3, 4, 2, 16
        q, k, v = (torch.randn(rows, (H + 2 * Hkv) * D) * 3).split([H * D, Hkv * D, Hkv * D], -1)
        ang = torch.randn(rows, D // 2)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        kc, vc = (torch.zeros(4, Hkv, 8, kv8.packed_dim(D), dtype=torch.uint8) for _ in range(2))
        K.fused_rope_cache(q, k, v, cos, sin, torch.tensor([5]), kc, vc, H, Hkv, D)
        k_ref = apply_rope(k.reshape(rows, Hkv, D), cos[:, None], sin[:, None])
        for cache, ref in ((kc, k_ref), (vc, v.reshape(rows, Hkv, D))):
            want = kv8.pack(ref)
            got = cache[:rows, :, 5]
            assert torch.equal(got[..., D:], want[..., D:]), "scales"
            codes = lambda t: t[..., :D].contiguous().view(torch.float8_e4m3fn).float()
            step = codes(want).abs().clamp_min(2 ** -6) * 2 ** -3  # one E4M3 step
            # Triton 3.9's interpreter drops the carry of a round-up into the exponent (124 -> 64, not 128; the
            # GPU's cvt does not: test_gpu_fp8_kv_cache_kernels checks the bytes there)
            carry = codes(got) * 2 == codes(want)
            assert (((codes(got) - codes(want)).abs() <= step) | carry).all()
            assert cache[:, :, :5].eq(0).all() and cache[rows:].eq(0).all()  # nothing else written
        for rows, Hkv, G, window, programs in ((3, 2, 2, 40, 16), (2, 1, 3, 100, 16), (3, 2, 2, 40, 1)):
            q = torch.randn(rows, Hkv * G * D)
            kf, vf = torch.randn(rows + 1, Hkv, window + 7, D) * 4, torch.randn(rows + 1, Hkv, window + 7, D)
            kp, vp = kv8.pack(kf), kv8.pack(vf)
            mask = torch.zeros(rows, window)
            mask[0, :5] = float("-inf")
            got = K.decode_attention(q, kp, vp, mask, Hkv * G, Hkv, D, target_programs=programs)
            ref = F.scaled_dot_product_attention(q.view(rows, Hkv, G, D),
                                                 kv8.unpack(kp[:rows, :, :window], torch.float32),
                                                 kv8.unpack(vp[:rows, :, :window], torch.float32),
                                                 attn_mask=mask[:, None, None, :]).reshape(rows, -1)
            assert (got - ref).abs().max() < 5e-3, (got - ref).abs().max()  # fp16 operands (q, probabilities)
        from qerl.rollout import engine as E
        from tests.rollout.test_engine import prompts, tiny
        model = tiny("qwen2", layers=2)
        for p in model.parameters():
            p.data.mul_(0.3)  # a smooth model: FP8's rounding moves no greedy token
        ps = prompts(3)
        plain = E.RolloutEngine(model, check_every=2).generate(None, ps, 6, temperature=0, eos_token_ids=[])
        engine = E.RolloutEngine(model, check_every=2, kv_cache_dtype="fp8")
        assert engine.kv8
        out = engine.generate(None, ps, 6, temperature=0, eos_token_ids=[])
        assert engine.caches[0].k.dtype == torch.uint8
        assert out.completion_ids == plain.completion_ids
        gap = max((a - b).abs().max().item() for a, b in zip(out.logprobs, plain.logprobs))
        assert gap < 0.05, gap
        print("ok")
    """)
    run_in_interpreter(code)


@interpreter_only
def test_fused_sampler_log_probs_stay_finite_where_whole_blocks_are_minus_inf_in_the_interpreter():
    """Logits masked to -inf over whole blocks (a logits processor forcing EOS, a banned-token list): the drawn
    token's log-prob is log_softmax's, not NaN. A block of -inf before any finite entry of its program's chunk made
    the online log-sum-exp 0 * exp(-inf - -inf) = NaN; on 2026-12-02 every traced EOS of the ragged benchmarks got a
    NaN log-prob on the GPU, and the rollout correction (grpo.correction: tis, on NVFP4 by default) turned the
    first update's loss and the LoRA weights NaN."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch
        from qerl.execution import fused_ops as K
        logits = torch.full((5, 70), float("-inf"))
        logits[0, 69] = 0.0  # the only finite entry in the last block: forced EOS
        logits[1, 20] = 1.0; logits[1, 50] = 2.0  # finite entries after -inf blocks, in different splits
        logits[2, 0] = 0.5; logits[2, 68] = 0.5  # finite at both ends, -inf blocks between
        logits[3] = torch.randn(70)  # nothing masked
        logits[4, 33] = -3.0
        for programs in (1, 528):  # one program per row, and chunks split across programs
            tok, logp = K.fused_sample(logits, 1.0, torch.Generator().manual_seed(3), block=16,
                                       target_programs=programs)
            want = torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]
            assert torch.isfinite(logp).all(), (programs, logp)
            assert (logp - want).abs().max() < 1e-5, (programs, logp, want)
            assert tok[0] == 69 and tok[4] == 33 and tok[1] in (20, 50) and tok[2] in (0, 68)
        print("ok")
    """)
    run_in_interpreter(code)


@interpreter_only
def test_fused_sampler_draws_the_tempered_distribution_in_the_interpreter():
    """The one-pass sampling kernel: log-probs are log_softmax(logits / T) of the drawn token, the draws follow that
    distribution (frequencies over many rows), a seeded generator repeats them, and every token can come out."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch
        from qerl.execution import fused_ops as K
        from qerl.rollout.sampling import sample_tokens
        torch.manual_seed(0)
        t = 0.7
        base = torch.randn(37) * 1.5  # 37 entries, 16 per block: the online log-sum-exp crosses blocks
        logits = base.expand(40, 37).contiguous()
        tok, logp = K.fused_sample(logits, t, torch.Generator().manual_seed(1), block=16)
        assert tok.dtype == torch.long and logp.dtype == torch.float32
        assert (logp - torch.log_softmax(base / t, -1)[tok]).abs().max() < 1e-5
        # 40 rows share ~528 programs: 3 splits of 16 entries; one program per row draws the same tokens
        one, logp_one = K.fused_sample(logits, t, torch.Generator().manual_seed(1), block=16, target_programs=1)
        assert torch.equal(tok, one) and (logp - logp_one).abs().max() < 1e-6
        probs = torch.tensor([0.5, 0.25, 0.15, 0.1])  # tempered: p^(1/t) renormalized
        logits = (probs.log() * t).expand(600, 4).contiguous()
        tok, _ = sample_tokens(logits, t, generator=torch.Generator().manual_seed(1))
        freq = torch.bincount(tok, minlength=4).float() / 600
        assert (freq - probs).abs().max() < 0.07, freq  # 3.4 standard errors at p = 0.5
        few = logits[:60]  # repeats on fewer rows (each row is a program in the interpreter: ~20 ms of CPU)
        first, _ = sample_tokens(few, t, generator=torch.Generator().manual_seed(1))
        again, _ = sample_tokens(few, t, generator=torch.Generator().manual_seed(1))
        other, _ = sample_tokens(few, t, generator=torch.Generator().manual_seed(2))
        assert torch.equal(first, again) and not torch.equal(first, other)  # 60 rows alike by chance: p < 1e-27
        print("ok")
    """)
    run_in_interpreter(code)


@interpreter_only
def test_row_keyed_top_k_and_top_p_draw_in_the_kernel_in_the_interpreter():
    """With row keys, top-k/top-p restrict the logits and the keyed kernel draws from them: one launch for the
    batch where the generators' path took one per row (the engine's rollouts with rollout.top_p < 1). The support is
    the restricted one, the frequencies are its renormalized probabilities, the log-probs the full policy's, a row
    draws alone what it draws in its batch, and a whole block outside the support costs the kernel nothing."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch
        from qerl.execution import fused_ops as K
        from qerl.rollout.sampling import restrict, sample_tokens, step_keys
        probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
        logits = probs.log().expand(300, 4).contiguous()
        gens = [torch.Generator().manual_seed(s) for s in range(300)]
        states = [g.get_state() for g in gens]
        keys = step_keys(torch.arange(300), step=0)
        for kwargs, support in [(dict(top_k=2), {0, 1}), (dict(top_p=0.75), {0, 1}), (dict(top_p=0.9), {0, 1, 2})]:
            tok, logp = sample_tokens(logits[:40], 1.0, generator=gens[:40], row_keys=keys[:40], **kwargs)
            assert set(tok.tolist()) == support, (kwargs, tok)
            assert torch.allclose(logp, probs.log()[tok])  # the untruncated policy's log-probs
        tok, _ = sample_tokens(logits, 1.0, generator=gens, row_keys=keys, top_p=0.9)
        freq = torch.bincount(tok, minlength=4).float() / 300
        assert (freq - torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95).abs().max() < 0.1, freq  # 3.5 s.e. at p = 0.53
        assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, states))  # the kernel drew
        alone, _ = sample_tokens(logits[7:8], 1.0, generator=gens[7:8], row_keys=keys[7:8], top_p=0.9)
        assert alone.item() == tok[7].item()
        torch.manual_seed(0)
        wide = torch.randn(6, 37) * 1.5  # 16 entries a block: top-2 leaves whole blocks outside the support
        kept = restrict(wide, top_k=2, fill=torch.finfo(torch.float32).min)
        tok, logp = K.fused_sample(kept, 1.0, block=16, seeds=keys[:6])
        top2 = wide.topk(2, -1).indices
        assert all(t in row for t, row in zip(tok.tolist(), top2.tolist())) and torch.isfinite(logp).all()
        print("ok")
    """)
    run_in_interpreter(code)


@interpreter_only
def test_row_keyed_sampler_draws_each_row_alone_in_the_interpreter():
    """With row_seeds the one-pass kernel keys each row by its own seed and the step (`step_keys`): a row draws the
    same token whatever rows share its batch and however the vocabulary is split, the draws follow the tempered
    distribution, and the engine takes that kernel (not one launch per row) where it runs."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch
        from qerl.execution import fused_ops as K
        from qerl.rollout.sampling import sample_tokens, step_keys
        torch.manual_seed(0)
        t = 0.7
        logits = torch.randn(12, 37) * 1.5
        keys = step_keys(torch.arange(100, 112), step=3)
        tok, logp = K.fused_sample(logits, t, block=16, seeds=keys)
        assert (logp - torch.log_softmax(logits / t, -1).gather(-1, tok[:, None])[:, 0]).abs().max() < 1e-5
        for i in (0, 5, 11):  # alone, and beside other rows in another order, with one program per row
            alone, _ = K.fused_sample(logits[i:i + 1], t, block=16, seeds=keys[i:i + 1], target_programs=1)
            assert alone.item() == tok[i].item()
        flipped, _ = K.fused_sample(logits.flip(0), t, block=16, seeds=keys.flip(0))
        assert torch.equal(flipped.flip(0), tok)
        assert not torch.equal(step_keys(torch.arange(100, 112), step=4), keys)  # the next step draws anew
        probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
        many = (probs.log() * t).expand(300, 4).contiguous()  # a program per row: ~20 ms each
        gens = [torch.Generator().manual_seed(s) for s in range(300)]
        states = [g.get_state() for g in gens]
        drawn, _ = sample_tokens(many, t, generator=gens, row_keys=step_keys(torch.arange(300), step=0))
        freq = torch.bincount(drawn, minlength=4).float() / 300
        assert (freq - probs).abs().max() < 0.1, freq  # 3.5 standard errors at p = 0.5
        assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, states))  # the kernel drew, not the generators
        sample_tokens(many[:2], t, generator=gens[:2])  # (without keys they draw: the check above can fail)
        assert not torch.equal(gens[0].get_state(), states[0])
        from qerl.rollout.engine import RolloutEngine
        from tests.rollout.test_engine import tiny, prompts
        model, ps = tiny(), prompts(3)  # 3 rows, bucket 4: slots keep their rows' keys through padding, compaction
        free = RolloutEngine(model, fused=False).generate(None, ps, 8, row_seeds=range(3), eos_token_ids=[])
        eos = sorted({row[2] for row in free.completion_ids[::2]})
        engine = RolloutEngine(model, fused=False, check_every=2)  # the plain decode step: the sampler is tested
        out = engine.generate(None, ps, 8, row_seeds=range(3), eos_token_ids=eos)
        assert engine.stats["compactions"] >= 1
        for i in range(3):
            assert engine.generate(None, [ps[i]], 8, row_seeds=[i], eos_token_ids=eos).completion_ids[0] \
                == out.completion_ids[i]
        print("ok")
    """)
    run_in_interpreter(code)


def test_triton_kernels_pass_the_compiler_frontend_for_sm90():
    """Typing errors the interpreter lets through (e.g. a name that is a pointer in one branch, an int in the other)
    fail here, through Triton's real AST -> TTIR lowering for an H100, with no GPU needed."""
    pytest.importorskip("triton")
    try:
        from triton._C.libtriton import ir
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.compiler import ASTSource

        from qerl.execution import fused_ops as K
        target = GPUTarget("cuda", 90, 32)
        backend = CUDABackend(target)
    except Exception as e:  # internal API of another Triton version
        pytest.skip(f"Triton compiler internals unavailable: {e}")
    if K.triton is None:
        pytest.skip("qerl.execution.fused_ops imported without triton")

    def lower(fn, signature, constexprs):
        if "PDL" in fn.arg_names:  # the decode kernels' programmatic-dependent-launch calls (kernels/pdl.py) too
            signature, constexprs = {**signature, "PDL": "constexpr"}, {**constexprs, "PDL": True}
        options = backend.parse_options({"num_warps": 4})
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        ASTSource(fn, signature, constexprs=constexprs).make_ir(
            target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)

    for p in ("*bf16", "*fp32"):
        for res in (False, True):
            lower(K._add_rmsnorm_kernel, {"X": p, "R": p, "W": p, "Y": p, "N": "i32", "eps": "fp32",
                                          "HAS_RES": "constexpr", "BLOCK": "constexpr"}, {"HAS_RES": res, "BLOCK": 4096})
        for qk, low_rank, kv8 in ((False, False, False), (True, False, False), (False, True, False),
                                  (True, True, False), (False, True, True)):
            c = "*u8" if kv8 else p  # the FP8 KV layout (qerl.execution.kv8)
            lower(K._rope_cache_kernel,
                  {"Q": p, "K": p, "V": p, "COS": "*fp32", "SIN": "*fp32", "QO": p, "KC": c, "VC": c,
                   "SLOT": "*i64", "QW": p, "KW": p, "eps": "fp32", "H": "i32", "HKV": "i32", "s_b": "i32",
                   "s_h": "i32", "s_s": "i32", "s_q": "i32", "s_k": "i32", "s_v": "i32", "HL": p, "LB": p,
                   "s_hl": "i32", "s_lb": "i32", "lr_scale": "fp32", "q_col": "i32", "q_rank": "i32",
                   "k_col": "i32", "k_rank": "i32", "v_col": "i32", "v_rank": "i32", "k_row0": "i32",
                   "v_row0": "i32", "D": "constexpr", "HALF": "constexpr", "QK_NORM": "constexpr",
                   "LOW_RANK": "constexpr", "RP": "constexpr", "KV8": "constexpr"},
                  {"D": 128, "HALF": 64, "QK_NORM": qk, "LOW_RANK": low_rank, "RP": 16, "KV8": kv8})
        lower(K._lora_shrink_kernel, {"X": p, "A": p, "H": p, "PART": "*fp32", "COUNT": "*i32", "M": "i32",
                                      "K": "i32", "R": "i32", "s_x": "i32", "s_h": "i32", "chunk": "i32",
                                      "splits": "i32", "BM": "constexpr", "RP": "constexpr", "BK": "constexpr"},
              {"BM": 16, "RP": 64, "BK": 128})
        for res, low_in, out in ((True, True, True), (False, False, True), (True, True, False)):
            lower(K._add_low_rank_rmsnorm_kernel,
                  {"X": p, "R": p, "HL": p, "B": p, "W": p, "Y": p, "PART": "*fp32", "COUNT": "*i32", "A": p,
                   "HO": p, "N": "i32", "eps": "fp32", "s_hl": "i32", "s_b": "i32", "col": "i32", "rank": "i32",
                   "lr_scale": "fp32", "rank_out": "i32", "s_ho": "i32", "HAS_RES": "constexpr",
                   "HAS_IN": "constexpr", "HAS_OUT": "constexpr", "RP": "constexpr", "RPO": "constexpr",
                   "CH": "constexpr", "CHUNKS": "constexpr", "BLOCK": "constexpr"},
                  {"HAS_RES": res, "HAS_IN": low_in, "HAS_OUT": out, "RP": 16, "RPO": 64, "CH": 128, "CHUNKS": 28,
                   "BLOCK": 4096})
        lower(K._silu_mul_low_rank_kernel, {"G": p, "U": p, "O": p, "HL": p, "LB": p, "M": "i32", "n": "i32",
                                            "s_g": "i32", "s_u": "i32", "s_hl": "i32", "s_lb": "i32",
                                            "lr_scale": "fp32", "g_col": "i32", "g_rank": "i32", "u_col": "i32",
                                            "u_rank": "i32", "u_row0": "i32", "BM": "constexpr", "RP": "constexpr",
                                            "BLOCK": "constexpr"}, {"BM": 16, "RP": 16, "BLOCK": 256})
        for per_row in (0, 1):
            lower(K._sample_kernel, {"LOGITS": "*fp32", "SEED": "*i64", "PART": "*fp32", "COUNT": "*i32",
                                     "TOK": "*i64", "LOGP": "*fp32", "V": "i32", "stride": "i32", "inv_t": "fp32",
                                     "chunk": "i32", "splits": "i32", "SP": "constexpr", "BLOCK": "constexpr",
                                     "PER_ROW": "constexpr"}, {"SP": 64, "BLOCK": 1024, "PER_ROW": per_row})
        for direct, kv8 in ((False, False), (True, False), (True, True), (False, True)):
            c = "*u8" if kv8 else p
            lower(K._decode_attention_partial_kernel,
                  {"Q": p, "KC": c, "VC": c, "MASK": p, "PO": "*fp32", "PML": "*fp32", "O": p, "s_q": "i32",
                   "s_kb": "i32", "s_kh": "i32", "s_ks": "i32", "s_m": "i32", "window": "i32", "chunk": "i32",
                   "scale": "fp32", "G": "constexpr", "GP": "constexpr", "D": "constexpr", "BLOCK_N": "constexpr",
                   "DIRECT": "constexpr", "KV8": "constexpr"},
                  {"G": 7, "GP": 16, "D": 128, "BLOCK_N": 64, "DIRECT": direct, "KV8": kv8})
        lower(K._decode_attention_combine_kernel, {"PO": "*fp32", "PML": "*fp32", "O": p, "splits": "i32",
                                                   "G": "constexpr", "GP": "constexpr", "D": "constexpr",
                                                   "SPLITS": "constexpr"}, {"G": 7, "GP": 16, "D": 128, "SPLITS": 8})
        lower(K._silu_mul_kernel, {"G": p, "U": p, "O": p, "n": "i32", "s_g": "i32", "s_u": "i32",
                                   "BLOCK": "constexpr"}, {"BLOCK": 1024})


# ---------------------------------------------------------------------------------------------------- GPU


def gpu_model(scheme: str, lora_rank=8, seed=0, fuse=False):
    """A small random Qwen2-shaped model on CUDA in bf16 (or "nvfp4", "fp8", "nf4-bnb") with live, non-zero LoRA;
    `fuse`: q/k/v and gate/up as one GEMM each, as `load_base_model` makes them on CUDA."""
    from qerl.quant.linear import quantize_model

    cfg = ModelConfig.from_hf({"model_type": "qwen2", "hidden_size": 512, "intermediate_size": 1024,
                               "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
                               "vocab_size": 1024, "max_position_embeddings": 1024})
    torch.manual_seed(seed)
    model = Transformer.from_config(cfg, dtype=torch.bfloat16, device="cuda").eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        for layer in model.model.layers:
            for lin in (*[getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")],
                        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                lin.weight.normal_(0, 2.0 / lin.in_features ** 0.5)
    if scheme in ("nvfp4", "fp8"):
        quantize_model(model, scheme)
    elif scheme == "nf4-bnb":
        from qerl.quant.bnb import quantize_model_bnb

        quantize_model_bnb(model)
    params = apply_lora(model, LoraSettings(rank=lora_rank, alpha=2 * lora_rank), dtype=torch.bfloat16)
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.02)
    if fuse:
        assert model.fuse_projections() == 2 * cfg.num_hidden_layers
    return model, params


def _replay_and_eager(engine, rows, window):
    """Logits of one decode step from the captured graph, then from an eager run on the same inputs."""
    assert (rows, window) in engine.graphs  # a replay of the graph captured before, not a fresh capture
    engine.decode(rows, window)
    replayed = engine.logits_buf[:rows].clone()
    engine.use_graphs = False
    try:
        engine.decode_eager(rows, window)  # rewrites the same KV slot with the same values
    finally:
        engine.use_graphs = True
    return replayed, engine.logits_buf[:rows].clone()


@gpu
@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("scheme", ["bf16", "nvfp4", "fp8"])
def test_gpu_graph_replay_equals_eager_and_reads_live_weights(scheme, fuse):
    model, params = gpu_model(scheme, fuse=fuse)
    ps = prompts(24, vocab=1024, seed=5, max_len=40)
    graphed = RolloutEngine(model, check_every=4)
    eager = RolloutEngine(model, use_graphs=False, check_every=4)
    ref = eager.generate(None, ps, 48, temperature=0, eos_token_ids=[])
    eos = sorted({row[7] for row in ref.completion_ids[:6]})  # some rows end early: compaction + smaller buckets
    a = eager.generate(None, ps, 48, temperature=0, eos_token_ids=eos)
    b = graphed.generate(None, ps, 48, temperature=0, eos_token_ids=eos)
    assert graphed.stats["captures"] >= 1 and graphed.use_graphs
    match = sum(x == y for x, y in zip(a.completion_ids, b.completion_ids)) / len(ps)
    print(f"{scheme}: graph/eager rows identical {match:.3f}, captures {graphed.stats}")
    assert match >= (1.0 if scheme == "bf16" else 0.9), match  # split-K reductions may differ at a near-tie
    # Live weights: the trainer steps LoRA in place and AQN writes the norms in place; old graphs must see both.
    graphed._install(24, 88)
    try:
        graphed.slot.fill_(60)
        before, _ = _replay_and_eager(graphed, 32, 256)
        with torch.no_grad():
            for p in params:
                p.add_(0.05 * torch.randn_like(p))
        captures = graphed.stats["captures"]
        graphed._uninstall()
        graphed._install(24, 88)  # as every rollout begins: fused projections re-copy the LoRA factors
        assert graphed.stats["captures"] == captures
        with NoiseInjector(model).noisy(0.05, seed=1):
            replayed, direct = _replay_and_eager(graphed, 32, 256)
    finally:
        graphed._uninstall()
    err, moved = (replayed - direct).abs().max().item(), (replayed - before).abs().max().item()
    print(f"{scheme}: replay vs eager after the update {err:.3g}; change from the update {moved:.3g}")
    assert moved > 0.1 and err <= (1e-3 if scheme == "bf16" else 3e-2) * moved


@gpu
def test_gpu_graphs_outlive_the_update_growing_the_gemm_scratch(monkeypatch):
    """Decode graphs that dequantize into the model's shared GEMM scratch (dequant + cuBLAS) keep reading it at its
    address. The update then dequantizes into it too and grows it; the buffer it replaced must not go to other
    tensors (here: filled with NaN), or the next rollout's replays write over them and read garbage."""
    from qerl.kernels import dispatch
    from qerl.kernels.context import GemmContext

    monkeypatch.setattr(dispatch.Dispatcher, "choose",  # every GEMM through the scratch, as measured picks may
                        lambda self, kind, layout, n, k, m, candidates, timer=None:
                        "dequant_cublas" if "dequant_cublas" in candidates else next(iter(candidates)))
    model, _ = gpu_model("nvfp4", fuse=True)
    ps = prompts(24, vocab=1024, seed=5, max_len=40)
    engine = RolloutEngine(model, check_every=4)
    ref = engine.generate(None, ps, 48, temperature=0, eos_token_ids=[])
    eos = sorted({row[7] for row in ref.completion_ids[:6]})  # rows end early: smaller buckets' graphs too
    first = engine.generate(None, ps, 48, temperature=0, eos_token_ids=eos)
    contexts = {id(c): c for c in (getattr(m, "gemm_context", None) for m in model.modules())
                if isinstance(c, GemmContext)}
    grown = [c.scratch(buf.numel() * 4, buf.dtype, buf.device) for c in contexts.values()
             for buf in list(c._scratch.values())]
    assert grown, "no GEMM ran through the scratch: the test would check nothing"
    junk = [torch.full((64 << 20,), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(8)]
    again = engine.generate(None, ps, 48, temperature=0, eos_token_ids=eos)
    del junk
    assert engine.stats["captures"] >= 2
    assert again.completion_ids == first.completion_ids
    assert all(torch.isfinite(lp).all() for lp in again.logprobs)


@gpu
def test_gpu_releasable_buffer_hands_its_memory_back_and_returns_at_the_same_address():
    from qerl.rollout.releasable import ReleasableBuffer, mapped_bytes

    size, others = 512 << 20, mapped_bytes(0)  # other tests' engines may hold caches of their own
    buf = ReleasableBuffer(size, torch.device("cuda"))
    try:
        address, view = buf.tensor.data_ptr(), buf.tensor.view(torch.float32)
        view.fill_(3.0)
        assert view.sum().item() == 3.0 * view.numel() and mapped_bytes(0) == others + size
        before = torch.cuda.mem_get_info()[0]
        buf.release()
        assert torch.cuda.mem_get_info()[0] - before >= size and not buf.mapped and mapped_bytes(0) == others
        # PyTorch's allocator can use it now; once it keeps almost all of the card cached, the buffer still maps
        # again: restore() hands PyTorch's cached blocks back to the driver and retries.
        hog = torch.empty((torch.cuda.mem_get_info()[0] - size // 2) >> 21 << 21, dtype=torch.uint8, device="cuda")
        del hog
        assert torch.cuda.mem_get_info()[0] < size
        buf.restore()
        assert buf.tensor.data_ptr() == address and buf.mapped
        view.fill_(1.0)
        assert view.sum().item() == view.numel()
    finally:
        buf.close()
    assert mapped_bytes(0) == others


@gpu
def test_gpu_a_dropped_releasable_buffer_and_engine_give_their_memory_back():
    """Nobody calls close() when a run ends: dropping the buffer (and its views), or the engine and model that hold
    them, must unmap the memory, or a process that trains run after run (compare workers) runs out of it."""
    import gc

    from qerl.rollout.releasable import ReleasableBuffer, mapped_bytes

    others = mapped_bytes(0)
    buf = ReleasableBuffer(256 << 20, torch.device("cuda"))
    view = buf.tensor.view(torch.float32)[:1024]
    del buf
    gc.collect()
    assert mapped_bytes(0) == others + (256 << 20)  # a view still uses it
    del view
    gc.collect()
    assert mapped_bytes(0) == others
    model, _ = gpu_model("bf16", fuse=True)
    engine = RolloutEngine(model)
    engine.generate(None, prompts(8, vocab=1024, seed=4, max_len=30), 16, temperature=1.0, seed=7, eos_token_ids=[])
    assert mapped_bytes(0) > others
    del engine, model
    gc.collect()
    assert mapped_bytes(0) == others


@gpu
@pytest.mark.parametrize("scheme", ["bf16", "nvfp4"])
def test_gpu_a_sleeping_kv_cache_frees_its_memory_and_keeps_the_graphs(scheme):
    """The trainer puts the engine's KV cache to sleep for the update: its memory goes back, and the next rollout
    replays the same graphs (no recapture) and samples what it sampled before it slept."""
    model, _ = gpu_model(scheme, fuse=True)
    ps = prompts(16, vocab=1024, seed=4, max_len=30)
    sleeper = RolloutEngine(model)
    ref = sleeper.generate(None, ps, 40, temperature=1.0, seed=7, eos_token_ids=[])
    captures, held = sleeper.stats["captures"], sleeper.memory_bytes()
    cache_bytes = sum(t.numel() * t.element_size() for c in sleeper.caches for t in (c.k, c.v))
    free_before = torch.cuda.mem_get_info()[0]
    sleeper.sleep()
    assert torch.cuda.mem_get_info()[0] - free_before >= cache_bytes
    assert sleeper.memory_bytes() == held - cache_bytes
    with torch.no_grad():  # the update's allocations land where the cache was; the next rollout must not care
        junk = torch.full((cache_bytes // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
        del junk
    again = sleeper.generate(None, ps, 40, temperature=1.0, seed=7, eos_token_ids=[])
    assert sleeper.stats["captures"] == captures
    assert again.completion_ids == ref.completion_ids
    torch.testing.assert_close(torch.cat(again.logprobs), torch.cat(ref.logprobs), atol=0, rtol=0)
    sleeper.free()


@gpu
@pytest.mark.parametrize("scheme", ["bf16", "nvfp4", "fp8"])
def test_gpu_a_second_rollout_replays_the_first_ones_graphs(scheme):
    """During the first rollout a quantized layer's first GPU call repacks its weight for the GEMM backend (its own
    buffers go) and each fused group's GEMM comes to exist: neither may look like a model change to the next
    rollout, which would recapture every graph (it did, once per run, ~0.6 s of a 7B step)."""
    model, _ = gpu_model(scheme, fuse=True)
    ps = prompts(8, vocab=1024, seed=3, max_len=30)
    engine = RolloutEngine(model)
    engine.generate(None, ps, 24, temperature=0, eos_token_ids=[])
    captures = engine.stats["captures"]
    assert captures >= 1
    engine.generate(None, ps, 24, temperature=0, eos_token_ids=[])
    assert engine.stats["captures"] == captures


@gpu
def test_gpu_fp8_kv_cache_kernels():
    """The FP8 KV layout on the GPU: the RoPE kernel writes v's bytes exactly as qerl.execution.kv8.pack (the same
    E4M3 rounding in the hardware's cvt), k's codes within one E4M3 step (RoPE's fp32 order differs), every scale
    within 1 ulp; attention over the packed caches equals SDPA over their unpacked values."""
    import torch.nn.functional as F

    from qerl.execution import fused_ops as K
    from qerl.execution import kv8
    from qerl.execution.training_ops import rope_eager as apply_rope
    torch.manual_seed(0)
    rows, H, Hkv, D = 64, 28, 4, 128
    q, k, v = (torch.randn(rows, (H + 2 * Hkv) * D, device="cuda") * 3).bfloat16().split([H * D, Hkv * D, Hkv * D], -1)
    ang = torch.randn(rows, D // 2, device="cuda")
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    kc, vc = (torch.zeros(rows, Hkv, 8, kv8.packed_dim(D), dtype=torch.uint8, device="cuda") for _ in range(2))
    K.fused_rope_cache(q, k, v, cos, sin, torch.tensor([5], device="cuda"), kc, vc, H, Hkv, D)
    assert torch.equal(vc[:, :, 5], kv8.pack(v.reshape(rows, Hkv, D)))
    want = kv8.pack(apply_rope(k.reshape(rows, Hkv, D).float(), cos[:, None], sin[:, None]).bfloat16())
    codes = lambda t: t[..., :D].contiguous().view(torch.float8_e4m3fn).float()  # noqa: E731
    assert ((codes(kc[:, :, 5]) - codes(want)).abs() <= codes(want).abs().clamp_min(2 ** -6) / 8).all()
    assert torch.allclose(kv8.unpack(kc[:, :, 5], torch.float32), kv8.unpack(want, torch.float32), rtol=0.07,
                          atol=1e-3)
    assert kc[:, :, :5].eq(0).all() and vc[:, :, 6:].eq(0).all()
    for window in (256, 1024):
        qa = torch.randn(rows, H * D, device="cuda").bfloat16()
        kp = kv8.pack(torch.randn(rows, Hkv, window, D, device="cuda") * 5)
        vp = kv8.pack(torch.randn(rows, Hkv, window, D, device="cuda"))
        mask = torch.zeros(rows, window, device="cuda", dtype=torch.bfloat16)
        mask[::3, :17] = float("-inf")
        got = K.decode_attention(qa, kp, vp, mask, H, Hkv, D).float()
        ref = F.scaled_dot_product_attention(qa.float().view(rows, Hkv, H // Hkv, D), kv8.unpack(kp, torch.float32),
                                             kv8.unpack(vp, torch.float32),
                                             attn_mask=mask.float()[:, None, None, :]).reshape(rows, -1)
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2


@gpu
@pytest.mark.parametrize("scheme, fuse, kv", [("bf16", False, "model"), ("bf16", True, "model"),
                                              ("nvfp4", True, "model"), ("nvfp4", True, "fp8")])
def test_gpu_fused_step_matches_the_model_forward(scheme, fuse, kv):
    model, _ = gpu_model(scheme, fuse=fuse)
    ps = prompts(16, vocab=1024, seed=2, max_len=30)
    fused = RolloutEngine(model, use_graphs=False, kv_cache_dtype=kv).generate(None, ps, 24, temperature=0.8, seed=0,
                                                                               eos_token_ids=[])
    plain = RolloutEngine(model, use_graphs=False, fused=False)
    # Score the fused engine's samples with the reference path (teacher forcing through Transformer.forward).
    width = max(len(p) + len(c) for p, c in zip(fused.prompt_ids, fused.completion_ids))
    pairs = list(zip(fused.prompt_ids, fused.completion_ids))
    ids = torch.tensor([[0] * (width - len(p) - len(c)) + p + c for p, c in pairs])
    mask = torch.tensor([[0] * (width - len(p) - len(c)) + [1] * (len(p) + len(c)) for p, c in pairs])
    with torch.no_grad():
        logits = model(ids.cuda(), attention_mask=mask.cuda())[:, -25:-1].float() / 0.8
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(fused.completion_ids).cuda()[..., None])[..., 0]
    gap = (torch.stack(fused.logprobs).cuda() - ref).abs()
    print(f"fused decode ({scheme}, {kv} KV) vs Transformer.forward: |logp gap| mean {gap.mean().item():.3g} "
          f"max {gap.max().item():.3g}")
    if kv == "fp8":  # E4M3's rounding of every key and value (3 mantissa bits) on a chaotic random model
        assert gap.mean() < 0.15 and gap.max() < 3.0
    else:
        assert gap.mean() < 0.05 and gap.max() < 1.0  # bf16 rounding differences only
    assert plain.generate(None, ps, 4, temperature=0, eos_token_ids=[]).completion_ids  # reference path runs


@gpu
@pytest.mark.parametrize("scheme", ["bf16", "nvfp4"])
def test_gpu_dependent_launch_changes_the_timing_not_the_samples(scheme, monkeypatch):
    """Programmatic dependent launch (kernels/pdl.py) lets each decode kernel start before the previous one ends;
    each waits before it reads what the previous one wrote. A kernel that read too early would change the logits:
    the captured rollout must sample the same tokens with the same log-probs bit for bit with it and without."""
    from qerl.kernels import pdl

    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("no programmatic dependent launch here (needs sm_90+ and Triton >= 3.4)")
    model, _ = gpu_model(scheme, fuse=True)
    ps = prompts(12, vocab=1024, seed=6, max_len=40)
    runs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("QERL_PDL", setting)
        engine = RolloutEngine(model)
        runs[setting] = engine.generate(None, ps, 40, temperature=1.0, seed=3, eos_token_ids=[])
        assert engine.stats["captures"] >= 1
        engine.free()
    assert runs["1"].completion_ids == runs["0"].completion_ids
    torch.testing.assert_close(torch.cat(runs["1"].logprobs), torch.cat(runs["0"].logprobs), atol=0, rtol=0)


def test_dependent_launch_only_where_it_can_run(monkeypatch):
    """kernels/pdl.py gives a launch PDL only on CUDA: on the CPU (Triton's interpreter) its `PDL` flag is false,
    which compiles the wait out, and no launch option the interpreter would reject is passed. The plan's `pdl`
    off (QERL_PDL=0) turns it off on any GPU, before anything asks the driver."""
    from qerl.kernels import pdl
    from qerl.execution import fused_ops

    assert pdl.launch(torch.device("cpu")) == {"PDL": False}
    assert pdl.launch(torch.device("cuda", 0), False) == {"PDL": False} and not pdl.enabled(torch.device("cuda", 0),
                                                                                            False)
    monkeypatch.setenv("QERL_PDL", "0")
    assert fused_ops._pdl(torch.device("cuda", 0)) == {"PDL": False}
