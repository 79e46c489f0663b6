"""The policy update: μ optimizer steps of the GRPO/DAPO loss over one scored batch, micro-batched with the
gradients accumulated (and summed over data-parallel ranks), under the step's memory plan: the blocks the free
memory cannot keep recompute their forward in backward, and what is left holds dequantized base weights."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qerl.config import GRPOSettings
from qerl.execution import execution_of, held_weights, update_precision
from qerl.model import lora, recompute
from qerl.model.aqn import NoiseInjector
from qerl.rl import grpo
from qerl.rl.distributed import Group
from qerl.rl.logprobs import PolicyLogProbs
from qerl.rl.memory import held_weights_budget
from qerl.rl.metrics import StepTotals

log = logging.getLogger(__name__)
from qerl.rl.batch import RolloutBatch


@dataclass
class PolicyUpdate:
    """Steps `optimizer` (over `params`, the LoRA factors of `model`) on the policy loss of a scored batch.

    logprobs: the update's forward; loss_cfg: the loss (`grpo.policy_loss`); grpo: the `grpo:` section (micro-batch,
    μ iterations, the KL term, reward scaling); max_grad_norm: the clip of each optimizer step; dist: the ranks whose
    step this is a share of; noise: AQN's injector, for noise in the training forward (aqn.in_training_forward);
    pad_id: the padding token of the batch's layout. How fast it runs (precision, recompute, held weights) is the
    model's execution plan's. The learning-rate schedule is the caller's (it counts updates).
    """

    model: nn.Module
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    logprobs: PolicyLogProbs
    loss_cfg: grpo.LossConfig
    grpo: GRPOSettings
    max_grad_norm: float
    dist: Group
    noise: NoiseInjector
    pad_id: int

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def __call__(self, batch: RolloutBatch, sigma_train: float = 0.0) -> tuple[StepTotals, Tensor, Tensor]:
        """Update on `batch` (this rank's share of the step) with AQN noise `sigma_train` in the training forward;
        returns the step's sums, the whole step's rewards and this rank's truncated rows (for `step_metrics`)."""
        step_rewards, advantages = self._advantages(batch)
        padded = batch.padded(self.pad_id)
        truncated = torch.tensor([r == "length" for r in batch.samples.stop_reasons])
        mask = grpo.loss_mask(padded["mask"], self.loss_cfg, truncated)
        on_device = {k: v.to(self.device) for k, v in padded.items() if isinstance(v, Tensor)}
        micro = self._micro_batches(len(batch))
        plan = execution_of(self.model).plan
        with update_precision(self.model, plan.base_gemm):  # every forward of the update: the same GEMMs
            # Recompute only the blocks the free memory cannot keep (measured on this step's micro-batch shape);
            # what is left after them holds dequantized base weights through the update.
            first = micro[0]
            memory = recompute.plan(self.model.model, on_device["ids"][first], on_device["attn"][first],
                                    plan.gradient_checkpointing)
            self.model.gradient_checkpointing = memory.recomputed_blocks
            with held_weights(self.model, held_weights_budget(plan, memory)) as held_bytes:
                old_logp, ref_logp, entropy = self._frozen_logps(on_device, padded["P"], micro)
                totals = self._optimize(batch, on_device, padded["P"], micro, advantages, mask, truncated, old_logp,
                                        ref_logp, entropy, sigma_train)
                totals.recomputed_blocks, totals.held_gib = memory.recomputed_blocks, held_bytes() / recompute.GIB
        return totals, step_rewards, truncated

    def _advantages(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        """(the whole step's rewards, this rank's advantages). Advantages are taken over all the step's groups
        (scale_rewards=batch needs them all); this rank's rows are a slice."""
        step_rewards = torch.tensor(self.dist.gather(batch.rewards.tolist()), dtype=torch.float32)
        advantages = grpo.group_advantages(step_rewards, batch.group_size, scale=self.grpo.scale_rewards)
        rows = len(batch)
        return step_rewards, advantages[self.dist.rank * rows:][:rows]

    def _micro_batches(self, rows: int) -> list[slice]:
        size = self.grpo.micro_batch_size
        return [slice(i, min(i + size, rows)) for i in range(0, rows, size)]

    @torch.no_grad()
    def _frozen_logps(self, t: dict[str, Tensor], P: int,
                      micro: list[slice]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """What stays fixed through the step's μ iterations: the sampling policy's log-probs (only needed when μ > 1;
        at μ = 1 the loss uses the live ones, detached) and entropies (only for grpo.top_entropy_quantile < 1: the
        tokens it keeps are the whole step's top quantile, so all of them are needed before the first backward;
        from the same forward), and the reference's log-probs (adapters off; only when beta > 0)."""
        def logps(want_entropy: bool) -> tuple[Tensor, Tensor | None]:
            parts = [self.logprobs(t["ids"][m], t["attn"][m], P, want_entropy) for m in micro]
            return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]) if want_entropy else None

        g = self.grpo
        old_logp = entropy = ref_logp = None
        want_entropy = self.loss_cfg.top_entropy_quantile < 1
        if g.num_iterations > 1 or want_entropy:
            logp, entropy = logps(want_entropy)
            old_logp = logp if g.num_iterations > 1 else None
        if g.beta > 0:
            with lora.adapters_disabled(self.model):
                ref_logp = logps(False)[0]
        return old_logp, ref_logp, entropy

    def _optimize(self, batch: RolloutBatch, t: dict[str, Tensor], P: int, micro: list[slice], advantages: Tensor,
                  mask: Tensor, truncated: Tensor, old_logp: Tensor | None, ref_logp: Tensor | None,
                  frozen_entropy: Tensor | None, sigma_train: float) -> StepTotals:
        """The μ optimizer steps, each accumulating the gradients of every micro-batch; returns the step's sums.
        `frozen_entropy`: the sampling policy's, for the top-entropy mask (None without one)."""
        dev = self.device
        totals = StepTotals()
        self.model.train()
        # Rows whose loss has a gradient: a non-zero advantage and at least one loss token.
        live = (advantages.to(dev).reshape(len(advantages), -1).ne(0).any(-1) & (mask.to(dev).sum(-1) > 0)
                if self.logprobs.skip_idle_rows else None)
        # Normalizers of the whole step, so the ranks' gradient sum is the one-process gradient.
        token_count, step_rows = self.dist.sum([float(mask.sum()), float(len(batch))])
        totals.token_count = max(token_count, 1.0)
        entropy_cut = None  # the top-entropy mask's threshold: the quantile of the whole step's loss tokens
        if frozen_entropy is not None:
            entropies = frozen_entropy[mask.to(dev).bool()]
            if self.dist.active:  # every rank's
                entropies = torch.tensor(self.dist.gather(entropies.tolist()))
            entropy_cut = grpo.entropy_threshold(entropies, self.grpo.top_entropy_quantile)
        for iteration in range(self.grpo.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            totals.loss = 0.0
            for m in micro:
                with self.noise.noisy(sigma_train, batch.noise_seed):
                    logp, entropy = self.logprobs.of_micro_batch(t["ids"][m], t["attn"][m], P, iteration == 0,
                                                                 None if live is None else live[m])
                    loss, metrics = grpo.policy_loss(
                        logp, None if old_logp is None else old_logp[m], advantages[m].to(dev), t["mask"][m],
                        self.loss_cfg, ref_logp=None if ref_logp is None else ref_logp[m],
                        rollout_logp=t["rollout_logp"][m], truncated=truncated[m].to(dev),
                        token_normalizer=totals.token_count, entropy_cut=entropy_cut,
                        entropy=None if frozen_entropy is None else frozen_entropy[m])
                    if not self.loss_cfg.normalized_by_step_tokens:  # means: weight by the micro-batch's share
                        loss = loss * (m.stop - m.start) / step_rows
                    if loss.requires_grad:  # not when every row of the micro-batch is idle
                        loss.backward()
                # The loss metrics: token means over the step, averaged over its μ iterations.
                totals.add(loss.item(), metrics, weight=float(mask[m].sum()) / self.grpo.num_iterations,
                           entropy=entropy, mask=t["mask"][m])
            for p in self.params:  # idle rows only: a zero gradient, as their backward would have left (AdamW
                if p.grad is None:  # still steps on its moments)
                    p.grad = torch.zeros_like(p)
            self.dist.sum_gradients(self.params)
            totals.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
            if not math.isfinite(totals.grad_norm):
                # One NaN or inf in the gradient makes every LoRA weight and AdamW moment NaN for good (and every
                # later rollout garbage): skip the optimizer step, as AMP's GradScaler does, and say so. The ranks
                # summed their gradients first, so all of them skip together.
                totals.nonfinite_skipped += 1
                log.warning("the update's gradient is not finite (grad_norm %s; loss %s): optimizer step skipped, "
                            "the adapters are unchanged (metric update/nonfinite_skipped)", totals.grad_norm,
                            totals.loss)
                self.optimizer.zero_grad(set_to_none=True)
                continue
            self.optimizer.step()
        return totals
