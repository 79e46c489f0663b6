"""A model's execution plan: what the params say about how it runs, made live on that model alone.

The one home of every speed switch: what changes how fast (or in how much memory) the model runs, not what it
computes beyond kernels' rounding. `ExecutionPlan.from_settings` reads them from the params (`model:`, `quant:` and
`rollout:` keys, the `execution:` section) and the debugging switches of `qerl.debug`; whoever runs the model (the
base's preparation, the rollout engine and its KV cache, the update, its log-probs) reads them from the plan
attached to it (`execution_of(model).plan`), not from the settings (an engine's keyword argument, for tests and
measurements, still wins: its use_graphs and fused are no params keys at all). Two homes are left to fold in (issue
61), each behind files another change owns: `fused_ops._pdl` still reads `qerl.debug.pdl()` at each launch, where
the callers (qerl.execution.decode, attention, fusion, low_rank and qerl.rollout.sampling) should pass this plan's
`pdl`; and the projection groups of `qerl.execution.fusion` live in the blocks' `__dict__`s (read by
qerl.model.transformer), on CUDA only, where they should be submodules or a table of this plan. Speculative decoding
(rollout.speculative*) stays the sampler's option (`qerl.rollout.factory.engine_options`): a sampling method with
state of its own (the draft history checkpoints keep), which the reference sampler takes too. `attach(model, plan)`
hands the model's frozen layers one `qerl.kernels.context.GemmContext` (their GEMM settings, the update's precision,
held weights, scratch) and its blocks one `TrainingOps`. Two models in one process each have their own: nothing here
is a module global. `update_precision(model, p)` and `held_weights(model, budget)` open the update's phases on one
model's context.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from qerl import debug
from qerl.config import ExecutionSettings, ModelSettings, QuantSettings, RolloutSettings
from qerl.execution.low_rank import GROUP_ATTR
from qerl.execution.training_ops import TrainingOps
from qerl.quant.linear import QuantLinear, fp8_available

ATTRIBUTE = "execution"  # where a model keeps its live plan


@dataclass(frozen=True)
class ExecutionPlan:
    """How one model runs (qerl/config.py documents each params key; the defaults are the params' defaults)."""

    # The blocks' kernels and the GEMMs of the frozen base
    training_kernels: str = "eager"  # model.training_kernels, "eager" off CUDA
    lora_epilogue: bool = False  # execution.lora_epilogue
    gemm_tuning: str = "measure"  # execution.gemm_tuning; "compile": qerl.rl.precompile's workers
    nvfp4_autotune: bool = False  # execution.nvfp4_autotune
    # The frozen base as it is prepared (qerl.model.runtime.prepare_base)
    fuse_projections: bool = False  # q/k/v and gate/up as one GEMM each (qerl.execution.fusion): on CUDA
    gpu_layout: str = "auto"  # quant.gpu_layout: which NVFP4 decode GEMM holds each weight on a CUDA GPU
    fp8_weights: bool | str = "auto"  # quant.fp8_weights: resident FP8 copies of the NVFP4 weights on the GPU
    fp8_activations: bool = False  # quant.fp8_activations: true allows W8A8 forwards outside the update
    # The rollout engine's KV cache (qerl.rollout.engine, and the trainer's rollout)
    kv_cache_dtype: str = "model"  # rollout.kv_cache_dtype: the model's dtype, or fp8 (qerl.execution.kv8)
    release_kv_cache: bool = True  # rollout.release_kv_cache: its GPU memory handed to the update between rollouts
    # The update (qerl.rl.update, qerl.rl.logprobs)
    base_gemm: str = "bf16"  # model.base_gemm: the frozen base's GEMMs in the update, bf16 or fp8
    gradient_checkpointing: bool | str = "auto"  # model.gradient_checkpointing: blocks recomputed in backward
    keep_dequantized: bool | str = "auto"  # model.keep_dequantized: dequantized base weights held through it
    share_prompts: bool = True  # model.share_prompts: a micro-batch's distinct prompts through the blocks once
    pack_completions: bool = False  # model.pack_completions: only the real tokens through the GEMMs and the head
    skip_idle_rows: bool = True  # model.skip_idle_rows: rows without a gradient run without autograd
    # qerl.debug's switches (A/B measurements) and the GEMM dispatch's cache
    gemm_cache: str | None = None  # the dispatch's cache file (None: ~/.cache/qerl/gemm_dispatch.json)
    pdl: bool = True  # programmatic dependent launch of the GPU kernels that take it
    vocab_kernel: bool = True  # the update's LM head in kernels/vocab_softmax.py where the fused kernels run

    @property
    def fp8_copies(self) -> bool | str:
        """quant.fp8_weights as planned: auto is off without W8A8 forwards outside the update (the copies serve
        nothing else but the FP8 update); true stays true."""
        if self.fp8_weights == "auto" and not self.fp8_activations and self.base_gemm != "fp8":
            return False
        return self.fp8_weights

    @classmethod
    def from_settings(cls, model: ModelSettings, execution: ExecutionSettings, device: torch.device,
                      quant: QuantSettings | None = None, rollout: RolloutSettings | None = None,
                      **overrides) -> "ExecutionPlan":
        """The plan of a run's settings on `device` (the CPU always runs the eager ops and keeps its projections
        apart: its numbers stay the measured ones); `quant`, `rollout` None: their defaults; `overrides` set
        fields."""
        quant, rollout = quant or QuantSettings(), rollout or RolloutSettings()
        cuda = device.type == "cuda"
        plan = cls(training_kernels=model.training_kernels if cuda else "eager",
                   lora_epilogue=execution.lora_epilogue, gemm_tuning=execution.gemm_tuning,
                   nvfp4_autotune=execution.nvfp4_autotune, fuse_projections=cuda, gpu_layout=quant.gpu_layout,
                   fp8_weights=quant.fp8_weights, fp8_activations=quant.fp8_activations,
                   kv_cache_dtype=rollout.kv_cache_dtype,
                   release_kv_cache=rollout.release_kv_cache, base_gemm=model.base_gemm,
                   gradient_checkpointing=model.gradient_checkpointing, keep_dequantized=model.keep_dequantized,
                   share_prompts=model.share_prompts, pack_completions=model.pack_completions,
                   skip_idle_rows=model.skip_idle_rows, gemm_cache=debug.gemm_cache(), pdl=debug.pdl(),
                   vocab_kernel=debug.vocab_kernel())
        return dataclasses.replace(plan, **overrides)


class Execution:
    """A plan made live on one model: the GEMM context its frozen layers share and the ops its blocks call."""

    def __init__(self, plan: ExecutionPlan):
        from qerl.kernels.context import GemmContext  # no Triton: kernels/context.py imports none

        self.plan = plan
        self.gemm = GemmContext(lora_epilogue=plan.lora_epilogue, tuning=plan.gemm_tuning, cache=plan.gemm_cache,
                                autotune=plan.nvfp4_autotune, pdl=plan.pdl, fp8_activations=plan.fp8_activations)
        self.ops = TrainingOps(plan.training_kernels, plan.vocab_kernel)

    def __repr__(self) -> str:
        return f"Execution({self.plan})"


def attach(model: nn.Module, plan: ExecutionPlan | None = None) -> Execution:
    """Make `plan` (None: the defaults) live on `model` (replacing any plan before it) and return it: every frozen
    linear (QuantLinear, and the nn.Linear the FP8 update may run) gets its GEMM context, every block module that
    calls the training ops (an `ops` attribute: RMSNorm, Attention, MLP) its ops; the fused layer of each projection
    group too (`qerl.execution.fusion`: not a submodule). Layers built later (a fused projection, LoRA's wrapper, a
    quantized layer in place of a linear) take their members', base's or predecessor's."""
    live = Execution(plan or ExecutionPlan())
    for m in model.modules():
        group = m.__dict__.get(GROUP_ATTR)
        for layer in (m, getattr(group, "fused", None)):
            if isinstance(layer, QuantLinear):
                layer.set_gemm_context(live.gemm)
            elif type(layer) is nn.Linear:
                layer.gemm_context = live.gemm
        if "ops" in m.__dict__:
            m.ops = live.ops
    model.__dict__[ATTRIBUTE] = live  # a plain attribute: not a submodule, not in the state dict
    return live


def execution_of(model: nn.Module) -> Execution:
    """`model`'s live plan: the one `attach` gave it, else the defaults, attached now."""
    live = model.__dict__.get(ATTRIBUTE)
    return live if live is not None else attach(model)


def update_precision(model: nn.Module, precision: str) -> contextlib.AbstractContextManager:
    """A block whose frozen-base GEMMs at training sizes run in `precision` (model.base_gemm: bf16 or fp8), on
    `model` alone. fp8 applies on a CUDA GPU with FP8 tensor cores (compute capability 8.9 or more) to NVFP4 layers
    (kernels/gemm.py) and to frozen bf16 linears (`qerl.quant.fp8`); elsewhere the block runs as bf16, said once."""
    gemm = execution_of(model).gemm
    if precision == "fp8" and not fp8_available():
        warnings.warn(f"model.base_gemm = {precision} needs a CUDA GPU with FP8 tensor cores (Ada, Hopper or "
                      "newer); the update runs bf16 here", stacklevel=2)
        precision = "bf16"
    return gemm.update_precision(precision)  # bf16 too: inside the update no GEMM reads a resident FP8 copy


def held_weights(model: nn.Module, budget_bytes: int) -> contextlib.AbstractContextManager:
    """A block in which `model`'s frozen GPU layers keep their dequantized (bf16 or FP8) weight copies after first
    use, up to `budget_bytes` (NVFP4 layers on the GPU kernels' path and the FP8 update's bf16 linears). Yields a
    function giving the bytes held."""
    if budget_bytes <= 0:
        return contextlib.nullcontext(lambda: 0)
    return execution_of(model).gemm.held_weights(budget_bytes)
