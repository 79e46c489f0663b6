"""Remedies for a 4-bit base that learns worse than bf16 (issue #63): per-layer schemes (quant.layer_schemes), a
frozen error correction (quant.error_correction_rank), which norms AQN perturbs (aqn.include_final_norm,
aqn.include_qk_norm); each from the params to the trained, resumed, evaluated and exported policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from qerl.config import ConfigError, load_settings
from qerl.model import lora
from qerl.model.aqn import NoiseInjector
from qerl.quant.formats import get_codec
from qerl.quant.linear import QuantLinear, quantize_model, schemes_by_layer
from qerl.rl.trainer import Trainer
from tests.test_trainer import tiny_settings

DEFAULT = "params/default.yaml"


def length_reward(completion: str, gold: str) -> float:
    """Rewards that differ within a group of the tiny random model's completions: a learning signal."""
    return len(completion) / 100


def tiny_trainer(tmp_path: Path, tiny_llama_dir: Path, resume: bool = False, **sections) -> Trainer:
    """The RL loop on the tests' tiny Llama folder, loaded and quantized from the params as `qerl train` does."""
    sections = {"model": {"path": str(tiny_llama_dir)}, "rollout": {"prompts_per_step": 2, "group_size": 2,
                                                                     "max_new_tokens": 4}, **sections}
    sections["train"] = {"steps": 1, "save_every": 1, "rewards": {"tests.test_quant_remedies:length_reward": 1.0},
                         **sections.get("train", {})}
    return Trainer(tiny_settings(tmp_path, **sections), tmp_path / "run", resume=resume, progress=False)


