"""The execution plan (`qerl.execution`): built from the params, made live on one model, shared with no other."""
from __future__ import annotations

import pytest
import torch

from qerl.config import ConfigError, load_settings
from qerl.execution import ExecutionPlan, attach, execution_of, held_weights, update_precision
from qerl.model.transformer import ModelConfig, Transformer
from qerl.quant.linear import QuantLinear, quantize_model

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96}


def tiny(scheme: str = "bf16") -> Transformer:
    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig.from_hf(TINY)).requires_grad_(False)
    if scheme != "bf16":
        quantize_model(model, scheme)
    return model


def frozen_layers(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, QuantLinear) or type(m) is torch.nn.Linear]


def test_two_models_in_one_process_share_no_mode():
    """Each model's precision phase, held weights and training ops are its own: opening the update on one leaves
    the other as it was, and every frozen layer (the quantized ones, made after the model, too) reads its model's."""
    a, b = tiny("nvfp4"), tiny()
    attach(b, ExecutionPlan(training_kernels="compile"))
    live_a, live_b = execution_of(a), execution_of(b)
    assert live_a.gemm is not live_b.gemm and live_a.ops.backend == "eager" and live_b.ops.backend == "compile"
    assert all(m.gemm_context is live_a.gemm for m in frozen_layers(a))
    assert any(isinstance(m, QuantLinear) for m in frozen_layers(a))
    assert all(m.gemm_context is live_b.gemm for m in frozen_layers(b))
    assert {m.ops for m in b.modules() if "ops" in m.__dict__} == {live_b.ops}
    with update_precision(a, "bf16"), held_weights(a, 1 << 20) as held:
        assert live_a.gemm.precision == "bf16" and live_a.gemm.holding and held() == 0
        assert live_b.gemm.precision is None and not live_b.gemm.holding
        with update_precision(b, "bf16"):
            assert live_b.gemm.precision == "bf16"
        assert live_b.gemm.precision is None
    assert live_a.gemm.precision is None and not live_a.gemm.holding
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(b(ids), tiny()(ids), rtol=0, atol=0)  # on the CPU a plan changes no number


def test_the_plan_is_the_params_and_the_debug_switches(monkeypatch):
    """`execution:` keys, model.training_kernels (eager off CUDA) and qerl.debug's variables make the plan, and the
    plan is what the model's GEMM context holds; a bad value is one line naming the key."""
    s = load_settings(overrides=["execution.lora_epilogue=true", "execution.gemm_tuning=defaults",
                                 "execution.nvfp4_autotune=true", "model.training_kernels=liger"])
    monkeypatch.setenv("QERL_PDL", "0")
    monkeypatch.setenv("QERL_GEMM_CACHE", "/tmp/elsewhere.json")
    plan = ExecutionPlan.from_settings(s.model, s.execution, torch.device("cpu"))
    assert plan == ExecutionPlan(training_kernels="eager", lora_epilogue=True, gemm_tuning="defaults",
                                 nvfp4_autotune=True, gemm_cache="/tmp/elsewhere.json", pdl=False, vocab_kernel=True)
    gemm = attach(tiny(), plan).gemm
    assert gemm.lora_epilogue and gemm.autotune and not gemm.pdl
    assert gemm.dispatcher.tuning == "defaults" and str(gemm.dispatcher.cache) == "/tmp/elsewhere.json"
    defaults = load_settings(overrides=[])  # every params file without the section keeps today's behaviour
    assert ExecutionPlan.from_settings(defaults.model, defaults.execution, torch.device("cpu")).gemm_tuning == "measure"
    with pytest.raises(ConfigError, match="execution.gemm_tuning"):
        load_settings(overrides=["execution.gemm_tuning=sometimes"])


