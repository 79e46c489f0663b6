"""LoRA: exact PEFT interop both ways, disabled-adapter reference, gradients on a quantized base, merged export."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from qerl.execution.low_rank import fused_forward
from qerl.model.export import merge_and_export
from qerl.model.lora import (LoraLinear, LoraSettings, adapters_disabled, apply_lora, load_adapter, lora_layers,
                       lora_state_dict, save_adapter)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=128, attn_implementation="eager")
NORMS = ["input_layernorm", "post_attention_layernorm", "norm"]  # leaf names of every Llama RMSNorm


def hf_llama(**overrides):
    """Tiny transformers Llama, fp32, every weight random (norms too, so a mishandled norm shows)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A Hugging Face folder (config, fp32 safetensors, tokenizer) of the tiny Llama."""
    path = tmp_path_factory.mktemp("base")
    hf_llama().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def load_ours(path):
    from qerl.model.loading import load_model

    model, tokenizer = load_model(path)
    return model.float().eval(), tokenizer


def fresh_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def randomize_adapters(model, seed=2):
    """Nonzero lora_B (zero would hide a wrong B layout or scaling) and perturbed trainable norms."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.copy_(0.1 * torch.randn(layer.lora_B.shape, generator=g))
        for name, p in model.named_parameters():
            if p.requires_grad and "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))


# ---------------------------------------------------------------------------------------------------- LoraLinear


def test_lora_linear_matches_formula_and_starts_at_base():
    torch.manual_seed(0)
    base = nn.Linear(8, 6)
    layer = LoraLinear(base, rank=4, alpha=8)
    x = torch.randn(3, 8)
    assert (layer.in_features, layer.out_features) == (8, 6)
    assert layer.lora_A.shape == (4, 8) and layer.lora_B.shape == (6, 4)
    assert layer.lora_A.abs().max() > 0 and torch.equal(layer(x), base(x))  # B = 0: exact base at init
    nn.init.normal_(layer.lora_B)
    expected = base(x) + (x @ layer.lora_A.T @ layer.lora_B.T) * 2.0
    torch.testing.assert_close(layer(x), expected)
    torch.testing.assert_close(layer.merged_weight(), base.weight + 2.0 * layer.lora_B @ layer.lora_A)
    layer.enabled = False
    assert torch.equal(layer(x), base(x))


def test_fused_forward_is_forward_with_one_addmm():
    """The decode step's LoRA path: base(x) + s * (x A^T) B^T accumulated by addmm; forward where it cannot apply."""
    torch.manual_seed(0)
    layer = LoraLinear(nn.Linear(8, 6), rank=4, alpha=8)
    nn.init.normal_(layer.lora_B)
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(fused_forward(layer, x), layer(x))
        assert torch.equal(fused_forward(layer, x[None]), layer(x[None]))  # not 2-D: forward itself
        layer.enabled = False
        assert torch.equal(fused_forward(layer, x), layer.base(x))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_fused_forward_on_a_quantized_base_adds_the_update_inside_its_gemm(device):
    """On an NVFP4 base the decode step hands LoRA's update to the base GEMM (`QuantLinear.plus_low_rank`: the
    Gluon GEMM's epilogue on Hopper, one addmm elsewhere): forward's result within bf16 rounding, bias included."""
    from qerl.quant.linear import QuantLinear

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    base = QuantLinear.from_linear(nn.Linear(256, 192).to(device, dtype), "nvfp4")
    layer = LoraLinear(base, rank=16, alpha=32).to(device, dtype)
    nn.init.normal_(layer.lora_B)
    for m in (1, 8, 64):
        x = torch.randn(m, 256, device=device, dtype=dtype)
        with torch.no_grad():
            want, got = layer(x).double(), fused_forward(layer, x).double()
        assert (got - want).abs().max() <= 2e-2 * want.abs().max(), m
        with torch.no_grad():
            assert not torch.allclose(got, base(x).double())  # the update is in