def quant_layers(model: nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


# ----------------------------------------------------------------------------- per-layer schemes


def test_first_matching_glob_sets_a_layers_scheme_and_the_rest_take_the_default():
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert schemes_by_layer(names, "nvfp4", {"model.layers.0.*": "bf16", "*.down_proj": "fp8"}) == {
        names[0]: "bf16", names[1]: "bf16", names[2]: "fp8"}
    assert schemes_by_layer(names, "nvfp4", {"*.down_proj": "FP8", "model.layers.0.*": "bf16"}) == {
        names[0]: "bf16", names[1]: "fp8", names[2]: "fp8"}


def test_a_glob_matching_no_layer_or_an_unknown_scheme_is_a_one_line_error():
    names = ["model.layers.0.mlp.down_proj"]
    with pytest.raises(ValueError, match=r"^layer_schemes: '\*\.down' matches no quantizable linear layer \(they are "
                                         r"named like 'model.layers.0.mlp.down_proj'\)$"):
        schemes_by_layer(names, "nvfp4", {"*.down": "fp8"})
    with pytest.raises(ValueError, match=r"^layer_schemes\['\*\.down_proj'\]: unknown quantization scheme 'fp4'"):
        schemes_by_layer(names, "nvfp4", {"*.down_proj": "fp4"})


@pytest.mark.parametrize(("overrides", "message"), [
    (['quant.layer_schemes={"*.down_proj": fp4}'],
     r"quant.layer_schemes\['\*.down_proj'\] = 'fp4': expected one of 'nvfp4', .*"
     r"\(bf16 keeps the layers unquantized\)"),
    (['quant.layer_schemes={"*.down_proj": fp8}', "quant.quantized_path=runs/quantized/x"],
     r"quant.layer_schemes is made at load from the dense weights; a `qerl quantize` folder \('runs/quantized/x'\) "
     r"holds one scheme and no error correction: leave quantized_path unset"),
    (["quant.error_correction_rank=8", "quant.scheme=nf4-bnb"],
     r"quant.error_correction_rank applies to a base qerl quantizes itself, not scheme = 'nf4-bnb'"),
    (["quant.error_correction_rank=8", "quant.scheme=bf16"],
     r"quant.error_correction_rank applies to a base qerl quantizes itself, not scheme = 'bf16'"),
])
def test_params_refuse_what_no_base_can_be(overrides, message):
    with pytest.raises(ConfigError, match=message) as caught:
        load_settings(DEFAULT, overrides)
    assert str(caught.value).startswith("-S ") and "\n" not in str(caught.value)


def test_layer_schemes_reach_the_loaded_base(tmp_path, tiny_llama_dir):
    from qerl.model.runtime import load_base_model

    settings = load_settings(DEFAULT, [f"model.path={tiny_llama_dir}", "model.device=cpu",
                                       'quant.layer_schemes={"model.layers.0.mlp.*": bf16, "*.down_proj": fp8}'])
    model, _ = load_base_model(settings.model, settings.quant)
    layers = model.model.layers
    assert type(layers[0].mlp.down_proj) is nn.Linear and type(layers[0].mlp.up_proj) is nn.Linear  # kept dense
    assert not layers[0].mlp.down_proj.weight.requires_grad
    assert layers[1].mlp.down_proj.scheme == "fp8"
    assert {m.scheme for name, m in quant_layers(model).items() if not name.endswith("down_proj")} == {"nvfp4"}
    # a fused group's member in another scheme: the NVFP4 members still share their global scale, among themselves
    mixed = load_settings(DEFAULT, [f"model.path={tiny_llama_dir}", "model.device=cpu",
                                    'quant.layer_schemes={"*.v_proj": fp8}'])
    attention = load_base_model(mixed.model, mixed.quant)[0].model.layers[0].self_attn
    assert attention.v_proj.scheme == "fp8" and attention.q_proj.scheme == attention.k_proj.scheme == "nvfp4"
    assert torch.equal(attention.q_proj.weight_global_scale, attention.k_proj.weight_global_scale)
    with pytest.raises(ValueError, match=r"'model.layers.7.\*' matches no quantizable linear layer"):
        load_base_model(*(lambda s: (s.model, s.quant))(load_settings(DEFAULT, [
            f"model.path={tiny_llama_dir}", "model.device=cpu", 'quant.layer_schemes={"model.layers.7.*": fp8}'])))


# ----------------------------------------------------------------------------- error correction


@pytest.fixture(scope="module")
def real_linear(smollm2_dir) -> nn.Linear:
    """One real projection of the embedded model (read alone from its safetensors)."""
    from safetensors import safe_open

    with safe_open(str(Path(smollm2_dir) / "model.safetensors"), "pt") as f:
        weight = f.get_tensor("model.layers.15.mlp.down_proj.weight").float()
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data.copy_(weight)
    return linear


def relative_error(w: torch.Tensor, wq: torch.Tensor) -> float:
    return float((wq.double() - w.double()).norm() / w.double().norm())


@pytest.mark.parametrize("scheme", ["nvfp4", "nf4"])
def test_the_correction_shrinks_the_weight_error_as_its_rank_grows(real_linear, scheme):
    w = real_linear.weight.detach()
    layer = QuantLinear.from_linear(real_linear, scheme)
    errors = []
    for rank in (0, 4, 16, 64):
        layer.set_error_correction(w, rank)
        assert layer.correction_rank == rank
        errors.append(relative_error(w, layer.dequantized_weight(torch.float32)))
    assert errors == sorted(errors, reverse=True) and len(set(errors)) == 4
    assert errors[0] == pytest.approx(relative_error(w, get_codec(scheme).dequantize(layer.quantized_tensors(),
                                                                                      torch.float32)))
    assert errors[-1] < 0.9 * errors[0]  # rank 64 of 576 takes a tenth of the error (bf16 rounding included)


def test_the_correction_is_frozen_bf16_beside_the_codes_and_the_forward_adds_it(real_linear):
    layer = QuantLinear.from_linear(real_linear, "nvfp4")
    plain = layer.dequantized_weight(torch.float32)
    layer.set_error_correction(real_linear.weight, 8)
    assert list(layer.parameters()) == []  # buffers only: nothing to train, nothing for an optimizer
    assert layer.correction_a.dtype == layer.correction_b.dtype == torch.bfloat16
    assert layer.correction_a.shape == (576, 8) and layer.correction_b.shape == (8, 1536)
    x = torch.randn(3, 1536, requires_grad=True)
    correction = layer.correction_a.float() @ layer.correction_b.float()
    y = layer(x)
    torch.testing.assert_close(y, F.linear(x, plain + correction), rtol=1e-5, atol=1e-5)
    y.sum().backward()  # grads to the input through the corrected weight
    torch.testing.assert_close(x.grad, (plain + correction).sum(0).expand(3, -1), rtol=1e-5, atol=1e-5)
    layer.double()  # a dtype move keeps the stored format and the bf16 correction
    assert layer.correction_a.dtype == torch.bfloat16 and layer.weight_packed.dtype == torch.uint8


def test_a_projection_with_a_correction_is_not_fused():
    torch.manual_seed(0)
    q, k = (QuantLinear.from_linear(nn.Linear(64, 32, bias=False), "fp8") for _ in range(2))
    assert QuantLinear.concat([q, k]) is not None
    q, k = (QuantLinear.from_linear(nn.Linear(64, 32, bias=False), "fp8") for _ in range(2))
    q.set_error_correction(torch.randn(32, 64), 2)
    assert QuantLinear.concat([q, k]) is None and q.rows_of is None


def test_a_training_step_runs_with_the_correction_frozen_and_out_of_the_optimizer(tmp_path, tiny_llama_dir):
    trainer = tiny_trainer(tmp_path, tiny_llama_dir, quant={"error_correction_rank": 4})
    layers = quant_layers(trainer.model)
    assert layers and all(m.correction_rank == 4 for m in layers.values())
    corrections = {n: (m.correction_a.clone(), m.correction_b.clone()) for n, m in layers.items()}
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not any(id(m.correction_a) in in_optimizer or id(m.correction_b) in in_optimizer for m in layers.values())
    assert not any(m.correction_a.requires_grad for m in layers.values())
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    adapter = trainer.train()
    assert all(torch.equal(m.correction_a, corrections[n][0]) and torch.equal(m.correction_b, corrections[n][1])
               for n, m in layers.items())
    assert any(not torch.equal(p, lora_before[n]) for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert not any("correction" in key for key in load_file(str(adapter / lora.ADAPTER_WEIGHTS)))  # not the adapter's
    assert json.loads((adapter / lora.BASE_RECORD).read_text()) == {
        "scheme": "nvfp4", "layer_schemes": [], "error_correction_rank": 4}
    trainer.close()

    # A resume recomputes the same correction from the dense weights, and refuses another rank.
    again = tiny_trainer(tmp_path, tiny_llama_dir, resume=True, quant={"error_correction_rank": 4},
                         train={"steps": 2})
    again_layers = quant_layers(again.model)
    assert all(torch.equal(again_layers[n].correction_a, a) for n, (a, _) in corrections.items())
    again.close()
    with pytest.raises(ValueError, match=r"trained with other quant.error_correction_rank \(.*4 -> 8"):
        tiny_trainer(tmp_path, tiny_llama_dir, resume=True, quant={"error_correction_rank": 8}, train={"steps": 2})


# ----------------------------------------------------------------------------- which norms AQN perturbs


def tiny_transformer(model_type: str) -> nn.Module:
    from qerl.model.transformer import ModelConfig, Transformer

    torch.manual_seed(0)
    config = ModelConfig.from_hf({"model_type": model_type, "hidden_size": 32, "intermediate_size": 64,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "head_dim": 8, "vocab_size": 64, "max_position_embeddings": 64})
    return Transformer.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("include_final_norm", [True, False])
def test_the_final_norm_gets_noise_unless_left_out(tmp_path, tiny_llama_dir, include_final_norm):
    trainer = tiny_trainer(tmp_path, tiny_llama_dir, aqn={"include_final_norm": include_final_norm})
    final = trainer.model.model.norm.weight
    clean = final.detach().clone()
    names = [name for name, _ in trainer.noise.targets]
    assert "model.layers.1.post_attention_layernorm.weight" in names
    assert ("model.norm.weight" in names) == include_final_norm
    assert trainer.policy_update.noise is trainer.noise  # the training forward's noise (in_training_forward) too
    with trainer.rollout_backend.sync(sigma=0.1, noise_seed=3):  # what a rollout samples from
        assert torch.equal(final, clean) != include_final_norm
        assert not torch.equal(trainer.model.model.layers[0].input_layernorm.weight, clean)
    assert torch.equal(final, clean)
    trainer.close()


def test_per_head_qk_norms_get_noise_only_when_asked_and_only_where_they_exist(tmp_path, tiny_llama_dir):
    qwen3 = tiny_transformer("qwen3")
    assert not any("q_norm" in name for name, _ in NoiseInjector(qwen3).targets)
    names = [name for name, _ in NoiseInjector(qwen3, include_qk_norm=True).targets]
    assert "model.layers.0.self_attn.q_norm.weight" in names and "model.layers.1.self_attn.k_norm.weight" in names
    with pytest.raises(ValueError, match=r"^aqn.include_qk_norm = true, but the model has no per-head q_norm/k_norm "
                                         r"weights$"):
        tiny_trainer(tmp_path, tiny_llama_dir, aqn={"include_qk_norm": True})


def test_noise_is_drawn_afresh_every_step(tmp_path, tiny_llama_dir):
    trainer = tiny_trainer(tmp_path, tiny_llama_dir, aqn={"sigma_start": 0.1, "sigma_end": 0.1, "num_stages": 2},
                           train={"steps": 4, "save_every": 4})
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["sigma"] for r in rows] == [0.0, 0.0, 0.1, 0.1] and rows[2]["noise_seed"] != rows[3]["noise_seed"]
    trainer.close()


# ----------------------------------------------------------------------------- evaluation, export, serving


@pytest.fixture
def corrected_run(tmp_path, tiny_llama_dir):
    """A trained adapter on the tiny base with per-layer schemes and a rank-4 correction, and its trainer's model."""
    trainer = tiny_trainer(tmp_path, tiny_llama_dir, quant={"error_correction_rank": 4,
                                                            "layer_schemes": {"*.o_proj": "fp8"}})
    adapter = trainer.train()
    trainer.close()
    return adapter, trainer


def test_evaluation_needs_the_base_the_adapter_trained_on(corrected_run, tiny_llama_dir):
    from qerl.model.runtime import check_adapter_base

    adapter, trainer = corrected_run
    check_adapter_base(str(adapter), trainer.settings.quant)  # the same base: fine
    plain = load_settings(DEFAULT, [f"model.path={tiny_llama_dir}"])
    with pytest.raises(ValueError, match=r"was trained on the base quant.scheme = 'nvfp4', layer_schemes = "
                                         r"\{'\*.o_proj': 'fp8'\}, error_correction_rank = 4 \(qerl_base.json\); set "
                                         r"those \(-S quant.KEY=VALUE\) to evaluate it$"):
        check_adapter_base(str(adapter), plain.quant)


def test_the_merged_export_folds_the_correction_and_the_unmerged_one_is_refused(corrected_run, tmp_path):
    from qerl.model.export import export_policy

    adapter, trainer = corrected_run
    with pytest.raises(ValueError, match=r"which a one-scheme base folder cannot hold: export with --merge"):
        export_policy(adapter, tmp_path / "unmerged")
    assert not (tmp_path / "unmerged").exists()
    export_policy(adapter, tmp_path / "merged", merge=True, scheme="bf16")
    written = load_file(str(tmp_path / "merged" / "model.safetensors"))
    expected = dict(lora.merged_state_dict(trainer.model, torch.bfloat16))  # the trained policy's weights
    k_proj = "model.layers.1.self_attn.k_proj"  # no LoRA there (tiny_settings' targets): the base weight alone
    base = quant_layers(trainer.model)[k_proj]
    assert torch.equal(written[f"{k_proj}.weight"], base.dequantized_weight(torch.float32).to(torch.bfloat16))
    assert not torch.equal(written[f"{k_proj}.weight"], get_codec("nvfp4").dequantize(base.quantized_tensors()))
    for name in (k_proj, "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"):
        assert torch.equal(written[f"{name}.weight"], expected[f"{name}.weight"]), name


def test_vllm_cannot_serve_a_base_made_at_load(tiny_llama_dir):
    from qerl.model.served import served_base

    settings = load_settings(DEFAULT, [f"model.path={tiny_llama_dir}", "quant.error_correction_rank=4"])
    with pytest.raises(ValueError, match=r"^rollout.backend: vllm serves a one-scheme base folder, which cannot hold "
                                         r"quant.layer_schemes or quant.error_correction_rank: sample with "
                                         r"rollout.backend engine$"):
        served_base(settings)


# ----------------------------------------------------------------------------- on the GPU kernels

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@pytest.mark.parametrize("scheme", ["nvfp4", "fp8"])
def test_the_gpu_kernels_add_the_correction_beside_their_gemm(scheme):
    torch.manual_seed(0)
    dense = nn.Linear(512, 256, bias=True).to("cuda", torch.bfloat16)
    layer = QuantLinear.from_linear(dense, scheme)
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    assert layer._on_gpu_kernel(x)
    plain = layer(x).float()
    h, b = torch.randn(8, 4, device="cuda", dtype=torch.bfloat16), torch.randn(256, 4, device="cuda",
                                                                               dtype=torch.bfloat16)
    plain_low_rank = layer.plus_low_rank(x, h, b, 0.5).float()
    layer.set_error_correction(dense.weight, 32)
    term = F.linear(F.linear(x.float(), layer.correction_b.float()), layer.correction_a.float())
    corrected = layer(x.requires_grad_()).float()
    torch.testing.assert_close(corrected, plain + term, atol=3e-2, rtol=0)
    torch.testing.assert_close(layer.plus_low_rank(x.detach(), h, b, 0.5).float(), plain_low_rank + term, atol=3e-2,
                               rtol=0)
    exact = dense(x.detach()).float()
    assert (corrected - exact).norm() < (plain - exact).norm()  # closer to the dense layer
    corrected.sum().backward()  # dx through the kernel's backward and the correction's
    expected_dx = torch.ones(8, 256, device="cuda") @ layer.dequantized_weight(torch.float32)
    assert ((x.grad.float() - expected_dx).norm() / expected_dx.norm()).item() < 0.05


@gpu
def test_a_gpu_training_step_with_fp8_layers_and_the_correction(tmp_path):
    from qerl.model.transformer import ModelConfig, Transformer
    from tests.test_trainer import char_tokenizer

    tok = char_tokenizer()
    torch.manual_seed(0)
    config = ModelConfig.from_hf({
        "model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": len(tok), "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "eos_token_id": tok.eos_token_id,
        "bos_token_id": None})
    model = Transformer.from_config(config, dtype=torch.bfloat16, device="cuda")
    quantize_model(model, "nvfp4", layer_schemes={"*.down_proj": "fp8"}, correction_rank=4)
    model.requires_grad_(False)
    settings = tiny_settings(tmp_path, model={"device": "cuda"}, train={"steps": 1, "save_every": 1},
                             quant={"layer_schemes": {"*.down_proj": "fp8"}, "error_correction_rank": 4})
    layers = quant_layers(model)
    before = {n: m.correction_a.clone() for n, m in layers.items()}
    with Trainer(settings, tmp_path / "run", model=model, tokenizer=tok, progress=False) as trainer:
        trainer.train()
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert all(v == v for v in (row["reward_mean"], row["entropy"], row["grad_norm"]))  # finite, not NaN
    assert all(torch.equal(m.correction_a, before[n]) for n, m in layers.items())
    assert {m.scheme for n, m in layers.items() if n.endswith("down_proj")} == {"fp8"}


def test_a_glob_matching_no_layer_fails_before_the_weights_load(tmp_path, tiny_llama_dir, monkeypatch):
    import qerl.model.runtime

    def no_load(*args, **kwargs):
        raise AssertionError("the weights loaded before the check")

    monkeypatch.setattr(qerl.model.runtime, "load_base_model", no_load)
    monkeypatch.setattr("qerl.rl.trainer.load_base_model", no_load)
    with pytest.raises(ValueError, match=r"^quant.layer_schemes: '\*.dwn_proj' matches no quantizable linear layer "
                                         r"\(they are named like 'model.layers.0.self_attn.q_proj'\)$"):
        tiny_trainer(tmp_path, tiny_llama_dir, quant={"layer_schemes": {"*.dwn_proj": "fp8"}})


def test_the_training_flow_quantizes_a_remedied_base_in_memory_not_into_a_folder(tiny_llama_dir):
    from qerl.flows.train import with_quantized_base

    settings = load_settings(DEFAULT, [f"model.path={tiny_llama_dir}", "quant.error_correction_rank=4"])
    assert with_quantized_base(settings, "never-written") is settings  # no `qerl quantize` folder holds it


def test_the_adapter_records_the_globs_in_their_order(tmp_path):
    """First match wins, so the order is part of the base: the record keeps it and an evaluation compares it."""
    from qerl.model.runtime import check_adapter_base

    first = load_settings(DEFAULT, ['quant.layer_schemes={"model.layers.0.*": bf16, "*.down_proj": fp8}']).quant
    swapped = load_settings(DEFAULT, ['quant.layer_schemes={"*.down_proj": fp8, "model.layers.0.*": bf16}']).quant
    (tmp_path / lora.BASE_RECORD).write_text(json.dumps(first.base_record()))
    assert lora.read_base_record(tmp_path)["layer_schemes"] == [["model.layers.0.*", "bf16"], ["*.down_proj", "fp8"]]
    check_adapter_base(str(tmp_path), first)
    with pytest.raises(ValueError, match="was trained on the base"):
        check_adapter_base(str(tmp_path), swapped)


@pytest.mark.parametrize("arm", ["nvfp4-fp8-sensitive", "nvfp4-correction", "nvfp4-aqn-norms"])
def test_each_remedy_arm_builds_its_base(tiny_llama_dir, arm):
    from qerl.flows.arms import ARMS
    from qerl.model.runtime import load_base_model

    settings = load_settings(DEFAULT, [f"model.path={tiny_llama_dir}", "model.device=cpu", *ARMS[arm]])
    layers = quant_layers(load_base_model(settings.model, settings.quant)[0])
    in_fp8 = {"v_proj", "down_proj"} if arm == "nvfp4-fp8-sensitive" else set()
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert {name.rsplit(".", 1)[1]: m.scheme for name, m in layers.items()} == {
        p: "fp8" if p in in_fp8 else "nvfp4" for p in projections}
    assert {m.correction_rank for m in layers.values()} == {16 if arm == "nvfp4-correction" else 0}


def test_the_randomized_svd_of_a_large_residual_is_nearly_the_exact_ones_and_repeats():
    """Above EXACT_SVD_MAX_DIM the correction's SVD is the randomized one (a 7B's full SVDs took minutes per load):
    on a residual shaped like a quantization error (white noise plus a weak low-rank part) its rank-16 correction
    leaves within 2% of the exact one's error, and the same matrix gives the same factors every time."""
    from qerl.quant.linear import EXACT_SVD_MAX_DIM, truncated_svd

    g = torch.Generator().manual_seed(0)
    m, n = 2 * EXACT_SVD_MAX_DIM, EXACT_SVD_MAX_DIM + 200
    residual = torch.randn(m, n, generator=g) + 0.3 * torch.randn(m, 8, generator=g) @ torch.randn(8, n, generator=g)
    u, s, vh = truncated_svd(residual, 16)
    eu, es, evh = torch.linalg.svd(residual, full_matrices=False)
    left = (residual - (u * s) @ vh).norm()
    best = (residual - (eu[:, :16] * es[:16]) @ evh[:16]).norm()
    assert u.shape == (m, 16) and s.shape == (16,) and vh.shape == (16, n)
    assert best <= left <= 1.02 * best
    again = truncated_svd(residual, 16)
    assert all(torch.equal(a, b) for a, b in zip((u, s, vh), again))


def test_a_resume_refuses_the_same_globs_in_another_order(tmp_path):
    """The first matching glob sets a layer's scheme: two orders can quantize a layer differently, so a resume with
    the globs reordered is refused as a changed quant.layer_schemes, not taken for the same settings."""
    from qerl.run.folder import check_resumed_settings

    saved = {"quant": {"layer_schemes": {"*.down_proj": "fp8", "model.layers.0.*": "bf16"}}}
    check_resumed_settings(tmp_path, saved, {"quant": {"layer_schemes": dict(saved["quant"]["layer_schemes"])}})
    swapped = {"quant": {"layer_schemes": {"model.layers.0.*": "bf16", "*.down_proj": "fp8"}}}
    with pytest.raises(ValueError, match="trained with other quant.layer_schemes"):
        check_resumed_settings(tmp_path, saved, swapped)
