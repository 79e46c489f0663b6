"""The rollout seam: one object samples from the policy for the trainer and for evaluation.

As TRL's generation backends (transformers' `generate`, or a colocated vLLM), a backend is built once next to the
model and used by everything that samples from the policy:

    backend = make_backend(model, tokenizer, "auto")        # qerl.rollout.factory
    with backend.sync(sigma, noise_seed):      # before a step: the current LoRA, plus this step's AQN noise
        out = backend.generate(prompts, Sampling(max_new_tokens=256, temperature=1.0, seed=0))

Both backends return a `generate.Rollout` and read the model's own tensors, so syncing LoRA copies nothing (the
optimizer steps the factors in place; the engine re-captures its graphs if a tensor moved), and AQN noise is
written into the RMSNorm weights in place for the block and removed bit-exactly after it.

Both are the one sampler, `engine.RolloutEngine`, in two configurations:

* `ReferenceBackend`: `RolloutEngine.reference` (what `qerl.rollout.generate.generate` runs): the model's own
  forward over each call's exact shapes, no graphs; its KV cache lives for the call.
* `EngineBackend`: the model's `RolloutEngine` (static KV cache kept across calls, CUDA graphs, compaction).
  Trainer and evaluation on one model share its engine (`engine_for`), so they share its graphs and cache.
* `qerl.rollout.vllm_backend.VLLMBackend`: a colocated vLLM engine (its own copy of the base, the LoRA handed over
  each step), as TRL's colocate mode; optional.

"auto" takes the engine on CUDA and the reference on the CPU. With `row_seeds` both draw each row's tokens from its
own generator, so they sample the same tokens up to the float rounding of their shapes; with one `seed` the engine
draws for padded power-of-two buckets of rows, other random numbers than the reference's. CPU runs keep the
reference's exact shapes (the README's measured runs, bit-exact resumes).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qerl.model.aqn import NoiseInjector
from qerl.rollout.engine import RolloutEngine, engine_for
from qerl.rollout.multi_turn import ToolUse, generate_with_tools
from qerl.rollout.sampling import Rollout

__all__ = ["Sampling", "RolloutBackend", "ReferenceBackend", "EngineBackend"]



@dataclass(frozen=True)
class Sampling:
    """How to sample (the keyword arguments of `RolloutEngine.generate`); temperature 0 is greedy."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None  # None: the model config's and the tokenizer's
    seed: int | None = None  # None: the global RNG
    # One seed per prompt instead of `seed`: each row its own generator, so a row samples the same tokens in any
    # batch, as data-parallel ranks need.
    row_seeds: tuple[int, ...] | None = None
    # Over-provisioned rollouts (rollout.overprovision): the prompts come as `group_size` consecutive rows each, and
    # the call stops once `groups_needed` of these groups have every row finished; the other groups' rows come back
    # with stop reason "cut" (`RolloutEngine.generate`'s groups). None: every row runs to its end. vLLM has no such
    # stop: its backend runs every row to its end (the settings refuse rollout.overprovision with backend vllm).
    groups_needed: int | None = None
    group_size: int = 1

    def kwargs(self, rows: int) -> dict[str, Any]:
        """Keyword arguments of `RolloutEngine.generate` for a call of `rows` prompt rows."""
        out = dataclasses.asdict(self)
        size = out.pop("group_size")
        if self.groups_needed is not None:
            if rows % size:
                raise ValueError(f"{rows} rows are not groups of {size}")
            out["groups"] = [i // size for i in range(rows)]
        return out


class RolloutBackend:
    """Samples completions from `model`; subclasses say how (`_generate`)."""

    name = ""

    def __init__(self, model: nn.Module, tokenizer: Any):
        self.model, self.tokenizer = model, tokenizer
        self.noise = NoiseInjector(model)  # AQN for rollouts; the trainer's training-forward noise uses it too
        # `RolloutEngine.generate`'s logits_processor for every call (benchmarks force EOS at traced lengths with it)
        self.logits_processor = None

    def aim_noise(self, include_final_norm: bool = True, include_qk_norm: bool = False) -> NoiseInjector:
        """Choose the norm weights AQN perturbs (aqn.include_final_norm, aqn.include_qk_norm; NoiseInjector), before
        any noise is applied; returns the new injector."""
        if self.noise.active:
            raise RuntimeError("AQN noise is applied; choose its norms between rollouts")
        self.noise = NoiseInjector(self.model, include_final_norm, include_qk_norm)
        return self.noise

    @contextmanager
    def sync(self, sigma: float = 0.0, noise_seed: int = 0) -> Iterator["RolloutBackend"]:
        """Inside the block, sample from the trainer's current policy with AQN noise N(0, sigma^2) in the norm
        weights (one draw per norm from `noise_seed`; sigma 0 adds none), removed on exit (also on an error).

        LoRA needs no copy: the backend computes with the model's own adapter tensors."""
        with self.noise.noisy(sigma, noise_seed):
            yield self

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], sampling: Sampling,
                 progress: bool = False, drafts: Any = None) -> Rollout:
        """Completions of `prompts` (chat-templated text, or token ids), in eval mode (no dropout); `progress`: a
        token bar; `drafts`: the `qerl.rollout.drafts.DraftHistory` speculative decoding drafts from and adds this
        call's completions to (the trainer's; None: drafts from the call's own prompts and rows only)."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return self._generate(list(prompts), sampling, progress, drafts)
        finally:
            self.model.train(was_training)

    def _generate(self, prompts: list, sampling: Sampling, progress: bool,
                  drafts: Any) -> Rollout:  # pragma: no cover
        raise NotImplementedError

    def generate_with_tools(self, prompts: Sequence[str] | Sequence[Sequence[int]], sampling: Sampling,
                            use: ToolUse, rows: Sequence[Mapping[str, Any]] | None = None,
                            ) -> tuple[Rollout, dict[str, float]]:
        """A multi-turn rollout of `prompts` whose rows call `use.tools` (`qerl.rollout.multi_turn`), in eval mode:
        the `Rollout` (with `generated_mask`) and the tool calls' counts. `rows`: each prompt's data row, which its
        environment is reset with (`use.environment`). The engine's backends only."""
        engine = getattr(self, "engine", None)
        if not isinstance(engine, RolloutEngine):
            raise ValueError(f"rollout.tools: the {self.name} backend has no multi-turn path (a row there cannot wait "
                             "for a tool and go on from its KV cache); use backend auto, engine or reference")
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return generate_with_tools(engine, self.tokenizer, list(prompts), sampling.max_new_tokens, use,
                                           rows=rows, logits_processor=self.logits_processor,
                                           **{k: v for k, v in sampling.kwargs(len(prompts)).items()
                                              if k != "max_new_tokens"})
        finally:
            self.model.train(was_training)
            if isinstance(self, ReferenceBackend):  # its cache lives for the call
                engine.free()

    def reduced_precision(self) -> list[str]:
        """The parts of this sampler that compute in less precision than the update (each named for a log line):
        the NVFP4 layers' FP8 weight copies (quant.fp8_weights), which many-row GEMMs read outside the update. Their
        rollouts' log-probs measured 0.035 nats per token from the update's (BENCHMARKS.md, 2026-11-28), over the
        0.03 at which the trainer corrects by default (grpo.correction: auto). And an FP8 base's forwards on FP8
        tensor cores (quant.scheme fp8, kernels/fp8_gemm.py), whose activations are rounded to E4M3 per token where
        the bf16 update's are not."""
        modules = list(self.model.modules())
        paths = ["the NVFP4 base's FP8 weight copies (quant.fp8_weights)"] \
            if any(getattr(m, "fp8_weights", False) for m in modules) else []
        if any(getattr(m, "fp8_activations", lambda: False)() for m in modules):  # QuantLinear's
            paths.append("the FP8 base's per-token FP8 activations (quant.scheme fp8)")
        return paths

    def speculation_counts(self) -> dict[str, float]:
        """Running counts of speculative decoding (`RolloutEngine.stats`: verify_steps, spec_row_steps,
        spec_tokens, drafted, accepted); {} for a sampler without it."""
        engine = getattr(self, "engine", None)
        keys = ("verify_steps", "spec_row_steps", "spec_tokens", "drafted", "accepted")
        return {k: engine.stats[k] for k in keys} if engine is not None else {}

    def free(self) -> None:
        """Hand back memory held between calls (the engine's KV cache and graphs)."""

    def sleep(self) -> None:
        """Hand back what memory can be given back until the next call without losing graphs (the engine's KV
        cache on CUDA); the next `generate` takes it again."""

    def __repr__(self) -> str:
        return f"<{self.name} rollout backend>"


