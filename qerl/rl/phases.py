"""How `Trainer.train` runs the phases of its loop: `Phases` calls each one directly (the `qerl train` command line);
an orchestrator subclasses it to wrap each phase (the Prefect training flow runs each as a task) while the loop itself,
its DAPO resampling rounds, its checkpoints and its evaluation points, stays the trainer's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qerl.trainer import RolloutBatch, Trainer


class Phases:
    def rollout(self, trainer: Trainer, round_: int) -> RolloutBatch:
        """Sample the step's completions (`round_` > 0: a DAPO resampling round of the same step)."""
        return trainer.rollout(round_=round_)

    def score(self, trainer: Trainer, batch: RolloutBatch) -> RolloutBatch:
        return trainer.score(batch)

    def finish_step(self, trainer: Trainer, batch: RolloutBatch) -> dict[str, float]:
        """The update, the step's metrics and its checkpoint when due."""
        return trainer.finish_step(batch)

    def evaluate(self, trainer: Trainer) -> None:
        """An evaluation due after this step (every `train.eval_every` steps, the run's last step excepted: what
        follows training evaluates that one). None here: the command line trains only; the flows evaluate."""

    def export(self, trainer: Trainer) -> Path:
        """The run's outputs once the loop is done (rank 0 only): the final adapter folder and the plots."""
        adapter = trainer.export_adapter(trainer.out / "adapter")
        trainer.write_plots()
        return adapter