def test_rslora_scaling():
    assert LoraSettings(rank=16, alpha=32).scaling == 2.0
    assert LoraSettings(rank=16, alpha=32, use_rslora=True).scaling == 8.0
    assert LoraLinear(nn.Linear(4, 4), rank=16, alpha=32, use_rslora=True).scaling == 8.0


def test_dropout_only_in_train_mode():
    torch.manual_seed(0)
    layer = LoraLinear(nn.Linear(64, 64), rank=4, alpha=4, dropout=0.5)
    nn.init.normal_(layer.lora_B)
    x = torch.randn(4, 64)
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    layer.train()
    assert not torch.equal(layer(x), layer(x))


def test_adapter_math_runs_in_adapter_dtype():
    base = nn.Linear(8, 8).to(torch.bfloat16)
    layer = LoraLinear(base, rank=2, alpha=2, dtype=torch.float32)
    out = layer(torch.randn(2, 8, dtype=torch.bfloat16))
    assert layer.lora_A.dtype == torch.float32 and out.dtype == torch.bfloat16


def test_bad_settings_and_targets_are_named():
    with pytest.raises(ValueError, match="rank"):
        LoraSettings(rank=0)
    with pytest.raises(ValueError, match="dropout"):
        LoraSettings(dropout=1.0)
    model = nn.Sequential()
    model.add_module("mlp", nn.Sequential())
    model.mlp.add_module("up", nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"match no module.*\['up'\]"):
        apply_lora(model, LoraSettings(target_modules=("q_proj",)))
    with pytest.raises(ValueError, match=r"non-linear modules: mlp \(Sequential\)"):
        apply_lora(model, LoraSettings(target_modules=("mlp",)))
    # A rank past every target's full rank changes nothing a smaller one cannot: 10^9 on the embedded model asked
    # torch for 2 TB (a RuntimeError, exit 1). Refused before any adapter tensor is made (10^12 here: an allocation
    # that fails at once before the fix, where 10^9 would fill this machine's memory)
    with pytest.raises(ValueError) as err:
        apply_lora(model, LoraSettings(rank=10**12, target_modules=("up",)))
    assert str(err.value) == ("lora.rank = 1000000000000: past the full rank of every target layer (at most 4: mlp.up "
                              "is 4 x 4), where a LoRA already changes a weight freely; lower it")
    assert not lora_layers(model)
    apply_lora(model, LoraSettings(rank=4, target_modules=("up",)))  # full rank: allowed
    with pytest.raises(ValueError, match="already applied"):
        apply_lora(model, LoraSettings(target_modules=("up",)))


# ---------------------------------------------------------------------------------------------------- model level


def test_apply_lora_targets_and_freezes(base_dir):
    model, _ = load_ours(base_dir)
    params = apply_lora(model, LoraSettings(rank=4, train_norms=True))
    layers = lora_layers(model)
    assert len(layers) == 2 * 7 and "lm_head" not in layers
    assert isinstance(model.model.layers[1].mlp.down_proj, LoraLinear)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in trainable if "lora_" in n or "norm" in n}
    assert len(trainable) == 2 * 14 + 2 * 2 + 1 == len(params)  # A and B per layer, 2 norms per block, final norm


@pytest.mark.parametrize("use_rslora,train_norms", [(False, False), (True, True)])
def test_our_adapter_loads_in_peft_with_equal_logits(base_dir, tmp_path, use_rslora, train_norms):
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict

    model, _ = load_ours(base_dir)
    settings = LoraSettings(rank=4, alpha=8, use_rslora=use_rslora, train_norms=train_norms)
    apply_lora(model, settings)
    randomize_adapters(model)
    save_adapter(model, tmp_path / "adapter", str(base_dir), settings)

    peft_model = PeftModel.from_pretrained(fresh_hf(base_dir), tmp_path / "adapter").eval()
    with torch.no_grad():
        expected, got = peft_model(IDS).logits, model(IDS)
    assert (got - expected).abs().max() < 1e-5
    # Byte-for-byte PEFT's own naming, modules_to_save included.
    assert set(get_peft_model_state_dict(peft_model)) == set(load_file(tmp_path / "adapter/adapter_model.safetensors"))
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert config["modules_to_save"] == (sorted(NORMS) if train_norms else None)


