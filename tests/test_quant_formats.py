"""Codec registry, MXFP4 vs compressed-tensors (bit-exact), NF4 properties."""

from __future__ import annotations

import pytest
import torch

from qerl.quant import fp8_channel, mxfp4, nf4, nvfp4
from qerl.quant.formats import SCHEMES, SERVABLE_SCHEMES, Codec, get_codec, scheme_for_compressed_tensors


@pytest.mark.parametrize("scheme", SCHEMES)
def test_codec_outputs_match_declared_shapes_and_round_trip(scheme: str) -> None:
    codec = get_codec(scheme)
    assert isinstance(codec, Codec) and codec.scheme == scheme
    w = torch.randn(80, 320, dtype=torch.bfloat16)
    tensors = codec.quantize(w)
    assert {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} == codec.tensor_shapes(80, 320)
    deq = codec.dequantize(tensors, torch.float32)
    assert deq.shape == (80, 320) and deq.dtype == torch.float32
    rel = ((deq - w.float()).norm() / w.float().norm()).item()
    assert rel < {"bf16": 1e-6, "fp8": 0.03}.get(scheme, 0.12)


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4", "nf4"])
def test_check_shape_names_layer_and_shape(scheme: str) -> None:
    codec = get_codec(scheme)
    codec.check_shape(4, codec.block_size * 3, "ok")
    with pytest.raises(ValueError, match=rf"layers.1.mlp.down_proj: shape \[4, 40\].*block size {codec.block_size}"):
        codec.check_shape(4, 40, "layers.1.mlp.down_proj")


def test_registry_errors() -> None:
    assert get_codec("NVFP4") is get_codec("nvfp4")
    with pytest.raises(ValueError, match="unknown quantization scheme 'fp3'.*nvfp4, mxfp4, nf4, fp8, bf16"):
        get_codec("fp3")
    with pytest.raises(KeyError, match="weight_global_scale"):
        get_codec("nvfp4").dequantize({"weight_packed": torch.zeros(2, 8, dtype=torch.uint8)})


def test_registry_names_each_codecs_compressed_tensors_format_and_what_vllm_serves() -> None:
    for scheme in SCHEMES:
        fmt = get_codec(scheme).compressed_tensors_format
        assert scheme_for_compressed_tensors(fmt) == (scheme if fmt is not None else None)
    assert scheme_for_compressed_tensors("int4-pack-quantized") is None
    assert scheme_for_compressed_tensors("nvfp4-pack-quantized") == "nvfp4"
    assert scheme_for_compressed_tensors("float-quantized") == "fp8"
    assert SERVABLE_SCHEMES == ("nvfp4", "mxfp4", "fp8", "bf16")  # nf4 is qerl's own layout: vLLM cannot read it


# ------------------------------------------------------------------------------------------------ MXFP4


