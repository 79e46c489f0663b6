"""The benchmarks' random-weight models (benchmarks/bench_rollout.py `build_model`, which bench_grpo_step.py trains):
an arm's quant settings that act when the base is made reach it, or the arm fails in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench_rollout():
    sys.path.insert(0, str(BENCHMARKS))  # bench_rollout imports its sibling `lengths`
    try:
        import bench_rollout
        yield bench_rollout
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_the_remedies_reach_the_benchmark_model_as_train_applies_them(bench_rollout):
    model = bench_rollout.build_model("tiny", "nvfp4", device="cpu", fuse=False, correction_rank=2,
                                      layer_schemes={"*.down_proj": "fp8", "model.layers.0.self_attn.v_proj": "bf16"})
    bases = {name.removesuffix(".base"): m for name, m in model.named_modules() if name.endswith("_proj.base")}
    assert bases and all(getattr(m, "scheme", "bf16") == ("fp8" if n.endswith("down_proj") else
                                                           "bf16" if n == "model.layers.0.self_attn.v_proj" else
                                                           "nvfp4") for n, m in bases.items())
    assert {getattr(m, "correction_rank", 0) for n, m in bases.items() if hasattr(m, "scheme")} == {2}


def test_a_remedy_glob_that_matches_nothing_stops_the_arm(bench_rollout):
    with pytest.raises(ValueError, match=r"\['\*\.dwn_proj'\] match no decoder linear"):
        bench_rollout.build_model("tiny", "nvfp4", device="cpu", fuse=False, layer_schemes={"*.dwn_proj": "fp8"})


def test_the_base_follows_quant_fp8_activations_unless_the_scheme_names_it(bench_rollout, monkeypatch):
    seen = []
    monkeypatch.setattr(bench_rollout, "attach", lambda model, plan: seen.append(plan.fp8_activations))
    for scheme in ("fp8", "fp8-w8a8", "fp8-bf16-act"):
        bench_rollout.build_model("tiny", scheme, device="cpu", fuse=False, lora_rank=0)
    from qerl.config import QuantSettings

    assert seen == [QuantSettings.fp8_activations, True, False] and QuantSettings.fp8_activations is False
