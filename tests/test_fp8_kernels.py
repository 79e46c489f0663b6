"""kernels/fp8_w8a16.py, the FP8 base's decode GEMM (E4M3 codes widened in registers, 16-bit activations): under
Triton's CPU interpreter here (fp16: its bf16 dots are unreliable), on the GPU below; and FP8Gemm's dispatch of it."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from qerl.quant import fp8_channel

CUDA = torch.cuda.is_available()
# Never set TRITON_INTERPRET here: set at import it stays for every later test file of this worker, whose CPU
# sampling then runs the fused kernels under the interpreter (other draws: test_trainer's seeded runs changed).
# The interpreter tests run in a fresh process below (test_interpreter_tests_in_a_subprocess).
triton = pytest.importorskip("triton")
from qerl.kernels import fp8_w8a16  # noqa: E402
from qerl.kernels import nvfp4 as K  # noqa: E402
from qerl.kernels.context import GemmContext  # noqa: E402
from qerl.kernels.fp8_gemm import FP8Gemm  # noqa: E402
from tests.patience import patience  # noqa: E402

gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
interpreted = pytest.mark.skipif(CUDA, reason="the GPU test covers the kernel on CUDA")


def _weight(n: int, k: int, seed: int = 0, device: str = "cpu"):
    torch.manual_seed(seed)
    t = fp8_channel.quantize(torch.randn(n, k, device=device) * 0.05)
    return t["weight"], t["weight_scale"].reshape(-1), t["weight"].float() * t["weight_scale"]


@interpreted
@pytest.mark.parametrize(("m", "n", "k", "split"), [(1, 64, 256, 1), (5, 96, 384, 2), (17, 128, 512, None),
                                                    (3, 80, 200, 1)])
def test_w8a16_is_x_times_the_dequantized_weight_under_the_interpreter(m, n, k, split):
    if not K.interpreting():
        pytest.skip("triton was imported before TRITON_INTERPRET could be set")
    w8, scale, w = _weight(n, k)
    x = torch.randn(m, k).half()
    y = fp8_w8a16.linear_forward(x, w8, scale, split_k=split)
    assert y.shape == (m, n) and y.dtype == torch.float16
    ref = x.float() @ w.t()
    assert torch.allclose(y.float(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())  # fp16's output rounding


@interpreted
@pytest.mark.parametrize(("m", "n", "k"), [(40, 256, 192), (130, 128, 128)])
def test_the_wide_tile_is_x_times_the_dequantized_weight_under_the_interpreter(m, n, k):
    if not K.interpreting():
        pytest.skip("triton was imported before TRITON_INTERPRET could be set")
    w8, scale, w = _weight(n, k, seed=1)
    x = torch.randn(m, k).half()
    y = fp8_w8a16.tiled_forward("triton_wide", x, w8, scale)  # 130 rows: two row tiles of 128
    ref = x.float() @ w.t()
    assert y.shape == (m, n) and torch.allclose(y.float(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())


@interpreted
@pytest.mark.parametrize(("n", "k"), [(12, 200), (7, 64), (64, 2048)])
def test_dequantize_in_one_pass_is_the_torch_expression_bit_for_bit_under_the_interpreter(n, k):
    """The "dequant_cublas" backend's weight: the product in fp32, rounded once (rows per program: 4, 1, 8). In
    fp16: the interpreter's bf16 rounding is not the GPU's (the GPU test checks bf16)."""
    if not K.interpreting():
        pytest.skip("triton was imported before TRITON_INTERPRET could be set")
    w8, scale, _ = _weight(n, k, seed=2)
    out = fp8_w8a16.dequantize(w8, scale, torch.empty(n, k, dtype=torch.float16))
    assert torch.equal(out, (w8.float() * scale[:, None]).half())


def test_each_tile_is_offered_only_at_the_rows_it_is_for():
    assert fp8_w8a16.tiles_for(1) == fp8_w8a16.tiles_for(16) == ("triton",)
    assert fp8_w8a16.tiles_for(17) == fp8_w8a16.tiles_for(64) == ("triton", "triton_wide")
    assert fp8_w8a16.tiles_for(65) == fp8_w8a16.tiles_for(512) == ("triton_wide",)
    assert fp8_w8a16.tiles_for(513) == ()  # a prefill: FP8 tensor cores or dequantize + cuBLAS


@interpreted
def test_fp8_gemm_runs_it_as_triton_and_offers_it_only_at_decode_sizes_on_cuda():
    if not K.interpreting():
        pytest.skip("triton was imported before TRITON_INTERPRET could be set")
    w8, scale, w = _weight(64, 128)
    gemm = FP8Gemm(w8, scale[:, None], dtype=torch.float16, context=GemmContext(tuning="defaults"))
    x = torch.randn(4, 128).half()
    assert torch.allclose(gemm.forward(x, backend="triton").float(), x.float() @ w.t(), rtol=2e-3, atol=1e-3)
    assert not gemm.w8a16 and "triton" not in gemm._backends("fwd")  # a CPU weight (or a GPU before sm_89)
    gemm.w8a16 = True  # as on a GPU with FP8 (nothing runs below: only which backends are offered)
    assert gemm._backends("fwd")[:2] == ("triton", "triton_wide") and "triton" not in gemm._backends("bwd")
    with gemm.context.update_precision("bf16"):
        assert "triton" not in gemm._backends("fwd")  # training sizes: not the update's GEMM
    timed = {}

    def record(kind, layout, n, k, m, candidates):
        timed[m] = set(candidates)
        return next(iter(candidates))

    gemm.context.dispatcher.choose = record
    for m in (8, 40, 200, 1024):
        gemm.backend_for("fwd", torch.randn(m, 128).half())
    assert timed[8] == {"triton", "dequant_cublas"} and timed[40] == {"triton", "triton_wide", "dequant_cublas"}
    assert timed[200] == {"triton_wide", "dequant_cublas"} and timed[1024] == {"dequant_cublas"}


def test_without_fp8_activations_rollout_forwards_keep_bf16_activations():
    """quant.fp8_activations: false: outside the update no forward is offered W8A8 (`_scaled_mm` rounds the
    activations to E4M3, so rollouts would sample another policy than the update trains); the FP8 update keeps it.
    The flag reaches the GEMM context from the params through the execution plan."""
    from qerl.config import ExecutionSettings, ModelSettings, QuantSettings
    from qerl.execution.plan import Execution, ExecutionPlan

    w8, scale, _ = _weight(64, 128)
    for fp8_activations in (True, False):
        plan = ExecutionPlan.from_settings(ModelSettings(), ExecutionSettings(), torch.device("cpu"),
                                           QuantSettings(fp8_activations=fp8_activations))
        context = Execution(plan).gemm
        assert context.fp8_activations is fp8_activations
        gemm = FP8Gemm(w8, scale[:, None], context=context)
        gemm.scaled_mm = gemm.w8a16 = True  # as on a GPU with FP8 tensor cores (only the offer is checked)
        assert ("fp8_weight" in gemm._backends("fwd")) is fp8_activations
        assert "triton" in gemm._backends("fwd") and "triton_wide" in gemm._backends("fwd")  # W8A16 either way
        with context.update_precision("fp8"):  # the FP8 update's precision alone decides inside it
            assert gemm._backends("fwd") == ("fp8_weight",)
        assert plan.fp8_copies == ("auto" if fp8_activations else False)  # NVFP4's copies serve W8A8 only
    assert ExecutionPlan(fp8_activations=False, base_gemm="fp8").fp8_copies == "auto"  # the FP8 update reads them
    assert ExecutionPlan(fp8_activations=False, fp8_weights=True).fp8_copies is True  # asked for: kept


def test_split_k_fills_the_gpu_only_where_the_rows_alone_cannot():
    assert fp8_w8a16.split_for(37888, 3584, 64, 128, 132) == 1  # 7B gate_up: 592 programs already
    assert fp8_w8a16.split_for(3584, 18944, 64, 128, 132) == 8  # 7B down_proj: 56 programs, a long K
    assert fp8_w8a16.split_for(512, 256, 64, 128, 132) == 1  # too little K to split


def test_interpreter_tests_in_a_subprocess():
    """The interpreter tests above, in a fresh process when this one imported triton before TRITON_INTERPRET could
    be set (full-suite runs), as test_gemm_backends does: otherwise they would only ever skip."""
    if CUDA or K.interpreting():
        pytest.skip("the interpreter tests run in-process (or the GPU tests cover the kernels)")
    import subprocess

    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "interpreter and not subprocess or offers_it"], capture_output=True, text=True,
                       timeout=patience(600), env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    assert "10 passed" in last and "skipped" not in last, r.stdout[-2000:]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 8, 16, 33, 64])
@pytest.mark.parametrize(("n", "k"), [(1536, 576), (576, 1536), (4096, 4096)])
def test_gpu_w8a16_matches_the_dequantized_weight_in_bf16(m, n, k):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton converts E4M3 on sm_89+ only")
    w8, scale, w = _weight(n, k, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = fp8_w8a16.linear_forward(x, w8, scale)
    ref = x.float() @ w.t()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert y.dtype == torch.bfloat16 and rel < 5e-3, rel  # bf16 output rounding only: no activation rounding
    gemm = FP8Gemm(w8, scale[:, None])
    assert ("triton" in gemm._backends("fwd")) == gemm.w8a16
    if not gemm.w8a16:
        return  # Triton's E4M3 needs sm_89+: the dispatch never offers it here
    again = gemm.forward(x, backend="triton").float()  # split-K adds in atomics: equal to fp32 rounding, not bits
    assert ((again - y.float()).norm() / y.float().norm()).item() < 1e-2


@pytest.mark.gpu
@gpu
def test_gpu_dequantize_is_the_torch_expression_bit_for_bit_in_bf16():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton converts E4M3 on sm_89+ only")
    w8, scale, _ = _weight(4608, 3584, device="cuda")
    gemm = FP8Gemm(w8, scale[:, None])
    assert torch.equal(gemm.dequantize(torch.bfloat16), (w8.float() * scale[:, None]).bfloat16())
