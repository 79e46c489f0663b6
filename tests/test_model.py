"""The decoder computes the same logits as transformers, with and without padding, cache, checkpointing."""
import pytest
import torch

from qerl.execution.shared_prompts import forward_shared_prompts
from qerl.model.rope import rope_frequencies
from qerl.model.transformer import ModelConfig, Transformer

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, attn_implementation="eager")

PHI3_IDS = dict(pad_token_id=None, eos_token_id=2)  # Phi3Config's defaults (32000) lie outside the tiny vocabulary
# (family, extra HF config) per case: every variant a user can load.
CASES = {
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-untied-llama3-rope": ("llama", dict(tie_word_embeddings=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "llama-linear-rope-bias": ("llama", dict(attention_bias=True, mlp_bias=True,
                                             rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama-dynamic-rope": ("llama", dict(max_position_embeddings=16,
                                         rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "qwen2-yarn": ("qwen2", dict(tie_word_embeddings=False, rope_theta=1e6, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=False)),
    # Families past Llama/Qwen (qerl.model.families): windows shorter than the 24 tokens compared, so they slide.
    "mistral-sliding": ("mistral", dict(sliding_window=5)),
    "mistral-head-dim": ("mistral", dict(sliding_window=None, head_dim=32, tie_word_embeddings=True)),
    "phi3": ("phi3", dict(sliding_window=None, **PHI3_IDS)),
    "phi3-sliding": ("phi3", dict(sliding_window=7, tie_word_embeddings=True, **PHI3_IDS)),
    "gemma3": ("gemma3_text", dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=5, num_hidden_layers=3,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 1e6},
                                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e2}},
                                   final_logit_softcapping=10.0)),
}
# transformers' config and model classes of each family
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
              "phi3": ("Phi3Config", "Phi3ForCausalLM"), "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM")}


def hf_model(family: str, **overrides):
    """A tiny transformers model with every weight random (norms too, so a misplaced norm shows)."""
    import transformers

    config_class, model_class = HF_CLASSES[family]
    config = getattr(transformers, config_class)(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in pname else 0.1 * torch.randn_like(p))
    return model


def ours_from(hf) -> Transformer:
    model = Transformer.from_config(ModelConfig.from_hf(hf.config.to_dict())).eval()
    model.load_state_dict(hf.state_dict(), strict=True)  # HF names, exactly
    return model


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case):
    family, overrides = CASES[case]
    hf = hf_model(family, **overrides)
    ours = ours_from(hf)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf(ids).logits, ours(ids)
    assert (got - expected).abs().max() < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    if overrides.get("tie_word_embeddings"):
        assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_config_fields_from_hf():
    qwen2 = ModelConfig.from_hf(hf_model("qwen2").config.to_dict())
    assert qwen2.attention_bias and not qwen2.attention_out_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_hf(hf_model("qwen3", head_dim=32).config.to_dict())
    assert qwen3.head_dim == 32 and qwen3.qk_norm
    old_style = ModelConfig.from_hf({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                     "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256,
                                     "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert old_style.rope_theta == 5e5 and old_style.rope_scaling["rope_type"] == "linear"
    assert old_style.num_key_value_heads == 4 and old_style.head_dim == 16
    assert ModelConfig.from_hf(old_style.to_hf()) == old_style


def test_unsupported_or_incomplete_config_is_a_clear_error():
    with pytest.raises(ValueError, match="unsupported model_type 'falcon' .*; supported: llama, qwen2, qwen3, "
                                         "mistral, phi3, gemma3_text$"):
        ModelConfig.from_hf({"model_type": "falcon", "hidden_size": 64})
    with pytest.raises(ValueError, match="'intermediate_size'"):
        ModelConfig.from_hf({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4})
    with pytest.raises(ValueError, match="rope type 'longrope'"):
        ModelConfig.from_hf({**ModelConfig.from_hf(hf_model("llama").config).to_hf(),
                             "rope_scaling": {"rope_type": "longrope"}})


@pytest.fixture(scope="module")
def tiny_pair():
    hf = hf_model("qwen2", tie_word_embeddings=False)
    return hf, ours_from(hf)


def left_pad(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def test_left_padded_rows_get_their_unpadded_logits(tiny_pair):
    _, model = tiny_pair
    rows = [[5, 17, 99, 3, 42, 7, 8], [11, 12, 13], [200, 1, 2, 3, 4]]
    ids, mask = left_pad(rows)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask)
        for i, row in enumerate(rows):
            alone = model(torch.tensor([row]))[0]
            assert (batched[i, -len(row):] - alone).abs().max() < 1e-5
        assert torch.isfinite(batched).all()  # padding rows too: no NaN leaking into losses


def test_kv_cache_prefill_and_decode_match_full_forward(tiny_pair):
    _, model = tiny_pair
    rows = [[5, 17, 99, 3, 42, 7, 8, 9, 10, 11], [11, 12, 13, 14, 15, 16]]
    ids, mask = left_pad(rows)
    prompt_len = 6
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
        model.setup_kv_cache(batch_size=2, max_seq_len=16)
        model.reset_kv_cache()
        steps = [model(ids[:, :prompt_len], attention_mask=mask[:, :prompt_len],
                       cache_position=torch.arange(prompt_len))]
        for t in range(prompt_len, ids.shape[1]):  # mask grows with the written slots, as during generation
            steps.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache_position=torch.tensor([t])))
        cached = torch.cat(steps, dim=1)
    model.free_kv_cache()
    real = mask.bool()
    assert (cached[real] - full[real]).abs().max() < 1e-5


