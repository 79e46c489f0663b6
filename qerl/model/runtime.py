"""Turning settings into live objects: device, dtype, seeds, and the policy model (loaded, quantized, with LoRA)."""

from __future__ import annotations

import dataclasses
import logging
import random
import time

import numpy as np
import torch

from qerl.config import ExecutionSettings, ModelSettings, QuantSettings, RolloutSettings, Settings
from qerl.execution import ExecutionPlan, attach

log = logging.getLogger(__name__)


def resolve_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device = 'cuda' but no CUDA device is visible")
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    if setting == "auto":
        # bf16 matmuls are slow on most CPUs and fp32 keeps CPU runs exact; GPUs want bf16.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, setting)


def pin_cpu_threads(model: ModelSettings) -> ModelSettings:
    """Run torch's CPU ops on `model.cpu_threads` threads (unset: keep torch's count); returns the settings with the
    count in use filled in, for the run to record: CPU results depend on it."""
    if model.cpu_threads is not None:
        torch.set_num_threads(model.cpu_threads)
    return dataclasses.replace(model, cpu_threads=torch.get_num_threads())


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_base_model(model: ModelSettings, quant: QuantSettings, execution: ExecutionSettings = ExecutionSettings(),
                    rollout: RolloutSettings | None = None):
    """The frozen base: a pre-quantized folder if given, else the source checkpoint quantized in memory, running as
    the settings' execution plan says (`qerl.execution.ExecutionPlan.from_settings`)."""
    from qerl.model.loading import load_model, resolve_model
    from qerl.quant import bnb

    if quant.scheme == bnb.SCHEME:
        bnb.require_bitsandbytes()  # before a minutes-long load, not after
    device = resolve_device(model.device)
    dtype = resolve_dtype(model.dtype, device)
    source = resolve_model(quant.quantized_path or model.path)
    start = time.perf_counter()
    net, tokenizer = load_model(source, dtype=dtype, device=device)
    prepare_base(net, model, quant, device, ExecutionPlan.from_settings(model, execution, device, quant, rollout))
    log.info("loaded %s (%s, %s, %s) in %.1fs", source, quant.scheme, dtype, device, time.perf_counter() - start)
    return net, tokenizer


def prepare_base(net, model: ModelSettings, quant: QuantSettings, device: torch.device,
                 plan: ExecutionPlan | None = None) -> None:
    """A loaded network made the run's frozen base, in place: quantized as `quant` says (unless it already is), laid
    out and fused as its execution `plan` says (None: the plan of `model` and `quant` with the default `execution`
    settings; `qerl.execution`), then that plan attached. Also what `qerl.rl.precompile` does to its one-layer
    stand-in, so the stand-in launches the kernels the real base will."""
    from qerl.quant import bnb
    from qerl.quant.linear import QuantLinear, plan_fp8_weights, quantize_model

    plan = plan or ExecutionPlan.from_settings(model, ExecutionSettings(), device, quant)

    already_quantized = any(isinstance(m, QuantLinear) for m in net.modules())
    if quant.scheme == bnb.SCHEME:  # QLoRA's base: bitsandbytes' own NF4 storage and kernels, quantized at load
        bnb.quantize_model_bnb(net)
    elif quant.scheme != "bf16" and not already_quantized:
        quantize_model(net, quant.scheme, layer_schemes=quant.layer_schemes,
                       correction_rank=quant.error_correction_rank)
    net.requires_grad_(False)
    for m in net.modules():
        if isinstance(m, QuantLinear):
            m.gpu_layout = plan.gpu_layout  # fused projections (next) inherit it
    if device.type == "cuda":
        plan_fp8_weights(net, plan.fp8_copies, device)  # before fusing: fused projections inherit the mark
    if plan.fuse_projections:  # on CUDA (CPU runs keep their exact, measured numbers)
        net.fuse_projections()  # q/k/v and gate/up as one GEMM each
    # auto is planned per update by the trainer (qerl.model.recompute); until then nothing recomputes.
    net.gradient_checkpointing = plan.gradient_checkpointing if isinstance(plan.gradient_checkpointing, bool) \
        else False
    attach(net, plan)


def load_tokenizer_and_context(model: ModelSettings, quant: QuantSettings):
    """The base's tokenizer and context length, read without its weights: enough to check prompts before the load."""
    from qerl.model.loading import context_length, load_tokenizer, resolve_model
    from qerl.quant import bnb

    if quant.scheme == bnb.SCHEME:
        bnb.require_bitsandbytes()  # a missing package is the first thing to fix, before any path
    source = resolve_model(quant.quantized_path or model.path)
    return load_tokenizer(source), context_length(source)


def check_module_names(settings: Settings) -> None:
    """The module names the settings give (`lora.target_modules`, the globs of `quant.layer_schemes`) against the
    base's modules, from its config alone: a name that matches nothing fails in a second, not after the weights have
    loaded (a GGUF base is checked when LoRA is applied and the base quantized)."""
    from qerl.model import lora
    from qerl.model.loading import model_skeleton
    from qerl.quant.linear import decoder_linear_names, schemes_by_layer

    skeleton = model_skeleton(settings.quant.quantized_path or settings.model.path)
    if skeleton is None:
        return
    try:
        lora.target_layers(skeleton, settings.lora.target_modules)
    except ValueError as e:
        raise ValueError(f"lora.target_modules: {e}") from None
    if settings.quant.layer_schemes:
        try:
            schemes_by_layer(decoder_linear_names(skeleton), settings.quant.scheme, settings.quant.layer_schemes)
        except ValueError as e:
            raise ValueError(f"quant.{e}") from None


def check_adapter_base(adapter: str, quant: QuantSettings) -> None:
    """An adapter that records the base it trained on (quantized at load: per-layer schemes, error correction) gets
    that base or a one-line refusal: on another one it is another policy."""
    from qerl.model import lora

    trained = lora.read_base_record(adapter)
    if trained is not None and trained != quant.base_record():
        raise ValueError(f"{adapter} was trained on the base quant.scheme = {trained['scheme']!r}, layer_schemes = "
                         f"{dict(trained['layer_schemes'])}, error_correction_rank = "
                         f"{trained['error_correction_rank']} ({lora.BASE_RECORD}); set those (-S quant.KEY=VALUE) to "
                         "evaluate it")


def load_policy(settings: Settings, adapter: str | None = None):
    """The base model, plus the adapter in `adapter` (a PEFT folder) if given; without one, the bare base model."""
    from qerl.model import lora

    if adapter:
        lora.read_adapter_config(adapter)  # a wrong adapter fails now, not after the model load
        check_adapter_base(adapter, settings.quant)
    net, tokenizer = load_base_model(settings.model, settings.quant, settings.execution, settings.rollout)
    if adapter:
        lora.load_adapter(net, adapter)
    return net, tokenizer
