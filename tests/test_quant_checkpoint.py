"""quantize_checkpoint on a tiny sharded Llama: layout, compressed-tensors/transformers round trip, ragged K."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from qerl.evaluation.evaluate import add_perplexity
from qerl.quant import nvfp4
from qerl.quant.checkpoint import quantization_config, quantize_checkpoint, scheme_from_config
from qerl.quant.formats import get_codec

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def write_tiny_llama(folder: Path, intermediate: int = 256, max_shard_size: str | None = "200KB") -> Path:
    """Random fp32 Llama (~1 MB, 5 shards with the default shard size) with a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=intermediate,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, attention_bias=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    vocab = {f"w{i}": i for i in range(255)} | {"<unk>": 255}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(folder)
    return folder


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for name in files:
        with safe_open(folder / name, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("ckpt") / "src")


@pytest.fixture(scope="module")
def quantized(src: Path) -> dict[str, tuple[Path, object]]:
    out = {}
    for scheme in ("nvfp4", "mxfp4", "nf4", "fp8"):
        dst = src.parent / scheme
        out[scheme] = (dst, quantize_checkpoint(src, dst, scheme, progress=False))
    return out


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4", "nf4", "fp8"])
def test_written_folder_layout_dtypes_and_shapes(src: Path, quantized: dict, scheme: str) -> None:
    dst, report = quantized[scheme]
    codec = get_codec(scheme)
    src_index = json.loads((src / "model.safetensors.index.json").read_text())
    dst_index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = set(src_index["weight_map"].values())
    assert len(shards) >= 3 and set(dst_index["weight_map"].values()) == shards  # same shard layout
    assert {p.name for p in dst.glob("*.safetensors")} == shards
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / file).read_bytes() == (src / file).read_bytes()

    before, after = read_all(src), read_all(dst)
    assert set(dst_index["weight_map"]) == set(after)
    assert dst_index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in after.values())
    for layer in range(2):
        for linear in LINEARS:
            module = f"model.layers.{layer}.{linear}"
            w = before.pop(f"{module}.weight")
            stored = codec.tensor_shapes(*w.shape)
            assert (f"{module}.weight" in after) == ("weight" in stored)  # fp8 keeps the name, in E4M3
            for name, (shape, dtype) in stored.items():
                t = after.pop(f"{module}.{name}")
                assert (tuple(t.shape), t.dtype) == (shape, dtype), f"{module}.{name}"
            low, high = (0.01, 0.035) if scheme == "fp8" else (0.05, 0.13)
            assert low < report.layer_errors[f"{module}.weight"] < high
    for name, t in before.items():  # embeddings, lm_head, norms, biases: unchanged, in the source's dtype (fp32)
        assert after[name].dtype == t.dtype == torch.float32, name
        assert torch.equal(after[name], t), name
    assert set(after) == set(before)
    assert len(report.layer_errors) == 14 and not report.kept_dense
    assert report.bytes_after < 0.5 * report.bytes_before

    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == quantization_config(scheme)
    assert scheme_from_config(config["quantization_config"]) == scheme
    assert config["dtype" if "dtype" in config else "torch_dtype"] == "bfloat16"  # what to run it in (A16)


def test_nvfp4_tensors_are_compressed_tensors_quantization_with_fused_scales(src: Path, quantized: dict) -> None:
    before, after = read_all(src), read_all(quantized["nvfp4"][0])
    for prefix, group in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
        names = [f"model.layers.1.{prefix}.{p}" for p in group]
        shared = nvfp4.global_scale_for(torch.stack([before[f"{n}.weight"].abs().amax() for n in names]).amax())
        for n in names:
            expected = nvfp4.quantize(before[f"{n}.weight"], shared)
            for k, v in expected.items():
                assert torch.equal(after[f"{n}.{k}"].view(torch.uint8), v.view(torch.uint8)), f"{n}.{k}"
    own = nvfp4.quantize(before["model.layers.1.self_attn.o_proj.weight"])  # o_proj: its own scale
    assert torch.equal(after["model.layers.1.self_attn.o_proj.weight_global_scale"], own["weight_global_scale"])