def test_decode_step_over_caller_caches_matches_full_forward(tiny_pair):
    """`decode_step` (what the rollout engine graphs) on caches the caller owns: same logits as one full forward."""
    _, model = tiny_pair
    rows = [[5, 17, 99, 3, 42, 7, 8, 9, 10, 11], [11, 12, 13, 14, 15, 16]]
    ids, mask = left_pad(rows)
    prompt_len, slots = 6, 12
    c = model.config
    caches = [(torch.zeros(4, c.num_key_value_heads, slots, c.head_dim),
               torch.zeros(4, c.num_key_value_heads, slots, c.head_dim)) for _ in model.model.layers]
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
        model.setup_kv_cache(batch_size=2, max_seq_len=slots)  # prefill through forward, then copy its cache
        model(ids[:, :prompt_len], attention_mask=mask[:, :prompt_len], cache_position=torch.arange(prompt_len))
        for (k, v), layer in zip(caches, model.model.layers):
            k[:2].copy_(layer.self_attn.kv_cache.k_cache)
            v[:2].copy_(layer.self_attn.kv_cache.v_cache)
        model.free_kv_cache()
        positions = mask.cumsum(-1) - 1
        for t in range(prompt_len, ids.shape[1]):
            slot, window = torch.tensor([t]), t + 2  # a window past the written slots: causality hides them
            attend = torch.nn.functional.pad(mask[:, :t + 1].bool(), (0, 1)) & (torch.arange(window) <= t)
            logits = model.decode_step(ids[:, t], positions[:, t:t + 1], slot, attend, caches)
            assert logits.shape == (2, c.vocab_size)
            assert (logits - full[:, t]).abs().max() < 1e-5
    assert all(layer.self_attn.kv_cache is None for layer in model.model.layers)


def test_kv_cache_needs_setup(tiny_pair):
    _, model = tiny_pair
    model.free_kv_cache()
    with pytest.raises(RuntimeError, match="setup_kv_cache"):
        model(torch.tensor([[1, 2]]), cache_position=torch.arange(2))


def test_logits_to_keep_selects_the_last_positions(tiny_pair):
    _, model = tiny_pair
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        full = model(ids)
        assert torch.allclose(model(ids, logits_to_keep=1), full[:, -1:], atol=1e-6)
        assert torch.allclose(model(ids, logits_to_keep=torch.tensor([0, 4])), full[:, [0, 4]], atol=1e-6)
        assert model(ids, logits_to_keep=0).shape == full.shape


