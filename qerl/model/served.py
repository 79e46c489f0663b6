"""The run's frozen base as a folder another engine loads (`rollout.backend: vllm`), and that engine's settings.

vLLM reads Hugging Face folders: the dense source for a bf16 base, or the compressed-tensors folder `qerl quantize`
writes for NVFP4/MXFP4/FP8 (bit for bit the base the trainer quantizes in memory, qerl.quant.checkpoint; vLLM runs
FP8's FP8_DYNAMIC layout as W8A8 with per-token activation scales, as kernels/fp8_gemm.py does). A run that
quantizes in memory gets that folder written once into the cache (`$QERL_CACHE/served/`) and reused.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from qerl.config import Settings
from qerl.model.loading import cache_dir, resolve_model
from qerl.quant.formats import SERVABLE_SCHEMES

__all__ = ["own_model_settings", "served_base", "vllm_options"]

log = logging.getLogger(__name__)

SERVABLE = SERVABLE_SCHEMES  # the codec registry's: the formats vLLM and transformers read


def served_base(settings: Settings) -> Path:
    """A folder holding the run's frozen base in a format vLLM loads (quantized once into the cache if needed)."""
    from qerl.quant.checkpoint import quantize_checkpoint, scheme_from_config

    scheme = settings.quant.scheme
    if scheme not in SERVABLE:
        raise ValueError(f"rollout.backend: vllm serves quant.scheme {', '.join(SERVABLE)}, not {scheme!r} "
                         "(QLoRA's bitsandbytes base has no vLLM form of the same weights)")
    if settings.quant.quantized_at_load_only:
        raise ValueError("rollout.backend: vllm serves a one-scheme base folder, which cannot hold quant.layer_schemes "
                         "or quant.error_correction_rank: sample with rollout.backend engine")
    source = resolve_model(settings.quant.quantized_path or settings.model.path)
    if not (source / "config.json").is_file():
        raise ValueError(f"rollout.backend: vllm needs a Hugging Face folder; {source} has no config.json (convert a "
                         "GGUF file with qerl quantize --scheme bf16 first)")
    stored = scheme_from_config(json.loads((source / "config.json").read_text()).get("quantization_config"))
    if stored == scheme or (stored is None and scheme == "bf16"):
        return source
    if stored is not None:
        raise ValueError(f"{source} holds a {stored} base but quant.scheme is {scheme}")
    stamp = hashlib.sha256(f"{source.resolve()}:{(source / 'config.json').stat().st_mtime_ns}".encode()).hexdigest()
    target = cache_dir() / "served" / f"{source.name}-{scheme}-{stamp[:12]}"
    if not (target / "config.json").is_file():
        log.info("writing the %s base vLLM loads: %s", scheme, target)
        quantize_checkpoint(source, target, scheme, progress=False)
    return target


def vllm_options(settings: Settings, context: int) -> dict[str, Any]:
    """Keyword arguments of `qerl.rollout.vllm_backend.VLLMOptions` for this run (`context`: the model's length)."""
    r = settings.rollout
    rows = r.prompts_per_step * r.group_size
    return dict(base=served_base(settings), lora=settings.lora, max_model_len=context,
                max_num_seqs=max(rows, settings.eval.batch_size), gpu_memory_utilization=r.vllm_gpu_memory_utilization,
                lora_update=r.vllm_lora_update, sleep_level=1 if r.release_kv_cache else 0, seed=settings.train.seed,
                kv_cache_dtype=r.kv_cache_dtype)


def own_model_settings(settings: Settings) -> Settings:
    """The settings qerl's own model loads with. Where vLLM samples (`rollout.backend: vllm`), `quant.fp8_weights:
    auto` is off unless the update is FP8 (`model.base_gemm: fp8`): the resident FP8 copies serve our engine's
    many-row forwards and the FP8 update's, nothing else, and would hold a byte per weight beside vLLM's own
    copy of the base (6.1 GiB at 7B). An explicit true is kept."""
    if settings.rollout.backend != "vllm" or settings.quant.fp8_weights != "auto" or settings.model.base_gemm == "fp8":
        return settings
    log.info("quant.fp8_weights auto: off, since vLLM samples (rollout.backend: vllm) and the update is bf16")
    return replace(settings, quant=replace(settings.quant, fp8_weights=False))
