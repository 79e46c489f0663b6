"""Batched rollout sampling over left-padded prompts with the model's static KV cache.

The simple, exact engine (CPU and GPU, no CUDA graphs): one prefill, then one token per step for every row,
finished rows masked, until all rows stop. Alongside the tokens it returns the sampling policy's log-probability
of each sampled token, log_softmax(logits / temperature) before top-k/top-p truncation: the quantity the trainer
recomputes for importance ratios.
"""
from __future__ import annotations

import os

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

StopReason = str  # "eos" | "stop" | "length"


@dataclass
class Rollout:
    """Sampled completions, one entry per prompt (same order).

    completion_ids include the EOS token when a row stopped on EOS, and end with the token that completed the stop
    string when it stopped on one; texts are those ids decoded without special tokens; logprobs[i] is a float32
    tensor with one value per completion id.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    texts: list[str]
    logprobs: list[Tensor]
    stop_reasons: list[StopReason]

    def select(self, rows: Sequence[int]) -> "Rollout":
        """The rows at indices `rows`, in that order."""
        return Rollout(prompt_ids=[self.prompt_ids[r] for r in rows],
                       completion_ids=[self.completion_ids[r] for r in rows], texts=[self.texts[r] for r in rows],
                       logprobs=[self.logprobs[r] for r in rows], stop_reasons=[self.stop_reasons[r] for r in rows])

    @classmethod
    def concat(cls, parts: Sequence["Rollout"]) -> "Rollout":
        """The rows of `parts`, one part after the other."""
        return cls(prompt_ids=[x for p in parts for x in p.prompt_ids],
                   completion_ids=[x for p in parts for x in p.completion_ids],
                   texts=[x for p in parts for x in p.texts], logprobs=[x for p in parts for x in p.logprobs],
                   stop_reasons=[x for p in parts for x in p.stop_reasons])

    @classmethod
    def from_padded(cls, tokenizer: Any, prompt_ids: list[list[int]], tokens: Tensor, logprobs: Tensor,
                    lengths: list[int], reasons: list[StopReason]) -> "Rollout":
        """Cut padded [B, T] sample and log-prob tensors (on the CPU) to each row's length."""
        completion_ids = [tokens[i, :n].tolist() for i, n in enumerate(lengths)]
        return cls(prompt_ids=prompt_ids, completion_ids=completion_ids,
                   texts=[_decode(tokenizer, ids) for ids in completion_ids],
                   logprobs=[logprobs[i, :n].clone() for i, n in enumerate(lengths)], stop_reasons=reasons)


