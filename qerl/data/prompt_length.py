"""Prompts must leave room for the completion in the model's context: checked when the data loads, not minutes later
when the KV cache for an oversized batch fails to allocate.

A prompt is measured as the policy sees it: the question inside the chat template and system prompt, tokenized as
`qerl.rollout` tokenizes it. Too long is an error naming the example's file and line (the default, as vLLM rejects
such a request), or, with `data.overlong_prompts: drop`, the example is left out and the count is logged (as TRL's
`max_prompt_length` filters do).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Literal, Sequence

from qerl.data.problems import Example, build_prompt

log = logging.getLogger(__name__)

_LINE = re.compile(r":(\d+)$")  # jsonl examples carry ids like "gsm8k/test.jsonl:17"


def model_context(model: Any) -> int | None:
    """The context window of a loaded model (ours or a Hugging Face one); None if it does not say."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def where(example: Example, source: str) -> str:
    """`file:line` for examples read from a file, else the source and the example's id."""
    match = _LINE.search(example.id)
    return f"{source}:{match.group(1)}" if match else f"{source} example {example.id}"


def fit_prompts(examples: Sequence[Example], tokenizer: Any, system_prompt: str | None, context: int | None,
                max_new_tokens: int, *, source: str, setting: str,
                policy: Literal["error", "drop"] = "error") -> list[Example]:
    """The examples whose prompt plus `max_new_tokens` fits in `context` tokens (all of them when `context` is None).

    `source` names where the examples came from (a file, or `data.name=...`), `setting` the key of `max_new_tokens`
    (e.g. "rollout.max_new_tokens"), for the messages.
    """
    if context is None or tokenizer is None:
        return list(examples)
    budget = context - max_new_tokens
    if budget <= 0:
        raise ValueError(f"{setting} = {max_new_tokens} leaves no room for a prompt in the model's context of "
                         f"{context} tokens")
    kept, dropped = [], 0
    for example in examples:
        prompt = build_prompt(tokenizer, example.question, system_prompt)
        length = len(tokenizer.encode(prompt, add_special_tokens=False))
        if length <= budget:
            kept.append(example)
            continue
        if policy == "error":
            raise ValueError(f"{where(example, source)}: prompt is {length:,} tokens, longer than the "
                             f"{budget:,} the model's context of {context:,} leaves after {setting} = "
                             f"{max_new_tokens} (shorten it, or set data.overlong_prompts=drop to leave such "
                             "examples out)")
        dropped += 1
    if dropped:
        log.warning("dropped %d of %d examples of %s whose prompt is longer than %d tokens "
                    "(data.overlong_prompts=drop)", dropped, len(examples), source, budget)
    if not kept:
        raise ValueError(f"{source}: every prompt is longer than {budget:,} tokens (the model's context of "
                         f"{context:,} minus {setting} = {max_new_tokens})")
    return kept
