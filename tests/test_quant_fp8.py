"""quant.scheme fp8: the codec against compressed-tensors (FP8_DYNAMIC's weights, bit for bit), its error, the layer on
the CPU, and kernels/fp8_gemm.py's FP8 products (on the CPU through torch._scaled_mm's CPU kernel; on CUDA below)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from qerl.quant import fp8_channel
from qerl.quant.checkpoint import quantization_config, scheme_from_config
from qerl.quant.formats import get_codec
from qerl.quant.linear import QuantLinear

needs_ct = pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None,
                              reason="compressed-tensors not installed")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def ct_compress(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], object]:
    """What llm-compressor does for FP8_DYNAMIC's weights: a min-max observer per output channel in the weight's
    dtype, compressed-tensors' qparams, then its float-quantized compressor."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    scale, zero_point = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), scheme.weights)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}
    return dict(FloatQuantizationCompressor.compress(state, scheme)), scheme


def weights(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.distributions.StudentT(1.5).sample((64, 256)) * 0.02  # rows spanning many binades: subnormal codes
    w[1] = torch.randn(256, generator=g) * 1e-30  # a tiny row
    w[2] = 0.0  # an all-zero row: compressed-tensors' epsilon scale
    w[3, :8] = torch.tensor([448.0, 416.0, 432.0, 440.0, -448.0, 1.0, 0.0, -0.0])  # the max on 448; ties to even
    return w.to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


@needs_ct
def test_fp32_weights_are_compressed_tensors_fp8_dynamic_bit_for_bit() -> None:
    w = weights(torch.float32)
    theirs, _ = ct_compress(w)
    ours = fp8_channel.quantize(w)
    assert set(ours) == set(theirs) == {"weight", "weight_scale"}
    assert same_bytes(ours["weight"], theirs["weight"]) and same_bytes(ours["weight_scale"], theirs["weight_scale"])
    assert ours["weight"].dtype == torch.float8_e4m3fn and ours["weight_scale"].shape == (64, 1)


@needs_ct
def test_bf16_weights_get_fp32_scales_as_compressed_tensors_on_their_fp32_values() -> None:
    """llm-compressor would round a bf16 model's scales (and W / scale) in bf16; we keep FP32 scales (one rounding):
    the bytes are compressed-tensors' for the same values held in FP32, and its decompressor reads ours."""
    w = weights(torch.bfloat16)
    theirs, scheme = ct_compress(w.float())
    ours = fp8_channel.quantize(w)
    assert same_bytes(ours["weight"], theirs["weight"]) and same_bytes(ours["weight_scale"], theirs["weight_scale"])
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor

    decompressed = FloatQuantizationCompressor.decompress(dict(ours), scheme)["weight"]
    assert torch.equal(decompressed, fp8_channel.dequantize(ours["weight"], ours["weight_scale"], torch.float32))


def test_round_to_nearest_error_bounds_and_row_maxima() -> None:
    w = torch.randn(96, 512, generator=torch.Generator().manual_seed(1)) * torch.linspace(1e-3, 1, 96)[:, None]
    q = fp8_channel.quantize(w)
    scale = q["weight_scale"]
    assert torch.equal(scale, w.abs().amax(1, keepdim=True) / 448)
    deq = fp8_channel.dequantize(q["weight"], scale, torch.float32)
    # E4M3: 3 mantissa bits (half a step is 2^-4 of a normal value), subnormal steps of 2^-9 below 2^-6
    bound = torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
    assert ((deq - w).abs() <= bound).all()
    assert torch.allclose(deq.abs().amax(1), w.abs().amax(1), rtol=1e-6)  # each row's max is a code (448)
    rel = ((deq - w).norm() / w.norm()).item()
    assert 0.01 < rel < 0.035  # ~2.5%: a quarter of NVFP4's ~10%
    err = deq - w
    assert abs(err.mean().item()) < 0.02 * err.abs().mean().item()  # round-to-nearest: no bias


def test_dequantize_and_quantize_reject_wrong_tensors() -> None:
    q = fp8_channel.quantize(torch.randn(8, 32))
    with pytest.raises(ValueError, match=r"fp8 weight: got torch.float32 \(8, 32\)"):
        fp8_channel.dequantize(q["weight"].float(), q["weight_scale"])
    with pytest.raises(ValueError, match=r"fp8 weight_scale: got \(4, 1\), expected \(8, 1\)"):
        fp8_channel.dequantize(q["weight"], q["weight_scale"][:4])
    with pytest.raises(ValueError, match="fp8 quantizes 2-D float weights"):
        fp8_channel.quantize(torch.ones(3, dtype=torch.int32))


@needs_ct
def test_config_is_compressed_tensors_fp8_dynamic() -> None:
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    ours = quantization_config("fp8")
    reference_scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    reference_scheme.format = "float-quantized"
    reference = QuantizationConfig(config_groups={"group_0": reference_scheme}, ignore=["lm_head"],
                                   format="float-quantized", quantization_status="compressed")
    parsed = QuantizationConfig.model_validate(
        {k: v for k, v in ours.items() if k not in ("version", "sparsity_config", "transform_config")})
    assert parsed.model_dump() == reference.model_dump()
    assert ours["config_groups"]["group_0"]["input_activations"]["strategy"] == "token"  # vLLM's W8A8, not W8A16
    assert scheme_from_config(ours) == "fp8"


def test_other_float_quantized_layouts_are_refused_by_name() -> None:
    per_tensor = quantization_config("fp8")
    per_tensor["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    with pytest.raises(ValueError, match=r"float-quantized.*group_0.weights \{'strategy': 'tensor'\}.*'channel'"):
        scheme_from_config(per_tensor)


# ------------------------------------------------------------------------------------------------ the layer


def test_quant_linear_on_the_cpu_is_the_dequantized_linear_and_round_trips_its_state_dict() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    layer = QuantLinear.from_linear(linear, "fp8")
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
    assert layer.weight_bits() == 64 * 48 * 8 + 48 * 32
    x = torch.randn(5, 64, requires_grad=True)
    w = get_codec("fp8").dequantize(layer.quantized_tensors(), torch.float32)
    y = layer(x)
    assert torch.allclose(y, x @ w.t() + linear.bias, atol=1e-6)
    y.square().sum().backward()
    assert torch.allclose(x.grad, (2 * y.detach()) @ w, atol=1e-5)
    again = QuantLinear(64, 48, True, "fp8", dtype=torch.float32)
    again.load_state_dict(layer.state_dict())
    assert torch.equal(again(x), y)
    assert not layer.fp8_activations()  # on the CPU: the dequantized weight, bf16/fp32 activations


def test_fused_fp8_projections_keep_each_members_rows_and_scales() -> None:
    torch.manual_seed(0)
    layers = [QuantLinear.from_linear(nn.Linear(32, n, bias=False), "fp8") for n in (48, 16, 16)]
    x = torch.randn(3, 32)
    alone = [m(x) for m in layers]
    fused = QuantLinear.concat(layers)
    assert fused is not None and fused.weight_scale.shape == (80, 1)
    assert all(torch.equal(m(x), y) for m, y in zip(layers, alone))


# ---------------------------------------------------------------------------------- kernels/fp8_gemm.py on the CPU


def _cpu_scaled_mm_takes_row_scales() -> bool:
    """torch 2.13's CPU `_scaled_mm` takes per-row scales; earlier CPU kernels (2.11's oneDNN one) per-tensor only."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def _gemm(n: int = 48, k: int = 64, seed: int = 0):
    pytest.importorskip("triton")
    if not _cpu_scaled_mm_takes_row_scales():
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only (2.13's takes rows)")
    from qerl.kernels.context import GemmContext
    from qerl.kernels.fp8_gemm import FP8Gemm

    torch.manual_seed(seed)
    tensors = fp8_channel.quantize(torch.randn(n, k) * 0.05)
    gemm = FP8Gemm.from_tensors(tensors, dtype=torch.float32, context=GemmContext(tuning="defaults"))
    gemm.scaled_mm = True  # torch._scaled_mm has a CPU kernel: the FP8 products' arithmetic is checked here
    return gemm, tensors


def _rows_e4m3(a: torch.Tensor) -> torch.Tensor:
    """a with each row rounded to E4M3 at scale max|row| / 448 (what fp8_rows hands _scaled_mm), in fp32."""
    s = a.abs().amax(1, keepdim=True).clamp_min(1e-30) / 448
    return (a / s).to(torch.float8_e4m3fn).float() * s


@pytest.mark.parametrize("m", [1, 5, 16, 33])
def test_fp8_forward_is_per_token_activations_times_the_stored_codes(m: int) -> None:
    gemm, tensors = _gemm()
    w = fp8_channel.dequantize(tensors["weight"], tensors["weight_scale"], torch.float32)
    x = torch.randn(m, 64)
    y = gemm.forward(x, backend="fp8_weight")
    assert y.shape == (m, 48)  # rows padded to 16 inside, sliced off
    assert torch.allclose(y, _rows_e4m3(x) @ w.t(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(gemm.forward(x, backend="dequant_cublas"), x @ w.t(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m", [3, 32])
def test_fp8_dx_folds_the_row_scales_into_dy_and_reuses_the_codes(m: int) -> None:
    gemm, tensors = _gemm()
    codes = tensors["weight"].float()
    s = tensors["weight_scale"].reshape(1, -1)
    dy = torch.randn(m, 48)
    dx = gemm.grad_input(dy, backend="fp8_weight")
    assert torch.allclose(dx, _rows_e4m3(dy * s) @ codes, rtol=1e-5, atol=1e-6)  # W's codes unrounded again
    exact = dy @ (codes * s.t())
    assert ((dx - exact).norm() / exact.norm()).item() < 0.04  # dy's own E4M3 rounding only


def test_fp8_base_backends_follow_the_phase() -> None:
    gemm, _ = _gemm()
    ctx = gemm.context
    assert gemm._backends("fwd") == ("fp8_weight", "dequant_cublas") and gemm._backends("bwd") == ("dequant_cublas",)
    with ctx.update_precision("fp8"):
        assert gemm._backends("fwd") == gemm._backends("bwd") == ("fp8_weight",)
        with ctx.held_weights(1 << 20) as held:
            dy = torch.randn(4, 48)
            first = gemm.grad_input(dy)
            assert held() == 48 * 64  # Wᵀ's codes, one byte each, kept for the next micro-batch
            assert torch.equal(gemm.grad_input(dy), first)
    with ctx.update_precision("bf16"):
        assert gemm._backends("fwd") == gemm._backends("bwd") == ("dequant_cublas",)
    assert gemm.backend_for("fwd", torch.randn(2, 64)) == "fp8_weight"  # the default before any measurement
    gemm.scaled_mm = False  # a GPU without FP8 tensor cores, or a shape _scaled_mm cannot take
    assert gemm._backends("fwd") == ("dequant_cublas",)


# -------------------------------------------------------------------------------------------------- on CUDA


def _cuda_layer(n: int, k: int, seed: int = 0) -> QuantLinear:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=True, device="cuda", dtype=torch.bfloat16)
    return QuantLinear.from_linear(linear, "fp8")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("m", [1, 8, 17, 64, 512])
def test_gpu_fp8_layer_forward_matches_its_dequantized_weight(m: int) -> None:
    from qerl.kernels.fp8_gemm import fp8_supported

    layer = _cuda_layer(1024, 512)
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    w = layer.dequantized_weight(torch.float32)
    ref = x.float() @ w.t() + layer.bias.float()
    y = layer(x)
    assert layer._gemm is not None and layer._gemm.layout == "fp8" and layer.weight is not None  # one copy: ours
    assert layer.fp8_activations() == fp8_supported(x.device)  # named to grpo.correction: auto (reduced_precision)
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert rel < (0.04 if fp8_supported(x.device) else 0.01)  # per-token E4M3 activations where FP8 runs
    for backend in layer._gemm._backends("fwd"):
        yb = layer._gemm.forward(x, backend=backend, bias=layer.bias)
        assert ((yb.float() - ref).norm() / ref.norm()).item() < (0.04 if backend == "fp8_weight" else 0.01), backend


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("m", [5, 1279])
def test_gpu_fp8_update_gradients_through_the_frozen_base(m: int) -> None:
    from qerl.kernels.fp8_gemm import fp8_supported

    if not fp8_supported(torch.device("cuda")):
        pytest.skip("needs FP8 tensor cores (sm_89+)")
    from qerl.kernels.context import GemmContext

    layer = _cuda_layer(1536, 576)
    layer.set_gemm_context(GemmContext(tuning="defaults"))
    w = layer.dequantized_weight(torch.float32)
    x = torch.randn(m, 576, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, 1536, device="cuda", dtype=torch.bfloat16)
    for precision, tol in (("fp8", 0.05), ("bf16", 0.01)):
        x.grad = None
        with layer.gemm_context.update_precision(precision):
            layer(x).backward(dy)
        ref = dy.float() @ w
        assert ((x.grad.float() - ref).norm() / ref.norm()).item() < tol, precision


@pytest.mark.gpu
@cuda
def test_gpu_fp8_layer_replays_in_a_cuda_graph() -> None:
    layer = _cuda_layer(512, 256)
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    eager = layer(x)  # warm-up: the dispatch measures outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, layer(x)) and not torch.equal(out, eager)
