"""QuantLinear and model-wide replacement: storage size, exact forward, input-only grads, loading."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qerl.quant.formats import get_codec
from qerl.quant.linear import QuantLinear, quantize_model, replace_with_empty_quant_linears

SCHEMES = ["nvfp4", "mxfp4", "nf4", "fp8", "bf16"]


def qwen25_7b_linears() -> list[tuple[int, int, bool]]:
    """(in, out, bias) of every decoder linear of Qwen2.5-7B: hidden 3584, intermediate 18944, 28 layers."""
    h, i, kv = 3584, 18944, 512
    layer = [(h, h, True), (h, kv, True), (h, kv, True), (h, h, False), (h, i, False), (h, i, False), (i, h, False)]
    return layer * 28


@pytest.mark.parametrize(("scheme", "low", "high"), [("nvfp4", 4.4, 4.6), ("mxfp4", 4.24, 4.26),
                                                     ("nf4", 4.12, 4.14), ("fp8", 8.0, 8.01), ("bf16", 16, 16)])
def test_7b_decoder_bits_per_weight(scheme: str, low: float, high: float) -> None:
    bits = weights = 0
    for in_f, out_f, bias in qwen25_7b_linears():
        layer = QuantLinear(in_f, out_f, bias, scheme, device="meta")
        bits += layer.weight_bits()
        weights += in_f * out_f
    assert weights == 6_525_288_448  # the 6.5B linear weights of the 7.6B model
    assert low <= bits / weights <= high


def make_layer(scheme: str, in_f: int = 128, out_f: int = 48, bias: bool = True, seed: int = 0) -> tuple[nn.Linear, QuantLinear]:
    torch.manual_seed(seed)
    dense = nn.Linear(in_f, out_f, bias=bias)
    return dense, QuantLinear.from_linear(dense, scheme)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_linear_with_the_dequantized_weight(scheme: str, dtype: torch.dtype) -> None:
    dense, layer = make_layer(scheme)
    x = torch.randn(2, 5, 128).to(dtype)
    expected = F.linear(x, get_codec(scheme).dequantize(layer.quantized_tensors(), dtype)) + dense.bias.to(dtype)
    assert torch.equal(layer(x), expected)
    # and it approximates the dense layer at 4-bit accuracy
    ref = dense(x.float())
    assert ((layer(x).float() - ref).norm() / ref.norm()).item() < {"bf16": 0.02, "fp8": 0.04}.get(scheme, 0.15)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_grads_flow_to_the_input_only_and_w_is_not_saved(scheme: str) -> None:
    _, layer = make_layer(scheme, in_f=256, out_f=64)
    x = torch.randn(3, 256, requires_grad=True)
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    w = layer.dequantized_weight(torch.float32)
    x_ref = x.detach().clone().requires_grad_()
    F.linear(x_ref, w).backward(grad_out)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-6)
    assert list(layer.parameters()) == []
    assert all(b.grad is None and not b.requires_grad for b in layer.buffers())
    assert torch.Size([64, 256]) not in saved  # no dense weight kept for backward


def test_cpu_weight_cache_follows_every_change_of_the_stored_weight() -> None:
    """Off CUDA the dequantized weight is kept between forwards; whatever changes the stored tensors (an in-place
    write, load_state_dict, a reassigned buffer) must show in the next output, exactly as a fresh dequantization."""
    _, layer = make_layer("nvfp4")
    _, other = make_layer("nvfp4", seed=1)
    x = torch.randn(4, 128)

    def expected() -> torch.Tensor:
        return F.linear(x, layer.dequantized_weight(torch.float32), layer.bias)

    layer(x)  # fills the cache
    first = layer.compute_weight(torch.float32)
    assert layer.compute_weight(torch.float32) is first  # kept, not decoded again
    with torch.no_grad():
        layer.weight_scale.copy_(other.weight_scale)  # in place
    assert torch.equal(layer(x), expected())
    layer.load_state_dict(other.state_dict())
    assert torch.equal(layer(x), expected())
    layer.weight_packed = torch.flip(layer.weight_packed, [0]).contiguous()  # a new tensor
    assert torch.equal(layer(x), expected())
    assert layer.compute_weight(torch.float64).dtype == torch.float64  # a cache per compute dtype


def test_state_dict_round_trip_into_empty_layers() -> None:
    _, layer = make_layer("nvfp4")
    state = layer.state_dict()
    assert set(state) == {"weight_packed", "weight_scale", "weight_global_scale", "bias"}
    x = torch.randn(4, 128)
    for device, assign in (("meta", True), ("cpu", False)):
        empty = QuantLinear(128, 48, True, "nvfp4", device=device, dtype=torch.float32)
        empty.load_state_dict(state, assign=assign)
        assert torch.equal(empty(x), layer(x))


@pytest.mark.parametrize("scheme", ["nvfp4", "nf4"])
def test_model_to_dtype_keeps_the_stored_format(scheme: str) -> None:
    dense, layer = make_layer(scheme)
    before = {k: v.clone() for k, v in layer.quantized_tensors().items()}
    model = nn.Sequential(layer).to(torch.bfloat16)
    for name, t in layer.quantized_tensors().items():
        assert t.dtype == before[name].dtype and torch.equal(t.view(torch.uint8), before[name].view(torch.uint8))
    assert layer.bias.dtype == torch.bfloat16 and layer.dtype == torch.bfloat16
    assert layer.dequantized_weight().dtype == torch.bfloat16
    model.to(torch.float32)  # the other way round too (nf4's fp32 absmax scale must not pass through bf16)
    assert all(torch.equal(t.view(torch.uint8), before[n].view(torch.uint8)) for n, t in layer.quantized_tensors().items())


def test_bad_shapes_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj: shape \[64, 40\].*block size 16"):
        QuantLinear(40, 64, False, "nvfp4", device="meta", name="model.layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match="unknown quantization scheme 'int3'"):
        QuantLinear(64, 64, False, "int3", device="meta")
    _, layer = make_layer("nvfp4")
    with pytest.raises(ValueError, match=r"expects input \[..., 128\]"):
        layer(torch.randn(2, 64))


def tiny_llama(intermediate: int = 128):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=intermediate,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("scheme", ["nvfp4", "nf4"])
def test_quantize_model_replaces_decoder_linears_only(scheme: str) -> None:
    model = tiny_llama()
    dense_logits_model = tiny_llama()
    replaced = quantize_model(model, scheme)
    assert len(replaced) == 14 and all(".layers." in n for n in replaced)
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    # same model with each linear's weight set to its dequantized value gives identical logits
    for name in replaced:
        dense_logits_model.get_submodule(name).weight.data = model.get_submodule(name).dequantized_weight(torch.float32)
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, dense_logits_model(ids).logits)
    if scheme == "nvfp4":  # fused projections share their global scale
        attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
        assert attn.q_proj.weight_global_scale == attn.k_proj.weight_global_scale == attn.v_proj.weight_global_scale
        assert mlp.gate_proj.weight_global_scale == mlp.up_proj.weight_global_scale
        assert attn.o_proj.weight_global_scale != attn.q_proj.weight_global_scale


def test_fp8_weight_copies_are_planned_only_where_fp8_tensor_cores_are() -> None:
    """quant.fp8_weights: without a GPU with FP8 tensor cores (here: the CPU) no layer is marked to keep an FP8 copy,
    whatever the setting; `true` says so in one warning, `auto` and `false` say nothing."""
    import warnings

    from qerl.quant.linear import plan_fp8_weights

    model = tiny_llama()
    quantize_model(model, "nvfp4")
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for setting in ("auto", False):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert plan_fp8_weights(model, setting, torch.device("cpu")) is False
    with pytest.warns(UserWarning, match="fp8_weights = true needs a CUDA GPU with FP8 tensor cores"):
        assert plan_fp8_weights(model, True, torch.device("cpu")) is False
    assert layers and not any(m.fp8_weights for m in layers)


def test_empty_quant_linears_on_meta_load_a_quantized_state_dict() -> None:
    quantized = tiny_llama()
    quantize_model(quantized, "mxfp4")
    state = quantized.state_dict()
    with torch.device("meta"):
        target = tiny_llama()
    replaced = replace_with_empty_quant_linears(target, "mxfp4", dtype=torch.float32)
    assert len(replaced) == 14 and target.model.layers[0].mlp.down_proj.weight_packed.is_meta
    target.load_state_dict(state, assign=True, strict=True)
    target.model.rotary_emb.inv_freq = quantized.model.rotary_emb.inv_freq  # non-persistent buffer
    ids = torch.randint(0, 96, (1, 7))
    with torch.no_grad():
        assert torch.equal(target(ids).logits, quantized(ids).logits)


def test_ragged_layers_stay_dense_with_a_warning_or_fail_when_strict(caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_llama(intermediate=72)  # down_proj in_features 72: not a multiple of 16
    with caplog.at_level(logging.WARNING, logger="qerl.quant.linear"):
        replaced = quantize_model(model, "nvfp4")
    assert len(replaced) == 12 and type(model.model.layers[0].mlp.down_proj) is nn.Linear
    assert "model.layers.0.mlp.down_proj: shape [64, 72]" in caplog.text
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj: shape \[64, 72\]"):
        quantize_model(tiny_llama(intermediate=72), "nvfp4", strict=True)