SPEED_SWITCHES = {  # params key -> the plan's field and the value the override gives it
    "model.base_gemm=fp8": ("base_gemm", "fp8"),
    "model.gradient_checkpointing=true": ("gradient_checkpointing", True),
    "model.keep_dequantized=false": ("keep_dequantized", False),
    "model.share_prompts=false": ("share_prompts", False),
    "model.pack_completions=true": ("pack_completions", True),
    "model.skip_idle_rows=false": ("skip_idle_rows", False),
    "quant.gpu_layout=qerl": ("gpu_layout", "qerl"),
    "quant.fp8_weights=false": ("fp8_weights", False),
    "rollout.kv_cache_dtype=fp8": ("kv_cache_dtype", "fp8"),
    "rollout.release_kv_cache=false": ("release_kv_cache", False),
}


def test_every_speed_switch_of_the_params_is_in_the_plan():
    """The `model:`, `quant:` and `rollout:` keys that change how fast the model runs reach the plan, where the
    base's preparation, the engine and the update read them; on CUDA the plan fuses the projections, on the CPU it
    does not."""
    s = load_settings(overrides=list(SPEED_SWITCHES))
    plan = ExecutionPlan.from_settings(s.model, s.execution, torch.device("cpu"), s.quant, s.rollout)
    assert {field: getattr(plan, field) for field, _ in SPEED_SWITCHES.values()} == dict(SPEED_SWITCHES.values())
    defaults = ExecutionPlan.from_settings(*(lambda d: (d.model, d.execution))(load_settings(overrides=[])),
                                           torch.device("cpu"))
    assert all(getattr(defaults, field) != value for field, value in SPEED_SWITCHES.values())
    assert not plan.fuse_projections
    assert ExecutionPlan.from_settings(s.model, s.execution, torch.device("cuda"), s.quant).fuse_projections


def test_the_update_reads_its_switches_from_the_models_plan(tmp_path):
    """A trainer's update takes shared prompts, idle rows and the held-weights budget from the plan it attached to
    the model, which the params made."""
    from qerl.rl.logprobs import PolicyLogProbs
    from qerl.rl.memory import held_weights_budget
    from qerl.model import recompute

    model = tiny()
    s = load_settings(overrides=["model.share_prompts=false", "model.skip_idle_rows=false",
                                 "model.keep_dequantized=true"])
    attach(model, ExecutionPlan.from_settings(s.model, s.execution, torch.device("cpu")))
    logprobs = PolicyLogProbs.from_plan(model, 1.0, lora_dropout=False, beta=0.0)
    assert not logprobs.share_prompts and not logprobs.skip_idle_rows
    assert held_weights_budget(execution_of(model).plan, recompute.MemoryPlan(0, 5)) == 2**62
    attach(model, ExecutionPlan())  # the params' defaults
    logprobs = PolicyLogProbs.from_plan(model, 1.0, lora_dropout=False, beta=0.0)
    assert logprobs.share_prompts and logprobs.skip_idle_rows
    assert held_weights_budget(execution_of(model).plan, recompute.MemoryPlan(0, 5)) == 5


def test_the_engine_takes_its_kv_cache_from_the_models_plan(monkeypatch):
    """rollout.kv_cache_dtype reaches the engine through the model's plan; an engine's own argument still wins."""
    from qerl.rollout.engine import RolloutEngine

    monkeypatch.setattr(RolloutEngine, "_kv8_runs", lambda self: True)  # the FP8 layout's kernels, as on a GPU
    model = tiny()
    assert not RolloutEngine(model).kv8  # the default plan: the model's dtype
    attach(model, ExecutionPlan(kv_cache_dtype="fp8"))
    assert RolloutEngine(model).kv8 and not RolloutEngine(model, kv_cache_dtype="model").kv8


def test_a_plan_attached_after_fusing_reaches_the_fused_projections():
    """`prepare_base` fuses q/k/v and gate/up before it attaches the run's plan: the fused layers (not submodules)
    must read the new plan's GEMM context too, or the FP8 update would miss them."""
    from qerl.execution import fusion

    model = tiny("nvfp4")
    assert model.fuse_projections() > 0
    live = attach(model, ExecutionPlan())
    fused = [g.fused for g in fusion.groups(model)]
    assert fused and all(f.gemm_context is live.gemm for f in fused)
