"""NVFP4 codec vs compressed-tensors (the format vLLM and llm-compressor read/write): bit-exact."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from qerl.quant import nvfp4

needs_ct = pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None,
                              reason="compressed-tensors not installed")


def ct_scheme():
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme("NVFP4A16", ["Linear"])


def ct_decompress(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    return NVFP4PackedCompressor.decompress(dict(tensors), ct_scheme())["weight"]


def ct_compress(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """What llm-compressor does for NVFP4A16: min-max observer in the weight's dtype, compressed-tensors'
    qparams, scale stored in a weight-dtype parameter, then the NVFP4 compressor."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = ct_scheme()
    blocks = w.unflatten(-1, (w.shape[1] // 16, 16))
    if global_scale is None:
        global_scale = generate_gparam(w.amin(), w.amax())
    scale, zero_point = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale)
    state = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_global_scale": global_scale,
             "weight_zero_point": zero_point}
    return dict(NVFP4PackedCompressor.compress(state, scheme))


def assert_same_tensors(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(theirs) == {"weight_packed", "weight_scale", "weight_global_scale"}
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype, name
        assert ours[name].shape == theirs[name].shape, name
        # compare bytes: float8 has no torch.equal on every build, and -0 vs 0 must count as a difference
        a, b = ours[name].contiguous().view(torch.uint8), theirs[name].contiguous().view(torch.uint8)
        mismatch = (a != b).sum().item()
        assert mismatch == 0, f"{name}: {mismatch} of {a.numel()} bytes differ"


def weights(kind: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        w = torch.randn(96, 256, generator=g) * 0.02
    elif kind == "heavy_tailed":  # Student-t(1.5): blocks span many binades, some block scales go subnormal
        w = torch.distributions.StudentT(1.5).sample((96, 256)) * 0.01
    elif kind == "outliers":  # one huge outlier: most block scales underflow e4m3 -> the 0.125 floor
        w = torch.randn(96, 256, generator=g) * 1e-3
        w[3, 17] = 1e4
        w[10:12] = 0.0  # all-zero blocks
    else:
        raise AssertionError(kind)
    return w.to(dtype)


@needs_ct
@pytest.mark.parametrize("kind", ["normal", "heavy_tailed", "outliers"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_matches_compressed_tensors_bit_for_bit(kind: str, dtype: torch.dtype) -> None:
    w = weights(kind, dtype)
    assert_same_tensors(nvfp4.quantize(w), ct_compress(w))


@needs_ct
def test_shared_global_scale_matches_compressed_tensors() -> None:
    w = weights("normal", torch.bfloat16)
    shared = torch.tensor([1234.5], dtype=torch.float32)  # e.g. the min over q/k/v's own scales
    ours = nvfp4.quantize(w, global_scale=shared)
    assert ours["weight_global_scale"].item() == 1234.5
    assert_same_tensors(ours, ct_compress(w, shared))


@needs_ct
@pytest.mark.parametrize("kind", ["normal", "heavy_tailed", "outliers"])
def test_dequantize_equals_compressed_tensors_decompression(kind: str) -> None:
    q = nvfp4.quantize(weights(kind, torch.bfloat16, seed=1))
    theirs = ct_decompress(q)
    ours = nvfp4.dequantize(q["weight_packed"], q["weight_scale"], q["weight_global_scale"])
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))


@needs_ct
def test_e2m1_round_matches_cast_to_fp4_on_every_tie_and_sign() -> None:
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat([torch.linspace(-6.0, 6.0, 4801), ties, -ties, ties.nextafter(torch.tensor(0.0)),
                   ties.nextafter(torch.tensor(9.0)), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 6.0, -6.0])])
    x = x[: x.numel() // 2 * 2].reshape(1, -1)
    expected = pack_fp4_to_uint8(cast_to_fp4(x.clone()))
    assert torch.equal(nvfp4.pack_e2m1(nvfp4.e2m1_round(x)), expected)


def test_packing_layout_and_decode() -> None:
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = nvfp4.pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x8F]]  # even column in the low nibble
    assert torch.equal(nvfp4.unpack_e2m1(packed), codes)
    assert nvfp4.e2m1_decode(codes).tolist() == [[0.5, 1.0, -6.0, -0.0]]
    all_bytes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    assert torch.equal(nvfp4.decode_packed(all_bytes), nvfp4.e2m1_decode(nvfp4.unpack_e2m1(all_bytes)))


def test_row_chunking_does_not_change_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    w = weights("heavy_tailed", torch.bfloat16, seed=2)
    whole = nvfp4.quantize(w)
    monkeypatch.setattr(nvfp4, "_ROWS_PER_CHUNK_ELEMS", 7 * 256)  # 7-row chunks, ragged last chunk
    assert_same_tensors(nvfp4.quantize(w), whole)


def test_reconstruction_error_is_that_of_4_bit_floats() -> None:
    w = weights("normal", torch.float32)
    rel = (nvfp4.dequantize(**nvfp4.quantize(w), dtype=torch.float32) - w).norm() / w.norm()
    assert 0.05 < rel < 0.12


def test_bad_inputs_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"\[8, 24\].*multiple of the block size 16"):
        nvfp4.quantize(torch.randn(8, 24))
    with pytest.raises(ValueError, match="2-D"):
        nvfp4.quantize(torch.randn(16))
    w = torch.randn(4, 32)
    w[2, 5] = float("nan")
    with pytest.raises(ValueError, match=r"NaN/Inf at \[2, 5\]"):
        nvfp4.quantize(w)
    q = nvfp4.quantize(torch.randn(4, 32))
    with pytest.raises(ValueError, match="weight_scale shape"):
        nvfp4.dequantize(q["weight_packed"], q["weight_scale"][:, :1], q["weight_global_scale"])