@pytest.mark.parametrize("with_norms", [False, True])
def test_peft_adapter_loads_into_ours_with_equal_logits(base_dir, tmp_path, with_norms):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(fresh_hf(base_dir), LoraConfig(
        r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=with_norms,
        modules_to_save=NORMS if with_norms else None, task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if p.requires_grad:  # lora_A/B and the modules_to_save copies
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    peft_model.eval().save_pretrained(tmp_path / "peft")

    model, _ = load_ours(base_dir)
    settings = load_adapter(model, tmp_path / "peft")
    assert settings.rank == 4 and settings.use_rslora == with_norms and settings.train_norms == with_norms
    assert len(lora_layers(model)) == 2 * 3
    with torch.no_grad():
        assert (model(IDS) - peft_model(IDS).logits).abs().max() < 1e-5


def test_load_adapter_names_bad_tensors(base_dir, tmp_path):
    model, _ = load_ours(base_dir)
    settings = LoraSettings(rank=4, target_modules=("q_proj",))
    apply_lora(model, settings)
    save_adapter(model, tmp_path / "a", "base", settings)
    weights = tmp_path / "a/adapter_model.safetensors"
    state = load_file(weights)
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    state["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"] = torch.zeros(4, 64)
    state[key] = torch.zeros(64, 5)
    save_file(state, weights)
    with pytest.raises(ValueError, match=r"unexpected \(1\): .*k_proj.lora_A.weight.*shape mismatch.*q_proj.lora_B"):
        load_adapter(load_ours(base_dir)[0], tmp_path / "a")
    del state[key]
    save_file(state, weights)
    with pytest.raises(ValueError, match=r"missing \(1\): " + key.replace(".", r"\.")):
        load_adapter(load_ours(base_dir)[0], tmp_path / "a")
    save_adapter(model, tmp_path / "b", "base", settings)
    other, _ = load_ours(base_dir)
    apply_lora(other, LoraSettings(rank=8, target_modules=("q_proj",)))
    with pytest.raises(ValueError, match="rank 8"):  # already adapted with another rank
        load_adapter(other, tmp_path / "b")
    config = tmp_path / "b" / "adapter_config.json"  # an edited config's rank is the file's fault: named
    config.write_text(json.dumps({**json.loads(config.read_text()), "r": 10**12}))
    with pytest.raises(ValueError) as err:
        load_adapter(load_ours(base_dir)[0], tmp_path / "b")
    assert str(err.value).startswith(f"{config}: lora.rank = 1000000000000: past the full rank of every target")


BAD_ADAPTER_CONFIGS = {  # how adapter_config.json is spoilt -> what its line says after the file's name
    "a list": (lambda c: [], "expected a JSON object (a PEFT adapter config), got list"),
    "no rank": (lambda c: {k: v for k, v in c.items() if k != "r"}, "no 'r' (the LoRA rank)"),
    "a rank that is a string": (lambda c: {**c, "r": "x"}, "r = 'x': expected a positive integer"),
    "a rank of zero": (lambda c: {**c, "r": 0}, "r = 0: expected a positive integer"),
    "an alpha that is a string": (lambda c: {**c, "lora_alpha": "x"}, "lora_alpha = 'x': expected a number"),
    "targets a number": (lambda c: {**c, "target_modules": 5}, "target_modules = 5: expected a list of module names"),
}


@pytest.mark.parametrize("how", BAD_ADAPTER_CONFIGS)
def test_an_adapter_config_that_is_no_lora_config_is_one_line_naming_it(base_dir, tmp_path, how):
    """Before: an AttributeError, a KeyError and a TypeError (exit 1, no file named; in a checkpoint, no fallback to
    the one before) or Python's own words without the file (`invalid literal for int()`)."""
    model, _ = load_ours(base_dir)
    settings = LoraSettings(rank=4, target_modules=("q_proj",))
    apply_lora(model, settings)
    save_adapter(model, tmp_path / "a", "base", settings)
    config = tmp_path / "a" / "adapter_config.json"
    spoil, said = BAD_ADAPTER_CONFIGS[how]
    config.write_text(json.dumps(spoil(json.loads(config.read_text()))))
    with pytest.raises(ValueError) as err:
        load_adapter(load_ours(base_dir)[0], tmp_path / "a")
    assert str(err.value) == f"{config}: {said}"


def test_save_adapter_replaces_atomically(base_dir, tmp_path):
    model, _ = load_ours(base_dir)
    settings = LoraSettings(rank=4)
    apply_lora(model, settings)
    save_adapter(model, tmp_path / "a", "base", settings)
    randomize_adapters(model)
    save_adapter(model, tmp_path / "a", "base", settings)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temp or old dirs left behind
    saved = load_file(tmp_path / "a/adapter_model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in lora_state_dict(model).items())
    with pytest.raises(ValueError, match="rank 8"):
        save_adapter(model, tmp_path / "b", "base", LoraSettings(rank=8))


def test_adapters_disabled_gives_base_logits(base_dir):
    model, _ = load_ours(base_dir)
    with torch.no_grad():
        base_logits = model(IDS)
    apply_lora(model, LoraSettings(rank=4, train_norms=True))
    randomize_adapters(model)
    adapted = model(IDS)  # with grad: a GRPO step runs the reference forward between policy forward and backward
    with torch.no_grad(), adapters_disabled(model):
        disabled = model(IDS)
    adapted.square().mean().backward()
    with torch.no_grad():
        again = model(IDS)
    assert (adapted - base_logits).abs().max() > 1e-2
    assert torch.equal(disabled, base_logits) and torch.equal(again, adapted)
    assert model.model.norm.weight.grad is not None


@pytest.mark.parametrize("tied", [False, True])
def test_merged_bf16_export_loads_in_transformers_and_ours(base_dir, tmp_path, tied):
    if tied:  # lm_head shares the embedding: exported once, as transformers expects
        base_dir = tmp_path / "tied"
        hf_llama(tie_word_embeddings=True).save_pretrained(base_dir)
        tiny_tokenizer().save_pretrained(base_dir)
    model, tokenizer = load_ours(base_dir)
    apply_lora(model, LoraSettings(rank=4, train_norms=True))
    randomize_adapters(model)
    with torch.no_grad():
        adapted = model(IDS)
    out = merge_and_export(model, tokenizer, tmp_path / "merged")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    exported = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in exported.values()) and ("lm_head.weight" in exported) != tied
    with torch.no_grad():
        from_hf = fresh_hf(out)(IDS).logits
        from_ours = load_ours(out)[0](IDS)
    scale = adapted.abs().max()
    assert (from_hf - adapted).abs().max() < 0.05 * scale  # bf16 weights
    assert (from_ours - from_hf).abs().max() < 1e-4


def test_gradients_reach_only_lora_and_norms_on_quantized_base(base_dir):
    from qerl.quant.linear import QuantLinear, quantize_model

    model, _ = load_ours(base_dir)
    quantize_model(model, "nvfp4")
    params = apply_lora(model, LoraSettings(rank=4, train_norms=True), dtype=torch.float32)
    assert isinstance(model.model.layers[0].self_attn.q_proj.base, QuantLinear)
    randomize_adapters(model)  # B != 0, else A gets no gradient
    model(IDS).square().mean().backward()
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None and p.grad.abs().max() > 0}
    assert with_grad == {name for name, p in model.named_parameters() if any(p is q for q in params)}
    assert all("lora_" in n or "norm" in n for n in with_grad) and len(with_grad) == len(params)


def test_merged_export_of_quantized_base_matches_adapted_model(base_dir, tmp_path):
    from qerl.quant.linear import quantize_model

    model, tokenizer = load_ours(base_dir)
    quantize_model(model, "nvfp4")
    apply_lora(model, LoraSettings(rank=4), dtype=torch.float32)
    randomize_adapters(model)
    with torch.no_grad():
        adapted = model(IDS)
        merged = fresh_hf(merge_and_export(model, tokenizer, tmp_path / "merged"))(IDS).logits
    # The export carries the dequantized NVFP4 weights, so only bf16 rounding separates the two.
    assert (merged - adapted).abs().max() < 0.05 * adapted.abs().max()


def test_nvfp4_export_loads_as_quantized_model(base_dir, tmp_path):
    from qerl.model.loading import load_model
    from qerl.quant.linear import QuantLinear, quantize_model

    model, tokenizer = load_ours(base_dir)
    apply_lora(model, LoraSettings(rank=4))
    randomize_adapters(model)
    merge_and_export(model, tokenizer, tmp_path / "bf16")
    out = merge_and_export(model, tokenizer, tmp_path / "nvfp4", scheme="nvfp4")
    assert json.loads((out / "config.json").read_text())["quantization_config"]
    exported, _ = load_model(out)  # bf16, as saved: both sides quantize the same bf16 weights
    assert isinstance(exported.model.layers[0].mlp.down_proj, QuantLinear)
    assert exported.model.layers[0].mlp.down_proj.scheme == "nvfp4"
    reference, _ = load_model(tmp_path / "bf16")  # the merged weights, quantized in memory
    quantize_model(reference, "nvfp4")
    with torch.no_grad():
        assert torch.equal(exported(IDS), reference(IDS))


def test_export_rejects_unknown_scheme(base_dir, tmp_path):
    model, tokenizer = load_ours(base_dir)
    apply_lora(model, LoraSettings(rank=4))
    with pytest.raises(ValueError, match="unknown quantization scheme 'fp3'"):
        merge_and_export(model, tokenizer, tmp_path / "out", scheme="fp3")
    assert not any(tmp_path.iterdir())


def test_sharded_export_loads_like_single_file(base_dir, tmp_path):
    model, tokenizer = load_ours(base_dir)
    apply_lora(model, LoraSettings(rank=4))
    randomize_adapters(model)
    single = merge_and_export(model, tokenizer, tmp_path / "single")
    sharded = merge_and_export(model, tokenizer, tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(p.name for p in sharded.glob("*.safetensors")) == shards
    with torch.no_grad():
        assert torch.equal(fresh_hf(sharded)(IDS).logits, fresh_hf(single)(IDS).logits)


def test_peft_adapter_training_other_modules_is_rejected(base_dir, tmp_path):
    model, _ = load_ours(base_dir)
    settings = LoraSettings(rank=4)
    apply_lora(model, settings)
    save_adapter(model, tmp_path / "a", "base", settings)
    config = json.loads((tmp_path / "a/adapter_config.json").read_text())
    (tmp_path / "a/adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    with pytest.raises(ValueError, match=r"non-RMSNorm modules \(lm_head\)"):
        load_adapter(load_ours(base_dir)[0], tmp_path / "a")
    (tmp_path / "a/adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True"):
        load_adapter(load_ours(base_dir)[0], tmp_path / "a")


def test_the_params_file_lora_section_is_the_lora_settings():
    from qerl import config

    assert LoraSettings is config.LoraSettings  # one type: the trainer passes `settings.lora` whole
    s = config.settings_from_dict({"lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj"]}})
    assert s.lora.scaling == 2.0 and s.lora.target_modules == ["q_proj"]
    assert LoraSettings(target_modules="q_proj").target_modules == ["q_proj"]
