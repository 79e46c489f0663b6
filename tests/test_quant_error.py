"""qerl's NVFP4 codec against the format's reference rounding (benchmarks/nvfp4_reference.py, float64, written from the
definition) on a random and a real SmolLM2 weight: what docs/quant_error/summary.md reports, held as a test.

fp32 weights: the same codes and scales except at exact rounding ties, where qerl (like compressed-tensors) rounds
an fp32 intermediate first. bf16 weights: qerl follows compressed-tensors' arithmetic in bf16 (the global scale
448*6/amax and amax/6 are rounded to bf16), so ~1-5% of block scales move one E4M3 step; the reconstruction error
stays that of the reference within 0.5%.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from qerl.quant import nvfp4

ROOT = Path(__file__).resolve().parent.parent


def _reference():
    spec = importlib.util.spec_from_file_location("nvfp4_reference", ROOT / "benchmarks" / "nvfp4_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["nvfp4_reference"] = module
    spec.loader.exec_module(module)
    return module


reference = _reference()


@pytest.fixture(scope="module")
def real_weight(smollm2_dir) -> torch.Tensor:
    """One real projection of the embedded model (read alone from the safetensors: no model load)."""
    from safetensors import safe_open

    with safe_open(str(Path(smollm2_dir) / "model.safetensors"), "pt") as f:
        return f.get_tensor("model.layers.15.mlp.down_proj.weight").float()


def random_weight() -> torch.Tensor:
    return torch.randn(192, 512, generator=torch.Generator().manual_seed(0)) * 0.02


def relative_error(w: torch.Tensor, wq: torch.Tensor) -> float:
    return float((wq.double() - w.double()).norm() / w.double().norm())


def ours_and_reference(w: torch.Tensor):
    q = nvfp4.quantize(w)
    r = reference.quantize(w)
    ours = nvfp4.dequantize(q["weight_packed"], q["weight_scale"], q["weight_global_scale"], torch.float64)
    return q, r, ours, reference.dequantize(r)


def test_reference_rounds_every_e2m1_tie_to_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, -0.74, 0.2501], dtype=torch.float64)
    assert reference.E2M1_GRID[reference.round_to_e2m1_index(x)].tolist() == [0, 1, 1, 2, 2, 4, 4, 6, 6, 0.5, 0.5]


@pytest.mark.parametrize("kind", ["random", "real"])
def test_fp32_weight_matches_the_reference_except_at_ties(kind, request):
    w = random_weight() if kind == "random" else request.getfixturevalue("real_weight")
    q, r, ours, ref = ours_and_reference(w)
    codes = nvfp4.unpack_e2m1(q["weight_packed"])
    assert float((nvfp4.e2m1_decode(codes) != nvfp4.e2m1_decode(r["codes"])).double().mean()) < 1e-3
    scales_differ = q["weight_scale"].view(torch.uint8) != r["scale"].view(torch.uint8)
    assert float(scales_differ.double().mean()) < 1e-3
    # a differing scale is the neighbouring E4M3 value (a tie broken in fp32), never a different range
    step = (q["weight_scale"].view(torch.uint8).int() - r["scale"].view(torch.uint8).int())[scales_differ]
    assert step.abs().max().item() <= 1 if step.numel() else True
    assert relative_error(w, ours) == pytest.approx(relative_error(w, ref), rel=1e-4)


def test_bf16_weight_keeps_compressed_tensors_bf16_scale_arithmetic(real_weight):
    w = real_weight.to(torch.bfloat16)
    q, r, ours, ref = ours_and_reference(w)
    amax = w.abs().amax()  # bf16
    assert q["weight_global_scale"].item() == (448.0 * 6.0 / amax).float().item()  # rounded to bf16, not fp32
    assert q["weight_global_scale"].item() != r["global_scale"].item()
    assert relative_error(w, ours) == pytest.approx(relative_error(w, ref), rel=5e-3)
