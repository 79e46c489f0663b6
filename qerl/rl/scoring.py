"""Scoring a step's completions: the reward mix the loss learns from, and the plain grader's accuracy beside it."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from qerl import grading
from qerl.data import problems
from qerl.data.rewards import RewardFn, RewardTerm
from qerl.rl.batch import RolloutBatch
from qerl.rl.reward_calls import RewardCalls, RewardInputs, TrainerState


@dataclass
class PromptView:
    """How TRL-form reward functions see a step's prompts and completions, in TRL's dataset formats: conversational
    (the prompt's chat messages, each completion `[{"role": "assistant", "content": text}]`) or standard (the prompt
    text the policy continued, the completion's text)."""

    tokenizer: Any
    system_prompt: str | None
    conversational: bool

    @classmethod
    def for_format(cls, reward_format: str, tokenizer: Any, system_prompt: str | None) -> "PromptView":
        """`train.reward_format`: auto is conversational where prompts go through the tokenizer's chat template."""
        conversational = problems.uses_chat_template(tokenizer) if reward_format == "auto" else \
            reward_format == "conversational"
        return cls(tokenizer, system_prompt, conversational)

    def prompt(self, question: str) -> Any:
        if self.conversational:
            return problems.prompt_messages(question, self.system_prompt)
        return problems.build_prompt(self.tokenizer, question, self.system_prompt)

    def completion(self, text: str) -> Any:
        return [{"role": "assistant", "content": text}] if self.conversational else text


@dataclass
class Scorer:
    """Scores a `RolloutBatch` with `reward_fn`: the run's reward mix (`RewardCalls` over `train.rewards`), or one
    function of qerl's form `(completion, gold)` (called in the caller's thread, with no budget). `view` shows TRL-form
    functions the prompts and completions (None: standard text, the prompt being the question)."""

    reward_fn: RewardCalls | RewardFn
    view: PromptView | None = None

    @property
    def calls(self) -> RewardCalls:
        if isinstance(self.reward_fn, RewardCalls):
            return self.reward_fn
        return RewardCalls([RewardTerm("reward", self.reward_fn, 1.0, "qerl", "reward")], timeout_s=None)

    def __call__(self, batch: RolloutBatch, state: TrainerState | None = None) -> RolloutBatch:
        """Fill `rewards` (the reward mix), `reward_terms` (each function's values, NaN where it gave None) and
        `accuracy` (the plain grader) of every completion, and the time it took and the completions math-verify gave
        up on (scored 0). `state`: the step, for TRL's `trainer_state` and the error messages."""
        start, timeouts = time.perf_counter(), grading.stats()["timeouts"]
        golds = [ex.gold for ex in batch.examples for _ in range(batch.group_size)]
        texts = batch.samples.texts
        # The plain grader first, its math-verify requests in parallel over the worker pool: the reward mix's own
        # grading then finds their verdicts cached.
        batch.accuracy = torch.tensor([g.score for g in grading.grade_all(list(zip(texts, golds)))],
                                      dtype=torch.float32)
        calls = self.calls
        scores = calls(self._inputs(batch, calls, golds, state or TrainerState(0, 0)))
        batch.rewards = torch.tensor(scores.total, dtype=torch.float32)
        batch.reward_terms = {label: torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)
                              for label, values in scores.by_label.items()}
        batch.score_seconds = time.perf_counter() - start
        batch.grader_timeouts = grading.stats()["timeouts"] - timeouts
        return batch

    def close(self) -> None:
        if isinstance(self.reward_fn, RewardCalls):
            self.reward_fn.close()

    def _inputs(self, batch: RolloutBatch, calls: RewardCalls, golds: list[str], state: TrainerState) -> RewardInputs:
        rows = [ex for ex in batch.examples for _ in range(batch.group_size)]
        inputs = RewardInputs(prompts=[], completions=[], texts=batch.samples.texts, golds=golds, completion_ids=[],
                              columns={}, trainer_state=state, questions=[ex.question for ex in rows])
        if not calls.needs_trl_inputs:  # qerl's form reads texts and golds only
            return inputs
        if self.view is None:  # no tokenizer to render with: the questions, and the completions' text
            inputs.prompts, inputs.completions = list(inputs.questions), list(batch.samples.texts)
        else:
            rendered = [self.view.prompt(ex.question) for ex in batch.examples]  # once per prompt, as TRL repeats it
            inputs.prompts = [p for p in rendered for _ in range(batch.group_size)]
            inputs.completions = [self.view.completion(t) for t in batch.samples.texts]
        inputs.completion_ids = [list(ids) for ids in batch.samples.completion_ids]
        names = list(dict.fromkeys(k for ex in batch.examples for k in ex.columns))
        inputs.columns = {k: [ex.columns.get(k) for ex in rows] for k in names}
        if batch.samples.environments is not None:  # TRL's `environments`: the objects the factory made
            inputs.environments = [env.instance for env in batch.samples.environments]
        return inputs