def test_config_is_what_compressed_tensors_serializes(quantized: dict) -> None:
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    for scheme, preset in (("nvfp4", "NVFP4A16"), ("mxfp4", "MXFP4A16"), ("fp8", "FP8_DYNAMIC")):
        ours = json.loads((quantized[scheme][0] / "config.json").read_text())["quantization_config"]
        fmt = get_codec(scheme).compressed_tensors_format
        reference_scheme = preset_name_to_scheme(preset, ["Linear"])
        reference_scheme.format = fmt
        reference = QuantizationConfig(config_groups={"group_0": reference_scheme}, ignore=["lm_head"], format=fmt,
                                       quantization_status="compressed")
        # ModelCompressor.update_config adds these around QuantizationConfig.model_dump(exclude=["quant_method"])
        assert ours["quant_method"] == "compressed-tensors" and ours["sparsity_config"] == {}
        parsed = QuantizationConfig.model_validate(
            {k: v for k, v in ours.items() if k not in ("version", "sparsity_config", "transform_config")})
        assert parsed.model_dump() == reference.model_dump()


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4", "fp8"])
def test_transformers_and_compressed_tensors_load_our_folder_to_our_weights(quantized: dict, scheme: str) -> None:
    pytest.importorskip("compressed_tensors")
    dst = quantized[scheme][0]
    stored = read_all(dst)
    model = transformers.AutoModelForCausalLM.from_pretrained(dst)
    logits = model(torch.tensor([[1, 2, 3]])).logits  # the first forward decompresses via compressed-tensors
    assert logits.shape == (1, 3, 256) and torch.isfinite(logits).all()
    codec = get_codec(scheme)
    for layer in range(2):
        for linear in LINEARS:
            module = f"model.layers.{layer}.{linear}"
            tensors = {k: stored[f"{module}.{k}"] for k in codec.tensor_shapes(1, 32)}
            ours = codec.dequantize(tensors, torch.bfloat16)
            theirs = model.get_submodule(module).weight.data
            assert theirs.dtype == torch.bfloat16
            if scheme == "fp8":  # transformers holds weight_scale in the model's dtype: our FP32 scale rounded to bf16
                as_read = {"weight": tensors["weight"], "weight_scale": tensors["weight_scale"].bfloat16().float()}
                assert torch.equal(theirs.view(torch.int16), codec.dequantize(as_read).view(torch.int16)), module
                assert torch.allclose(theirs, ours, rtol=2**-7, atol=0), module  # within one bf16 rounding
                continue
            assert torch.equal(theirs.view(torch.int16), ours.view(torch.int16)), module


def test_ragged_layer_kept_dense_with_warning_or_strict_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = write_tiny_llama(tmp_path / "src", intermediate=200, max_shard_size=None)  # down_proj K = 200
    with caplog.at_level(logging.WARNING, logger="qerl.quant.checkpoint"):
        report = quantize_checkpoint(src, tmp_path / "out", "nvfp4", progress=False)
    assert "model.layers.0.mlp.down_proj.weight: shape [128, 200]" in caplog.text
    assert set(report.kept_dense) == {f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)}
    assert len(report.layer_errors) == 12
    after = read_all(tmp_path / "out")
    assert torch.equal(after["model.layers.0.mlp.down_proj.weight"], read_all(src)["model.layers.0.mlp.down_proj.weight"])
    assert "model.layers.0.mlp.down_proj.weight_packed" not in after
    ignore = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]

    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight: shape \[128, 200\]"):
        quantize_checkpoint(src, tmp_path / "strict", "nvfp4", progress=False, strict=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # nothing half-written left behind


def test_bad_sources_and_destinations(tmp_path: Path, src: Path, quantized: dict) -> None:
    with pytest.raises(FileExistsError, match="already exists"):
        quantize_checkpoint(src, quantized["nf4"][0], "nf4", progress=False)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(quantized["nvfp4"][0], tmp_path / "again", "nvfp4", progress=False)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        quantize_checkpoint(tmp_path, tmp_path / "x", "nvfp4", progress=False)
    with pytest.raises(ValueError, match="unknown quantization scheme 'int2'"):
        quantize_checkpoint(src, tmp_path / "y", "int2", progress=False)


def test_single_file_checkpoint_with_perplexity(tmp_path: Path) -> None:
    src = write_tiny_llama(tmp_path / "src", max_shard_size=None)
    text = " ".join(f"w{(i * 7) % 255}" for i in range(300))
    report = add_perplexity(quantize_checkpoint(src, tmp_path / "out", "nvfp4", progress=False), text)
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
    # a random 256-token model: perplexity near the vocabulary size, barely moved by 4-bit weights
    assert 100 < report.perplexity_before < 600
    assert report.perplexity_after == pytest.approx(report.perplexity_before, rel=0.05)
    assert "perplexity" in report.summary()