def ct_mxfp4(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], object]:
    """llm-compressor's MXFP4A16: min-max per 32, compressed-tensors' qparams and MXFP4 compressor."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    blocks = w.unflatten(-1, (w.shape[1] // 32, 32))
    scale, zero_point = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights)
    state = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zero_point}
    return dict(MXFP4PackedCompressor.compress(state, scheme)), scheme


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_matches_compressed_tensors_bit_for_bit(dtype: torch.dtype) -> None:
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor

    g = torch.Generator().manual_seed(0)
    w = torch.distributions.StudentT(1.5).sample((64, 256)) * 0.02
    w[1] = torch.randn(256, generator=g) * 1e-30  # tiny blocks
    w[2] = 0.0
    w[3, :32], w[4, :32] = 7.0, 6.9  # block max with mantissa 1.75 (rounds the scale up) and just below
    w = w.to(dtype)
    theirs, scheme = ct_mxfp4(w)
    ours = mxfp4.quantize(w)
    assert set(ours) == set(theirs) == {"weight_packed", "weight_scale"}
    assert torch.equal(ours["weight_packed"], theirs["weight_packed"])
    assert torch.equal(ours["weight_scale"], theirs["weight_scale"])
    decompressed = MXFP4PackedCompressor.decompress(dict(ours), scheme)["weight"]
    assert torch.equal(mxfp4.dequantize(**ours).view(torch.int16), decompressed.view(torch.int16))


def test_mxfp4_scale_is_a_power_of_two_keeping_the_block_max_in_range() -> None:
    amax = torch.tensor([6.0, 6.9, 7.0, 1.0, 0.0])
    # 6 -> 2^0 (6/1 = 6); 6.9 -> 2^0 (saturates to 6); 7 -> 2^1 (3.5 -> 4); 1 -> 2^-2 (1/0.25 = 4)
    assert (mxfp4.scale_exponents(amax).int() - 127).tolist() == [0, 0, 1, -2, -127]


# -------------------------------------------------------------------------------------------------- NF4


def test_nf4_codes_are_nearest_levels_and_absmax_is_double_quantized() -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 256) * torch.linspace(0.01, 1.0, 40).unsqueeze(1)  # absmax spread across rows
    q = nf4.quantize(w)
    assert q["weight_absmax_scale"].shape == (1,)  # 40*4 = 160 blocks: one group of 256
    absmax = w.unflatten(-1, (4, 64)).abs().amax(-1)
    dq_absmax = nf4._absmax(q["weight_absmax_q"], q["weight_absmax_scale"], q["weight_absmax_offset"])
    assert q["weight_absmax_offset"].item() == pytest.approx(absmax.mean().item(), rel=1e-6)
    assert (dq_absmax - absmax).abs().max() <= q["weight_absmax_scale"].max() / 2 + 1e-7
    # every code is the nearest NF4 level to w / (reconstructed absmax)
    normalized = (w.unflatten(-1, (4, 64)) / dq_absmax.unsqueeze(-1)).clamp(-1, 1).flatten(-2)
    nearest = (normalized.unsqueeze(-1) - nf4.NF4_VALUES).abs().argmin(-1)
    assert torch.equal(nf4.nf4_codes(q["weight_packed"]).long(), nearest)


def test_nf4_error_close_to_undouble_quantized_nf4() -> None:
    torch.manual_seed(1)
    w = torch.randn(64, 512) * 0.02
    rel = (nf4.dequantize(**nf4.quantize(w), dtype=torch.float32) - w).norm() / w.norm()
    assert 0.06 < rel < 0.1


def test_nf4_dequantize_validates_tensors() -> None:
    q = nf4.quantize(torch.randn(8, 128))
    q["weight_absmax_q"] = q["weight_absmax_q"].float()
    with pytest.raises(ValueError, match=r"weight_absmax_q: got torch.float32 \(8, 2\), expected torch.int8"):
        nf4.dequantize(**q)


# ----------------------------------------------------------------------------------------- all formats


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4", "nf4", "fp8"])
def test_dequantize_in_row_chunks_is_exact(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    codec = get_codec(scheme)
    w = torch.randn(50, 256)
    tensors = codec.quantize(w)
    whole = codec.dequantize(tensors, torch.float32)
    monkeypatch.setattr(nvfp4, "_ROWS_PER_CHUNK_ELEMS", 7 * 256)  # 7-row chunks, ragged last one
    monkeypatch.setattr(fp8_channel, "_ROWS_PER_CHUNK_ELEMS", 7 * 256)
    assert torch.equal(codec.dequantize(tensors, torch.float32), whole)
    chunked = codec.quantize(w)
    assert all(torch.equal(chunked[k].view(torch.uint8), tensors[k].view(torch.uint8)) for k in tensors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4", "nf4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_quantization_is_bit_identical_to_cpu(scheme: str, dtype: torch.dtype) -> None:
    codec = get_codec(scheme)
    w = (torch.distributions.StudentT(2.0).sample((512, 1024)) * 0.02).to(dtype)
    on_cpu, on_gpu = codec.quantize(w), codec.quantize(w.cuda())
    for name in on_cpu:
        assert torch.equal(on_cpu[name].view(torch.uint8), on_gpu[name].cpu().view(torch.uint8)), name
    assert torch.equal(codec.dequantize(on_cpu).view(torch.int16), codec.dequantize(on_gpu).cpu().view(torch.int16))
