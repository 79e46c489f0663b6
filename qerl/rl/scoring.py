"""Scoring a step's completions: the reward mix the loss learns from, and the plain grader's accuracy beside it."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from qerl import grading
from qerl.data.rewards import RewardFn
from qerl.rl.batch import RolloutBatch


@dataclass
class Scorer:
    """Scores a `RolloutBatch` with `reward_fn` (the run's weighted reward mix, `rewards.combined_reward`)."""

    reward_fn: RewardFn

    def __call__(self, batch: RolloutBatch) -> RolloutBatch:
        """Fill `rewards` (the reward mix) and `accuracy` (the plain grader) of every completion, and the time it took
        and the completions math-verify gave up on (scored 0)."""
        start, timeouts = time.perf_counter(), grading.stats()["timeouts"]
        golds = [ex.gold for ex in batch.examples for _ in range(batch.group_size)]
        texts = batch.samples.texts
        # The plain grader first, its math-verify requests in parallel over the worker pool: the reward mix's own
        # grading then finds their verdicts cached.
        batch.accuracy = torch.tensor([g.score for g in grading.grade_all(list(zip(texts, golds)))],
                                      dtype=torch.float32)
        batch.rewards = torch.tensor([self.reward_fn(t, g) for t, g in zip(texts, golds)], dtype=torch.float32)
        batch.score_seconds = time.perf_counter() - start
        batch.grader_timeouts = grading.stats()["timeouts"] - timeouts
        return batch
