"""Which sampler a run uses: `make_backend(model, tokenizer, rollout.backend)`.

Kept apart from the backends it builds so that a backend of its own module (`vllm_backend`, which subclasses
`backends.RolloutBackend`) is imported only when chosen and no two modules import each other.
"""
from __future__ import annotations

from typing import Any, Literal

from torch import nn

from qerl.rollout.backends import EngineBackend, ReferenceBackend, RolloutBackend

__all__ = ["BACKENDS", "make_backend"]

BACKENDS = ("auto", "engine", "reference", "vllm")


def make_backend(model: nn.Module, tokenizer: Any, kind: Literal["auto", "engine", "reference", "vllm"] = "auto",
                 vllm: dict[str, Any] | None = None, **engine_kwargs) -> RolloutBackend:
    """The rollout backend `kind` for `model`: "engine", "reference", "vllm" (built from `vllm`, the keyword arguments
    of `VLLMOptions`: `qerl.model.served.vllm_options`), or "auto" (the engine on CUDA, the reference elsewhere; see
    the module docstring). `engine_kwargs` go to the `RolloutEngine` when this call creates it."""
    if kind not in BACKENDS:
        raise ValueError(f"unknown rollout backend {kind!r}; choose one of {', '.join(BACKENDS)}")
    if kind == "vllm":
        from qerl.rollout.vllm_backend import VLLMBackend, VLLMOptions, require_vllm

        require_vllm()  # one line naming the extra, before the options (which may quantize a folder) are used
        if vllm is None:
            raise ValueError("rollout backend vllm needs its options (qerl.model.served.vllm_options)")
        return VLLMBackend(model, tokenizer, VLLMOptions(**vllm))
    if kind == "auto":
        kind = "engine" if next(model.parameters()).device.type == "cuda" else "reference"
    return EngineBackend(model, tokenizer, **engine_kwargs) if kind == "engine" else ReferenceBackend(model, tokenizer)
