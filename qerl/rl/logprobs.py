"""The update's forward: per-token log-probs (and entropies) of a batch's completion tokens under the policy, at the
sampling temperature, with the switches that save work without changing the result (to float rounding)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qerl.execution import execution_of
from qerl.rl import grpo


@dataclass(frozen=True)
class PolicyLogProbs:
    """`grpo.completion_log_probs` of `model` as a run's settings ask for it.

    share_prompts: a micro-batch's rows that repeat a prompt (a group's completions) run it through the blocks once
    (`model.share_prompts`, `qerl.execution.shared_prompts`): the embedded default's update ~2x fewer tokens
    (BENCHMARKS.md "Beside TRL on the CPU"). pack: only the real tokens through the GEMMs and the head
    (`model.pack_completions`). skip_idle_rows: rows whose loss has no gradient run their forward without autograd
    (`model.skip_idle_rows`, see `of_micro_batch`). The three are speed switches: `from_plan` reads them from the
    model's execution plan.
    """

    model: nn.Module
    temperature: float
    share_prompts: bool = False
    pack: bool = False
    skip_idle_rows: bool = False

    @classmethod
    def from_plan(cls, model: nn.Module, temperature: float, lora_dropout: bool, beta: float) -> "PolicyLogProbs":
        """At the sampling `temperature`, with the switches of `model`'s execution plan where they apply: shared
        prompts not with LoRA dropout (whose masks the rows would share), idle rows only without the KL term
        (`beta` = 0, which gives every row a gradient)."""
        plan = execution_of(model).plan
        return cls(model, temperature, share_prompts=plan.share_prompts and not lora_dropout,
                   pack=plan.pack_completions, skip_idle_rows=plan.skip_idle_rows and beta == 0)

    def __call__(self, ids: Tensor, attn: Tensor, P: int, want_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """Log-probs [B, C] (and entropies, or None) of the completion tokens ids[:, P:]."""
        return grpo.completion_log_probs(self.model, ids, attn, P, self.temperature, self.share_prompts,
                                         want_entropy, self.pack)

    def of_micro_batch(self, ids: Tensor, attn: Tensor, P: int, want_entropy: bool,
                       live: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """As calling it, with autograd only for the `live` rows (bool [B]; None: all): the others' log-probs come
        from a forward without a graph, so they cost no backward and keep no activations."""
        if live is None or bool(live.all()):
            return self(ids, attn, P, want_entropy)
        idle_rows, live_rows = (~live).nonzero().squeeze(1), live.nonzero().squeeze(1)
        with torch.no_grad():
            idle_logp, idle_entropy = self(ids[idle_rows], attn[idle_rows], P, want_entropy)
        if not len(live_rows):
            return idle_logp, idle_entropy
        live_logp, live_entropy = self(ids[live_rows], attn[live_rows], P, want_entropy)
        logp = idle_logp.new_empty((len(ids), idle_logp.shape[1])).index_copy(0, idle_rows, idle_logp) \
            .index_copy(0, live_rows, live_logp)
        entropy = None
        if want_entropy:
            entropy = idle_entropy.new_empty(logp.shape).index_copy_(0, idle_rows, idle_entropy) \
                .index_copy_(0, live_rows, live_entropy)
        return logp, entropy