class ReferenceBackend(RolloutBackend):
    """`RolloutEngine.reference`: the plain sampler every optimised configuration is tested against. Its KV cache is
    freed after each call (the memory goes back to the training step; the next call's shapes are its own)."""

    name = "reference"

    def __init__(self, model: nn.Module, tokenizer: Any, **speculation):
        super().__init__(model, tokenizer)
        self.engine = RolloutEngine.reference(model, **speculation)

    def _generate(self, prompts: list, sampling: Sampling, progress: bool, drafts: Any) -> Rollout:
        try:
            return self.engine.generate(self.tokenizer, prompts, progress=progress, drafts=drafts,
                                        logits_processor=self.logits_processor, **sampling.kwargs(len(prompts)))
        finally:
            self.engine.free()


class EngineBackend(RolloutBackend):
    """The model's `engine.RolloutEngine` (one per model, kept across calls and shared with other backends)."""

    name = "engine"

    def __init__(self, model: nn.Module, tokenizer: Any, **engine_kwargs):
        super().__init__(model, tokenizer)
        self.engine = engine_for(model, **engine_kwargs)

    def _generate(self, prompts: list, sampling: Sampling, progress: bool, drafts: Any) -> Rollout:
        return self.engine.generate(self.tokenizer, prompts, progress=progress, drafts=drafts,
                                    logits_processor=self.logits_processor, **sampling.kwargs(len(prompts)))

    def reduced_precision(self) -> list[str]:
        """Also the FP8 KV cache (rollout.kv_cache_dtype: fp8; 0.10 nats per token against 0.02 on a small GPU
        test model)."""
        kv8 = ["the FP8 KV cache (rollout.kv_cache_dtype)"] if self.engine.kv8 else []
        return super().reduced_precision() + kv8

    def free(self) -> None:
        self.engine.free()

    def sleep(self) -> None:
        self.engine.sleep()