def sample_tokens(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                  generator: torch.Generator | Sequence[torch.Generator] | None = None) -> tuple[Tensor, Tensor]:
    """Draw one token per row from fp32 logits [B, V]; return (tokens [B], their policy log-probs [B]).

    `generator` may be one generator for the batch or one per row: with one per row, a row's samples do not depend
    on which other rows share its batch.

    The log-prob is that of the full tempered distribution (untempered for greedy, temperature 0), since top-k/top-p
    only restrict where we sample, not the policy being optimized.
    """
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, F.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    if top_k == 0 and top_p >= 1.0 and not isinstance(generator, Sequence) and _sampling_kernel_runs(logits):
        from qerl.execution import fused_ops

        return fused_ops.fused_sample(logits, temperature, generator)
    scaled = logits / temperature
    logprobs = F.log_softmax(scaled, -1)
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = scaled.sort(-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass of strictly more likely tokens already reaches top_p (the top one always stays).
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        scaled = scaled.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probs = scaled.softmax(-1)
    # Exponential race: argmax(p / E), E ~ Exp(1), is an exact draw from p without a host sync (unlike multinomial).
    if isinstance(generator, Sequence):
        noise = torch.stack([torch.empty_like(row).exponential_(1.0, generator=g) for row, g in zip(probs, generator)])
    else:
        noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    tokens = (probs / noise).argmax(-1)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def _sampling_kernel_runs(logits: Tensor) -> bool:
    """Whether plain tempered sampling takes the one-pass kernel: on CUDA (or Triton's CPU interpreter, in tests).
    CPU runs keep the PyTorch sampler and its random numbers (bit-exact resumes, the README's measured runs)."""
    if not (logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    from qerl.execution import fused_ops

    return fused_ops.kernels_run_on(logits.device)


def default_eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """EOS ids of the model config and the tokenizer, united (chat models often differ: <|im_end|> vs <|endoftext|>)."""
    ids = list(getattr(getattr(model, "config", None), "eos_token_ids", []) or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def _encode(tokenizer: Any, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
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


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return "" if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True)


def check_sampling_args(max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                        stop_strings: Sequence[str] | str, tokenizer: Any, seed: int | None,
                        generator: torch.Generator | None) -> tuple[str, ...]:
    """Validate `generate`'s sampling arguments (shared with the CUDA engine); returns the non-empty stop strings."""
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


def prefill_once_per_prompt(model: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Last-position logits [B, 1, V] of a prefill of the left-padded `input_ids` [B, T] into the model's KV cache,
    computing each distinct row once: GRPO samples every prompt group_size times, and the prompt's keys and values
    are the same for all its samples, so its cache rows are copied instead of recomputed (1/group_size of the
    prefill; what vLLM's prefix cache does for a group). The cache and logits equal a prefill of every row, up to
    the float rounding of a smaller batch."""
    unique, inverse = distinct_rows(input_ids)
    batch, prompt_len = input_ids.shape
    position = torch.arange(prompt_len, device=input_ids.device)
    if len(unique) == batch:
        return model(input_ids, attention_mask=attention_mask, cache_position=position, logits_to_keep=1)
    unique_t = torch.tensor(unique, device=input_ids.device)
    inverse_t = torch.tensor(inverse, device=input_ids.device)
    logits = model(input_ids[unique_t], attention_mask=attention_mask[unique_t], cache_position=position,
                   logits_to_keep=1)
    for layer in model.model.layers:  # unique rows were written to cache rows 0..U-1: spread them to all B
        cache = layer.self_attn.kv_cache
        for t in (cache.k_cache, cache.v_cache):
            t[:batch, :, :prompt_len] = t[:len(unique), :, :prompt_len][inverse_t]
    return logits[inverse_t]


@torch.no_grad()
def generate(model: Any, tokenizer: Any, prompts: list[str] | list[list[int]], max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, stop_strings: Sequence[str] = (),
             eos_token_ids: Sequence[int] | None = None, seed: int | None = None,
             generator: torch.Generator | None = None, progress: bool = False,
             row_seeds: Sequence[int] | None = None) -> Rollout:
    """Sample up to `max_new_tokens` per prompt (greedy when temperature == 0).

    Text prompts are tokenized without adding special tokens (they carry their chat template). Rows stop at an EOS id
    (default: the model config's and the tokenizer's), at the first of `stop_strings` appearing in the decoded
    completion, or at the length limit. `seed` (or an explicit `generator` on the model's device) makes the samples
    reproducible; without either, the global RNG is used. `row_seeds` (one per prompt, instead of `seed`) gives every
    row its own generator, so a row samples the same tokens whatever batch it is in (up to float rounding of the
    batched forward): how data-parallel ranks reproduce a one-process run.
    """
    stop_strings = check_sampling_args(max_new_tokens, temperature, top_p, top_k, stop_strings, tokenizer, seed,
                                       generator)

    prompt_ids = _encode(tokenizer, prompts)
    device = model.model.embed_tokens.weight.device
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    if row_seeds is not None:
        if seed is not None or generator is not None or len(row_seeds) != len(prompt_ids):
            raise ValueError("row_seeds needs one seed per prompt and excludes seed and generator")
        generator = [torch.Generator(device=device).manual_seed(s) for s in row_seeds]
    eos = list(eos_token_ids) if eos_token_ids is not None else default_eos_ids(model, tokenizer)
    eos_t = torch.tensor(eos, dtype=torch.long, device=device)
    filler = eos[0] if eos else 0  # token fed to finished rows; their outputs are discarded

    batch, prompt_len = len(prompt_ids), max(map(len, prompt_ids))
    total = prompt_len + max_new_tokens
    input_ids = torch.full((batch, prompt_len), filler, dtype=torch.long)
    attention_mask = torch.zeros((batch, total), dtype=torch.long)
    for i, row in enumerate(prompt_ids):
        input_ids[i, prompt_len - len(row):] = torch.tensor(row)
        attention_mask[i, prompt_len - len(row):] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    attention_mask[:, prompt_len:] = 1  # generated slots are real tokens; causality hides them until written

    tokens = torch.zeros((batch, max_new_tokens), dtype=torch.long, device=device)
    logprobs = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
    lengths = [max_new_tokens] * batch
    reasons: list[StopReason] = ["length"] * batch
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    stop_window = max((len(s) for s in stop_strings), default=0) + 8  # tokens decoded to look for a stop string

    if max_new_tokens > 0:
        model.setup_kv_cache(batch, total)
        try:
            logits = prefill_once_per_prompt(model, input_ids, attention_mask[:, :prompt_len])
            for step in tqdm(range(max_new_tokens), desc="generate", unit="tok", disable=not progress):
                token, logprob = sample_tokens(logits[:, -1].float(), temperature, top_p, top_k, generator)
                token = token.masked_fill(done, filler)
                tokens[:, step], logprobs[:, step] = token, logprob
                newly = ~done & torch.isin(token, eos_t)
                for i in newly.nonzero()[:, 0].tolist():
                    lengths[i], reasons[i] = step + 1, "eos"
                done |= newly
                if stop_strings:
                    for i in (~done).nonzero()[:, 0].tolist():
                        tail = _decode(tokenizer, tokens[i, max(0, step + 1 - stop_window):step + 1].tolist())
                        if any(s in tail for s in stop_strings):
                            lengths[i], reasons[i] = step + 1, "stop"
                            done[i] = True
                if bool(done.all()) or step + 1 == max_new_tokens:
                    break
                position = prompt_len + step
                logits = model(token[:, None], attention_mask=attention_mask[:, :position + 1],
                               cache_position=torch.tensor([position], device=device))
        finally:
            model.free_kv_cache()  # hand the memory back to the training step

    tokens, logprobs = tokens.cpu(), logprobs.cpu()
    return Rollout.from_padded(tokenizer, prompt_ids, tokens, logprobs, lengths, reasons)
