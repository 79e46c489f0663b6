"""What sampling is made of, whatever runs the model: the `Rollout` it returns, drawing a token from logits, and the
checks and conventions of a sampling call (its arguments, EOS ids, prompt encoding, per-row generators).

`qerl.rollout.engine.RolloutEngine` is the one sampler that uses them; `qerl.rollout.generate.generate` is that
engine in its reference configuration.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# "eos" | "stop" | "length" | "cut". cut: the row's group is not among the `groups_needed` groups a call with
# `groups` kept (`RolloutEngine.generate` stops once that many groups have every row finished); the row holds the
# tokens it had when the call stopped (also a row of such a group that had ended by itself: its tokens to its end).
StopReason = str


@dataclass
class Rollout:
    """Sampled completions, one entry per prompt (same order).

    completion_ids include the EOS token when a row stopped on EOS, and end with the token that completed the stop
    string when it stopped on one; texts are those ids decoded without special tokens; logprobs[i] is a float32
    tensor with one value per completion id.

    generated_mask[i] (bool, one per completion id; None: every token was generated) is False at the tokens the
    model did not sample: a multi-turn rollout's tool turns (the tool's answer and the chat template's glue around
    it, `qerl.rollout.multi_turn`), whose log-probs are 0. The trainer leaves them out of the loss, the KL, the
    importance ratios and the entropy metrics; they stay in the sequence as context.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    texts: list[str]
    logprobs: list[Tensor]
    stop_reasons: list[StopReason]
    generated_mask: list[Tensor] | None = None
    # A multi-turn rollout with `rollout.environment`: each row's `qerl.tools.Environment`, as its tool calls left it
    # (what TRL-form reward functions read as `environments`). None: no environment.
    environments: list[Any] | None = None

    def select(self, rows: Sequence[int]) -> "Rollout":
        """The rows at indices `rows`, in that order."""
        masks = None if self.generated_mask is None else [self.generated_mask[r] for r in rows]
        envs = None if self.environments is None else [self.environments[r] for r in rows]
        return Rollout(prompt_ids=[self.prompt_ids[r] for r in rows],
                       completion_ids=[self.completion_ids[r] for r in rows], texts=[self.texts[r] for r in rows],
                       logprobs=[self.logprobs[r] for r in rows], stop_reasons=[self.stop_reasons[r] for r in rows],
                       generated_mask=masks, environments=envs)

    def masks(self) -> list[Tensor]:
        """generated_mask, all True where it is None."""
        if self.generated_mask is not None:
            return self.generated_mask
        return [torch.ones(len(c), dtype=torch.bool) for c in self.completion_ids]

    @classmethod
    def concat(cls, parts: Sequence["Rollout"]) -> "Rollout":
        """The rows of `parts`, one part after the other."""
        masks = None if all(p.generated_mask is None for p in parts) else [m for p in parts for m in p.masks()]
        envs = None if all(p.environments is None for p in parts) else \
            [e for p in parts for e in (p.environments or [None] * len(p.texts))]
        return cls(prompt_ids=[x for p in parts for x in p.prompt_ids],
                   completion_ids=[x for p in parts for x in p.completion_ids],
                   texts=[x for p in parts for x in p.texts], logprobs=[x for p in parts for x in p.logprobs],
                   stop_reasons=[x for p in parts for x in p.stop_reasons], generated_mask=masks, environments=envs)

    @classmethod
    def from_padded(cls, tokenizer: Any, prompt_ids: list[list[int]], tokens: Tensor, logprobs: Tensor,
                    lengths: list[int], reasons: list[StopReason]) -> "Rollout":
        """Cut padded [B, T] sample and log-prob tensors (on the CPU) to each row's length."""
        completion_ids = [tokens[i, :n].tolist() for i, n in enumerate(lengths)]
        return cls(prompt_ids=prompt_ids, completion_ids=completion_ids,
                   texts=[decode_ids(tokenizer, ids) for ids in completion_ids],
                   logprobs=[logprobs[i, :n].clone() for i, n in enumerate(lengths)], stop_reasons=reasons)


