"""Which sampler a run uses: `make_backend(model, tokenizer, rollout.backend)`.

Kept apart from the backends it builds so that a backend of its own module (`vllm_backend`, which subclasses
`backends.RolloutBackend`) is imported only when chosen and no two modules import each other.
"""
from __future__ import annotations

from typing import Any, Callable, Literal

from torch import nn

from qerl.rollout.backends import EngineBackend, ReferenceBackend, RolloutBackend

__all__ = ["BACKENDS", "make_backend", "engine_options"]

BACKENDS = ("auto", "engine", "reference", "vllm")
# The engine settings the reference takes too: its speculation, and an explicit kv_cache_dtype (a run's comes from the
# model's execution plan), which the reference never runs in FP8 (no fused kernels) but must hear of, so that the
# engine says so in the log as for any other engine that cannot.
REFERENCE_OPTIONS = ("speculative", "speculative_rows", "max_draft", "kv_cache_dtype")


def make_backend(model: nn.Module, tokenizer: Any, kind: Literal["auto", "engine", "reference", "vllm"] = "auto",
                 vllm: Callable[[], dict[str, Any]] | None = None, **engine_kwargs) -> RolloutBackend:
    """The rollout backend `kind` for `model`: "engine", "reference", "vllm" (built from what `vllm()` returns, the
    keyword arguments of `VLLMOptions`: `qerl.model.served.vllm_options`; called only once vLLM imports, since it
    may quantize a folder for it), or "auto" (the engine on CUDA, the reference elsewhere; see the module
    docstring). `engine_kwargs` go to the `RolloutEngine` when this call creates it."""
    if kind not in BACKENDS:
        raise ValueError(f"unknown rollout backend {kind!r}; choose one of {', '.join(BACKENDS)}")
    if kind == "vllm":
        from qerl.rollout.vllm_backend import VLLMBackend, VLLMOptions, require_vllm

        require_vllm()  # one line naming the extra, before the options (which may quantize a folder) are used
        if vllm is None:
            raise ValueError("rollout backend vllm needs its options (qerl.model.served.vllm_options)")
        return VLLMBackend(model, tokenizer, VLLMOptions(**vllm()))
    if kind == "auto":
        kind = "engine" if next(model.parameters()).device.type == "cuda" else "reference"
    if kind == "engine":
        return EngineBackend(model, tokenizer, **engine_kwargs)
    options = {k: v for k, v in engine_kwargs.items() if k in REFERENCE_OPTIONS}  # the reference's own shapes else
    return ReferenceBackend(model, tokenizer, **options)


def engine_options(rollout: Any) -> dict[str, Any]:
    """The engine keyword arguments of a params file's `rollout:` section (a `qerl.config.RolloutSettings`), for
    `make_backend`: the one place training and evaluation read them from. Its speed switch (kv_cache_dtype) is not
    one: the engine reads it from the model's execution plan."""
    return dict(speculative=rollout.speculative, speculative_rows=rollout.speculative_rows,
                max_draft=rollout.speculative_draft)
