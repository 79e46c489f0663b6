"""The rollout seam: one object samples from the policy for the trainer and for evaluation.

As TRL's generation backends (transformers' `generate`, or a colocated vLLM), a backend is built once next to the
model and used by everything that samples from the policy:

    backend = make_backend(model, tokenizer, "auto")
    with backend.sync(sigma, noise_seed):      # before a step: the current LoRA, plus this step's AQN noise
        out = backend.generate(prompts, Sampling(max_new_tokens=256, temperature=1.0, seed=0))

Both backends return a `generate.Rollout` and read the model's own tensors, so syncing LoRA copies nothing (the
optimizer steps the factors in place; the engine re-captures its graphs if a tensor moved), and AQN noise is
written into the RMSNorm weights in place for the block and removed bit-exactly after it.

* `ReferenceBackend`: `qerl.rollout.generate.generate`, the exact oracle (any device, no graphs).
* `EngineBackend`: the model's `RolloutEngine` (static KV cache kept across calls, CUDA graphs, compaction).
  Trainer and evaluation on one model share its engine (`engine_for`), so they share its graphs and cache.
* `qerl.rollout.vllm_backend.VLLMBackend`: a colocated vLLM engine (its own copy of the base, the LoRA handed over
  each step), as TRL's colocate mode; optional.

"auto" takes the engine on CUDA and the reference on the CPU. On the CPU the engine computes the same logits, but
it samples padded power-of-two buckets of rows, so a seed draws other random numbers than the reference does;
CPU runs keep the reference's samples (the README's measured runs, bit-exact resumes).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from qerl.model.aqn import NoiseInjector
from qerl.rollout.generate import Rollout, generate

__all__ = ["Sampling", "RolloutBackend", "ReferenceBackend", "EngineBackend", "make_backend", "BACKENDS"]

BACKENDS = ("auto", "engine", "reference", "vllm")


@dataclass(frozen=True)
class Sampling:
    """How to sample (the keyword arguments of `qerl.rollout.generate.generate`); temperature 0 is greedy."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None  # None: the model config's and the tokenizer's
    seed: int | None = None  # None: the global RNG
    # One seed per prompt, where the backend supports it (the reference: each row its own generator, so a row samples
    # the same tokens in any batch, as data-parallel ranks need); the engine draws one generator per batch from seed.
    row_seeds: tuple[int, ...] | None = None

    def kwargs(self, per_row: bool) -> dict[str, Any]:
        """Keyword arguments of `generate`: with `per_row`, row_seeds (when given) instead of seed."""
        kw = dataclasses.asdict(self)
        row_seeds = kw.pop("row_seeds")
        if per_row and row_seeds is not None:
            kw.update(seed=None, row_seeds=row_seeds)
        return kw


class RolloutBackend:
    """Samples completions from `model`; subclasses say how (`_generate`)."""

    name = ""

    def __init__(self, model: nn.Module, tokenizer: Any):
        self.model, self.tokenizer = model, tokenizer
        self.noise = NoiseInjector(model)  # AQN for rollouts; the trainer's training-forward noise uses it too

    @contextmanager
    def sync(self, sigma: float = 0.0, noise_seed: int = 0) -> Iterator["RolloutBackend"]:
        """Inside the block, sample from the trainer's current policy with AQN noise N(0, sigma^2) in the norm
        weights (one draw per norm from `noise_seed`; sigma 0 adds none), removed on exit (also on an error).

        LoRA needs no copy: the backend computes with the model's own adapter tensors."""
        with self.noise.noisy(sigma, noise_seed):
            yield self

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], sampling: Sampling,
                 progress: bool = False) -> Rollout:
        """Completions of `prompts` (chat-templated text, or token ids), in eval mode (no dropout); `progress`: a
        token bar."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return self._generate(list(prompts), sampling, progress)
        finally:
            self.model.train(was_training)

    def _generate(self, prompts: list, sampling: Sampling, progress: bool) -> Rollout:  # pragma: no cover
        raise NotImplementedError

    def reduced_precision(self) -> list[str]:
        """The parts of this sampler that compute in less precision than the update (each named for a log line):
        the NVFP4 layers' FP8 weight copies (quant.fp8_weights), which many-row GEMMs read outside the update. Their
        rollouts' log-probs measured 0.035 nats per token from the update's (BENCHMARKS.md, 2026-11-28), over the
        0.03 at which the trainer corrects by default (grpo.correction: auto)."""
        fp8 = any(getattr(m, "fp8_weights", False) for m in self.model.modules())
        return ["the NVFP4 base's FP8 weight copies (quant.fp8_weights)"] if fp8 else []

    def free(self) -> None:
        """Hand back memory held between calls (the engine's KV cache and graphs)."""

    def sleep(self) -> None:
        """Hand back what memory can be given back until the next call without losing graphs (the engine's KV
        cache on CUDA); the next `generate` takes it again."""

    def __repr__(self) -> str:
        return f"<{self.name} rollout backend>"


class ReferenceBackend(RolloutBackend):
    """`qerl.rollout.generate.generate`: the simple, exact sampler every other backend is tested against."""

    name = "reference"

    def _generate(self, prompts: list, sampling: Sampling, progress: bool) -> Rollout:
        return generate(self.model, self.tokenizer, prompts, progress=progress, **sampling.kwargs(per_row=True))


class EngineBackend(RolloutBackend):
    """The model's `engine.RolloutEngine` (one per model, kept across calls and shared with other backends)."""

    name = "engine"

    def __init__(self, model: nn.Module, tokenizer: Any, **engine_kwargs):
        from qerl.rollout.engine import engine_for

        super().__init__(model, tokenizer)
        self.engine = engine_for(model, **engine_kwargs)

    def _generate(self, prompts: list, sampling: Sampling, progress: bool) -> Rollout:
        return self.engine.generate(self.tokenizer, prompts, progress=progress, **sampling.kwargs(per_row=False))

    def reduced_precision(self) -> list[str]:
        """Also the FP8 KV cache (rollout.kv_cache_dtype: fp8; 0.10 nats per token against 0.02 on a small GPU
        test model)."""
        kv8 = ["the FP8 KV cache (rollout.kv_cache_dtype)"] if self.engine.kv8 else []
        return super().reduced_precision() + kv8

    def free(self) -> None:
        self.engine.free()

    def sleep(self) -> None:
        self.engine.sleep()


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