def test_gradient_checkpointing_gives_the_same_gradients(tiny_pair):
    hf, _ = tiny_pair
    grads = []
    for enabled in (False, True):
        model = ours_from(hf).train()
        model.gradient_checkpointing = enabled
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
        model(ids).float().logsumexp(-1).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def grouped_rows(prompt_len=9, completion_len=7, groups=3, size=4, vocab=200, seed=0):
    """`groups` left-padded prompts of different lengths, each repeated for `size` rows with its own right-padded
    completion (a GRPO micro-batch), the rows shuffled."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(groups * size, prompt_len + completion_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i in range(groups):
        n = int(torch.randint(2, prompt_len + 1, (1,), generator=g))
        prompt = torch.randint(0, vocab, (n,), generator=g)
        for r in range(i * size, (i + 1) * size):
            c = int(torch.randint(1, completion_len + 1, (1,), generator=g))
            ids[r, prompt_len - n:prompt_len] = prompt
            ids[r, prompt_len:prompt_len + c] = torch.randint(0, vocab, (c,), generator=g)
            mask[r, prompt_len - n:prompt_len + c] = 1
    order = torch.randperm(len(ids), generator=g)
    return ids[order], mask[order], prompt_len


def model_with_live_lora(case: str):
    """Our model of CASES[case] in training mode, frozen, with non-zero fp32 LoRA r=4 on every linear: (model, params)."""
    from qerl.model.lora import LoraSettings, apply_lora

    family, overrides = CASES[case]
    model = ours_from(hf_model(family, **overrides)).train()
    model.requires_grad_(False)
    params = apply_lora(model, LoraSettings(rank=4, alpha=8), dtype=torch.float32)
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.05)
    return model, params


@pytest.mark.parametrize("case", CASES)
def test_shared_prompts_forward_equals_forward_with_its_gradients(case):
    """The CPU update runs each distinct prompt of a micro-batch once (`forward_shared_prompts`): every real token's
    hidden state and the LoRA gradients are `forward`'s, in fp32, whatever the family (sliding windows shorter than
    the prompt, Gemma's sandwich norms, Qwen3's q/k norms, Phi-3's stacked projections). So with `pack` (only the
    real tokens through the GEMMs: prompts and completions of different lengths), shared or not."""
    model, params = model_with_live_lora(case)
    ids, mask, prompt_len = grouped_rows()
    weights = torch.randn(*ids.shape, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    weights *= mask[..., None]  # padded positions compute something finite that nothing reads

    def hidden_and_grads(forward):
        for p in params:
            p.grad = None
        hidden = forward()
        (hidden * weights).sum().backward()
        return hidden.detach() * mask[..., None], torch.cat([p.grad.flatten() for p in params])

    plain, plain_grad = hidden_and_grads(lambda: model.model(ids, attention_mask=mask))
    tokens = []  # what the blocks' GEMMs see: the embedded tokens
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: tokens.append(out.shape[:-1].numel()))
    for share, pack in [(True, False), (True, True), (False, True)]:
        hidden, grad = hidden_and_grads(
            lambda: forward_shared_prompts(model.model, ids, mask, prompt_len, share=share, pack=pack))
        assert (plain - hidden).abs().max() < 2e-5 * plain.abs().max(), (share, pack)
        assert (plain_grad - grad).abs().max() < 2e-5 * plain_grad.abs().max(), (share, pack)
        distinct = 3 if share else 12  # prompts: 3 groups of 4 rows
        real_prompt_tokens = int(mask[:, :prompt_len].sum()) // (4 if share else 1)
        assert tokens.pop() == (real_prompt_tokens + int(mask[:, prompt_len:].sum()) if pack
                                else distinct * prompt_len + ids[:, prompt_len:].numel()), (share, pack)


@pytest.mark.parametrize("case", ["llama-untied-llama3-rope", "gemma3"])  # the chunked head; the softcapped one
def test_update_log_probs_with_shared_prompts_and_packing_equal_the_plain_ones(case):
    """The update's log-probs, entropies and LoRA gradients with each prompt computed once (`model.share_prompts`)
    and/or only the real tokens through the GEMMs and the head (`model.pack_completions`) equal the plain padded
    forward's on every completion token, to fp32 rounding; packed, padding's are 0."""
    from qerl.rl.grpo import completion_log_probs

    model, params = model_with_live_lora(case)
    ids, mask, prompt_len = grouped_rows()
    real = mask[:, prompt_len:].bool()
    upstream = torch.randn(real.shape, generator=torch.Generator().manual_seed(2))

    def logps_and_grads(share: bool, pack: bool):
        for p in params:
            p.grad = None
        logp, entropy = completion_log_probs(model, ids, mask, prompt_len, 0.7, share, True, pack=pack)
        (logp * upstream * real).sum().backward()
        return logp.detach(), entropy, torch.cat([p.grad.flatten() for p in params])

    plain_logp, plain_entropy, plain_grad = logps_and_grads(False, False)
    for share, pack in [(True, False), (True, True), (False, True)]:
        logp, entropy, grad = logps_and_grads(share, pack)
        torch.testing.assert_close(logp[real], plain_logp[real], rtol=0, atol=1e-5)
        torch.testing.assert_close(entropy[real], plain_entropy[real], rtol=0, atol=1e-5)
        assert (grad - plain_grad).abs().max() < 2e-5 * plain_grad.abs().max(), (share, pack)
        if pack:
            assert logp[~real].abs().max() == 0 and entropy[~real].abs().max() == 0


def test_shared_prompts_forward_of_distinct_prompts_is_forward(tiny_pair):
    _, model = tiny_pair
    ids, mask, prompt_len = grouped_rows(groups=3, size=1)
    with torch.no_grad():
        assert torch.equal(forward_shared_prompts(model.model, ids, mask, prompt_len),
                           model.model(ids, attention_mask=mask))


def test_norm_weights_are_read_every_forward(tiny_pair):
    """AQN adds noise to RMSNorm weights in place; the next forward must see it."""
    hf, _ = tiny_pair
    model = ours_from(hf)
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        before = model(ids)
        model.model.layers[0].input_layernorm.weight.add_(0.5)
        after = model(ids)
    assert (after - before).abs().max() > 1e-3


def test_meta_build_and_dtype_casts_keep_fp32_rope(tiny_pair):
    hf, _ = tiny_pair
    config = ModelConfig.from_hf(hf.config)
    model = Transformer.from_config(config, dtype=torch.bfloat16, device="meta")
    assert model.model.embed_tokens.weight.is_meta and model.model.embed_tokens.weight.dtype == torch.bfloat16
    model.to_empty(device="cpu")
    assert torch.equal(model.model.rotary_emb.inv_freq, rope_frequencies(config)[0])
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    model.to(torch.float16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_num_parameters_counts_tied_weights_once():
    hf = hf_model("llama", tie_word_embeddings=True)
    model = ours_from(hf)
    assert model.num_parameters() == sum(p.numel() for p in hf.parameters()) == hf.num_parameters()


def test_training_log_probs_are_softcapped_as_sampling_is():
    """The trainer's log-probs come from the logits the sampler draws from: with Gemma's final_logit_softcapping
    they are cap * tanh(z / cap), not the head's raw z (the chunked head path skipped it once)."""
    from qerl.rl.logprobs import PolicyLogProbs

    family, overrides = CASES["gemma3"]
    model = ours_from(hf_model(family, **overrides))
    assert model.config.final_logit_softcapping == 10.0
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    P, temperature = 5, 0.7
    with torch.no_grad():
        logp, entropy = PolicyLogProbs(model, temperature)(ids, torch.ones_like(ids), P, want_entropy=True)
        expected = torch.log_softmax(model(ids)[:, P - 1:-1].float() / temperature, -1)
    want = expected.gather(-1, ids[:, P:, None])[..., 0]
    torch.testing.assert_close(logp, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, -(expected.exp() * expected).sum(-1), atol=1e-5, rtol=0)
