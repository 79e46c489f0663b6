"""What passes between the phases of a training step (`qerl.rl.trainer.Trainer.train_step`): a `RolloutBatch`, the
step's samples as the rollout returns them, filled in by the scorer and read by the update."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from qerl.data.example import Example
from qerl.rollout.sampling import Rollout


@dataclass
class RolloutBatch:
    """One step's samples: `group_size` completions per example, flattened group by group, and what the trainer
    adds to the sampler's `Rollout`: the AQN noise they were drawn under, their scores and timings."""

    examples: list[Example]
    group_size: int
    samples: Rollout  # one row per completion: `group_size` rows per example, in order
    sigma: float
    noise_seed: int
    seconds: float
    rewards: Tensor | None = None
    # each reward function's values by its metric label (`rewards/<label>/mean`), NaN where it returned None
    reward_terms: dict[str, Tensor] = field(default_factory=dict)
    accuracy: Tensor | None = None
    score_seconds: float = 0.0
    grader_timeouts: int = 0  # completions scored 0: math-verify went over its CPU budget (qerl.grading)
    extra: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.samples.texts)

    def select_groups(self, keep: list[int]) -> "RolloutBatch":
        """The batch restricted to the groups (examples) at indices `keep`."""
        rows = [i * self.group_size + j for i in keep for j in range(self.group_size)]
        return replace(
            self, examples=[self.examples[i] for i in keep], samples=self.samples.select(rows),
            rewards=None if self.rewards is None else self.rewards[rows],
            reward_terms={label: values[rows] for label, values in self.reward_terms.items()},
            accuracy=None if self.accuracy is None else self.accuracy[rows], extra=dict(self.extra))

    def padded(self, pad_id: int) -> dict[str, Tensor | int]:
        """The rows as the update reads them, laid out as TRL does: prompts left-padded to P columns, completions
        right-padded after them (all completions start at one column). ids, attn [B, P + C] (1 = real token),
        mask [B, C] (the completion tokens the model sampled, float: a multi-turn rollout's tool turns are 0 there,
        context but never trained on, `Rollout.generated_mask`), rollout_logp [B, C] (the sampler's log-probs), P."""
        samples = self.samples
        P = max(len(p) for p in samples.prompt_ids)
        C = max(1, max(len(c) for c in samples.completion_ids))
        B = len(self)
        ids = torch.full((B, P + C), pad_id, dtype=torch.long)
        attn = torch.zeros((B, P + C), dtype=torch.long)
        rollout_lp = torch.zeros((B, C))
        mask = torch.zeros((B, C))
        for i, (p, c, lp, m) in enumerate(zip(samples.prompt_ids, samples.completion_ids, samples.logprobs,
                                              samples.masks())):
            ids[i, P - len(p):P] = torch.tensor(p)
            ids[i, P:P + len(c)] = torch.tensor(c, dtype=torch.long)
            attn[i, P - len(p):P + len(c)] = 1
            rollout_lp[i, :len(c)] = lp.float().cpu()
            mask[i, :len(c)] = m.float()
        return {"ids": ids, "attn": attn, "mask": mask, "rollout_logp": rollout_lp, "P": P}

    @staticmethod
    def concat(batches: list["RolloutBatch"]) -> "RolloutBatch":
        """The batches one after the other; sigma and noise seed are the first's, times are summed, extras dropped."""
        first = batches[0]
        return RolloutBatch(
            examples=[ex for b in batches for ex in b.examples], group_size=first.group_size,
            samples=Rollout.concat([b.samples for b in batches]), sigma=first.sigma, noise_seed=first.noise_seed,
            seconds=sum(b.seconds for b in batches),
            rewards=torch.cat([b.rewards for b in batches]) if first.rewards is not None else None,
            reward_terms={label: torch.cat([b.reward_terms[label] for b in batches]) for label in first.reward_terms},
            accuracy=torch.cat([b.accuracy for b in batches]) if first.accuracy is not None else None,
            score_seconds=sum(b.score_seconds for b in batches),
            grader_timeouts=sum(b.grader_timeouts for b in batches))
