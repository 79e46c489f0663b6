"""A step's metrics: what one rank's micro-batches add up to (`StepTotals`), and their reduction over the ranks
into the record metrics.jsonl, the trackers and the progress line show (`step_metrics`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from qerl.rl.distributed import Group
from qerl.rl.batch import RolloutBatch


@dataclass
class StepTotals:
    """What one rank's micro-batches add up to in `Trainer.update`, before the ranks combine them."""

    token_count: float = 1.0  # loss tokens of the whole step (all ranks): the metrics' normalizer
    loss: float = 0.0  # of the last of the μ iterations
    grad_norm: float = 0.0
    entropy_sum: float = 0.0  # over the first iteration's tokens
    entropy_count: float = 0.0
    sums: dict[str, float] = field(default_factory=dict)  # loss metrics weighted by their micro-batch's tokens / μ
    peaks: dict[str, float] = field(default_factory=dict)  # "/max" metrics: a max over micro-batches, not a mean
    recomputed_blocks: int = 0  # blocks that recomputed their forward in backward (model.gradient_checkpointing)
    held_gib: float = 0.0  # dequantized base weights kept through the update (model.keep_dequantized)
    nonfinite_skipped: int = 0  # optimizer steps skipped: their gradient held a NaN or an inf

    def add(self, loss: float, metrics: dict[str, float], weight: float, entropy: Tensor | None, mask: Tensor) -> None:
        self.loss += loss
        for k, v in metrics.items():
            if k.endswith("/max"):
                self.peaks[k] = max(self.peaks.get(k, v), v)
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v * weight
        if entropy is not None:
            self.entropy_sum += float((entropy * mask).sum())
            self.entropy_count += float(mask.sum())


def step_metrics(dist: Group, step: int, batch: RolloutBatch, step_rewards: Tensor, truncated: Tensor,
                 totals: StepTotals, lr: float, seconds_update: float, peak_memory: float) -> dict[str, float]:
    """The step's metrics over all ranks: sums of the partial sums, whole-step rows gathered, the slowest rank's
    times and peak memory."""
    keys, peak_keys = sorted(totals.sums), sorted(totals.peaks)
    loss_total, entropy_sum, entropy_count, grader_timeouts, *sums = dist.sum(
        [totals.loss, totals.entropy_sum, totals.entropy_count, batch.grader_timeouts]
        + [totals.sums[k] for k in keys])
    peaks = dict(zip(peak_keys, dist.max([totals.peaks[k] for k in peak_keys])))
    lengths = torch.tensor(dist.gather([len(c) for c in batch.samples.completion_ids]), dtype=torch.float32)
    truncated = torch.tensor(dist.gather(truncated.tolist()))
    accuracy = torch.tensor(dist.gather(batch.accuracy.tolist()), dtype=torch.float32)
    seconds_rollout, seconds_scoring, seconds_update, peak_memory = dist.max(
        [batch.seconds, batch.score_seconds, seconds_update, peak_memory])
    metrics = {
        "step": step,
        "reward_mean": float(step_rewards.mean()),
        "reward_std": float(step_rewards.std()) if len(step_rewards) > 1 else 0.0,
        "accuracy": float(accuracy.mean()),
        "entropy": entropy_sum / max(entropy_count, 1.0),
        "loss": loss_total,
        "grad_norm": totals.grad_norm,
        "lr": lr,
        "response_length": float(lengths.mean()),
        "truncation_rate": float(truncated.float().mean()),
        "sigma": batch.sigma,
        "noise_seed": batch.noise_seed,
        "rollout_tokens_per_s": float(lengths.sum()) / max(seconds_rollout, 1e-9),
        "seconds_rollout": seconds_rollout,
        "seconds_scoring": seconds_scoring,
        "grader_timeouts": int(grader_timeouts),  # completions scored 0: math-verify went over its CPU budget
        "seconds_update": seconds_update,
        "peak_memory_gb": peak_memory,
        "recomputed_blocks": totals.recomputed_blocks,
        "held_weights_gib": totals.held_gib,
        "update/nonfinite_skipped": totals.nonfinite_skipped,
    }  # "kl" joins from the loss metrics when grpo.beta > 0 (as TRL: no reference forward otherwise)
    metrics.update(reward_term_metrics(dist, batch))
    metrics.update({k: v / totals.token_count for k, v in zip(keys, sums)})
    metrics.update(peaks)
    metrics.update(batch.extra)
    return metrics


def reward_term_metrics(dist: Group, batch: RolloutBatch) -> dict[str, float]:
    """Each reward function's mean and standard deviation over the step's completions that it scored (its None rows
    left out), as TRL logs them: `rewards/<name>/mean`, `rewards/<name>/std`; none for a function that scored no row."""
    out = {}
    for label, values in batch.reward_terms.items():
        scored = torch.tensor(dist.gather(values.tolist()), dtype=torch.float64)
        scored = scored[~scored.isnan()]
        if len(scored):
            out[f"rewards/{label}/mean"] = float(scored.mean())
            out[f"rewards/{label}/std"] = float(scored.std()) if len(scored) > 1 else 0.0
    return out


def speculation_metrics(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
    """A rollout's speculative decoding, from the sampler's counts before and after it (`speculation_counts`):
    the share of drafted tokens accepted, the tokens a row gained per verify step, and the share of the rollout's
    `tokens` that speculative steps produced; {} when none ran."""
    delta = {k: after[k] - before.get(k, 0) for k in after}
    if not delta.get("verify_steps"):
        return {}
    return {"speculative/acceptance": delta["accepted"] / max(delta["drafted"], 1),
            "speculative/tokens_per_step": delta["spec_tokens"] / max(delta["spec_row_steps"], 1),
            "speculative/token_share": delta["spec_tokens"] / max(tokens, 1)}