def sample_tokens(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                  generator: torch.Generator | Sequence[torch.Generator] | None = None,
                  row_keys: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Draw one token per row from fp32 logits [B, V]; return (tokens [B], their policy log-probs [B]).

    `generator` may be one generator for the batch or one per row: with one per row, a row's samples do not depend
    on which other rows share its batch. `row_keys` (with one generator per row; `step_keys`): each row's key for
    the one-pass kernel, which then draws in their place where it runs (on CUDA: one kernel, not a launch per row;
    with top-k/top-p too, on the restricted logits).

    The log-prob is that of the full tempered distribution (untempered for greedy, temperature 0), since top-k/top-p
    only restrict where we sample, not the policy being optimized.
    """
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, F.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    per_row = isinstance(generator, Sequence)
    kernel = (not per_row or row_keys is not None) and _sampling_kernel_runs(logits)
    if kernel and top_k == 0 and top_p >= 1.0:
        from qerl.execution import fused_ops

        return fused_ops.fused_sample(logits, temperature, None if per_row else generator, seeds=row_keys)
    scaled = logits / temperature
    logprobs = F.log_softmax(scaled, -1)
    if kernel and per_row:
        from qerl.execution import fused_ops

        # Row keys with top-k/top-p: the restricted logits go through the same keyed kernel (one launch; a row's
        # draw independent of its batch) rather than one generator call per row. The fill is finite: the kernel's
        # split log-sum-exp would turn a block of -inf into NaN (its tokens would not change, its log-probs would).
        restricted = restrict(scaled, top_p, top_k, fill=torch.finfo(scaled.dtype).min)
        tokens, _ = fused_ops.fused_sample(restricted, 1.0, seeds=row_keys)
        return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]
    probs = restrict(scaled, top_p, top_k).softmax(-1)
    # Exponential race: argmax(p / E), E ~ Exp(1), is an exact draw from p without a host sync (unlike multinomial).
    if per_row:
        noise = torch.stack([torch.empty_like(row).exponential_(1.0, generator=g) for row, g in zip(probs, generator)])
    else:
        noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    tokens = (probs / noise).argmax(-1)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def restrict(scaled: Tensor, top_p: float = 1.0, top_k: int = 0, fill: float = float("-inf")) -> Tensor:
    """Tempered logits [B, V] with `fill` outside each row's top-k tokens and outside its nucleus (the fewest most
    likely tokens whose mass reaches top_p; the top one always stays); the input itself when neither applies."""
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, fill)
    if top_p < 1.0:
        sorted_logits, order = scaled.sort(-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass of strictly more likely tokens already reaches top_p (the top one always stays).
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        scaled = scaled.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), fill)
    return scaled


def step_keys(row_seeds: Tensor, step: int | Tensor) -> Tensor:
    """The one-pass sampling kernel's key of each row at decode step `step` (int64 [B] in [0, 2^31)): a hash of the
    row's seed and the step (MMIX's LCG constants, int64 arithmetic wrapping), so a row's draws depend on nothing
    else. `step` may be a tensor of each row's own step (a row carried from an earlier call goes on from its
    index): the same keys, its product wrapping in int64 as the int's is reduced mod 2^64."""
    if isinstance(step, Tensor):
        increment = (step + 1) * 1442695040888963407
    else:
        increment = (step + 1) * 1442695040888963407 % 2**64
        increment = increment - 2**64 if increment >= 2**63 else increment
    mixed = row_seeds * 6364136223846793005 + increment
    return (mixed >> 33) & 0x7FFFFFFF


def _sampling_kernel_runs(logits: Tensor) -> bool:
    """Whether plain tempered sampling takes the one-pass kernel: on CUDA (or Triton's CPU interpreter, in tests).
    CPU runs keep the PyTorch sampler and its random numbers (bit-exact resumes, the README's measured runs)."""
    from qerl.execution import fused_ops  # imported with the model's default execution plan already

    return fused_ops.kernels_run_on(logits.device)


def default_eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """EOS ids of the model config and the tokenizer, united (chat models often differ: <|im_end|> vs <|endoftext|>)."""
    ids = list(getattr(getattr(model, "config", None), "eos_token_ids", []) or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def encode_prompts(tokenizer: Any, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
    if not prompts:
        raise ValueError("generate() needs at least one prompt")
    if all(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer")
        # Prompts arrive with the chat template already applied (BOS included where the template wants it).
        ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    elif all(isinstance(p, (list, tuple)) or isinstance(p, Tensor) for p in prompts):
        ids = [[int(t) for t in p] for p in prompts]
    else:
        raise TypeError("prompts must all be strings or all be lists of token ids")
    for i, row in enumerate(ids):
        if not row:
            raise ValueError(f"prompt {i} is empty")
    return ids


def decode_ids(tokenizer: Any, ids: list[int]) -> str:
    return "" if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True)


def check_sampling_args(max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                        stop_strings: Sequence[str] | str, tokenizer: Any, seed: int | None,
                        generator: torch.Generator | None) -> tuple[str, ...]:
    """Validate the sampling arguments of `RolloutEngine.generate`; returns the non-empty stop strings."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if isinstance(stop_strings, str):
        stop_strings = (stop_strings,)
    stop_strings = tuple(s for s in stop_strings if s)
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer")
    if seed is not None and generator is not None:
        raise ValueError("pass either seed or generator, not both")
    return stop_strings


def random_source(device: torch.device, prompts: int, seed: int | None, generator: torch.Generator | None,
                  row_seeds: Sequence[int] | None) -> torch.Generator | list[torch.Generator] | None:
    """Where a call's random numbers come from: one generator per prompt with `row_seeds` (a row then samples the
    same tokens whatever batch it is in: how data-parallel ranks reproduce a one-process run), else one generator
    for the batch (`seed`, or the caller's `generator`), else None (the global RNG)."""
    if row_seeds is None:
        return torch.Generator(device=device).manual_seed(seed) if seed is not None else generator
    if seed is not None or generator is not None or len(row_seeds) != prompts:
        raise ValueError("row_seeds needs one seed per prompt and excludes seed and generator")
    return [torch.Generator(device=device).manual_seed(s) for s in row_seeds]


def distinct_rows(ids: Tensor) -> tuple[list[int], list[int]]:
    """(unique, inverse) of the rows of a 2-D tensor: the index of each distinct row's first occurrence, and for
    every row the position of its distinct row in `unique` (ids[unique][inverse] == ids)."""
    slot: dict[tuple, int] = {}
    unique, inverse = [], []
    for i, row in enumerate(ids.tolist()):
        j = slot.setdefault(tuple(row), len(unique))
        if j == len(unique):
            unique.append(i)
        inverse.append(j)
    return unique, inverse
