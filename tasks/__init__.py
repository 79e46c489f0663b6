"""Prefect tasks: thin wrappers over the qerl core (retries for transient faults, caching only where it is safe)."""

from qerl.tasks.data import find_newest_data
from qerl.tasks.evaluation import evaluate
from qerl.tasks.quantize import quantize_checkpoint
from qerl.tasks.training import (build_trainer, export_adapter, generate_rollouts, grpo_update, score_rewards,
                            torchrun_train)

__all__ = ["quantize_checkpoint", "build_trainer", "generate_rollouts", "score_rewards", "grpo_update",
           "export_adapter", "torchrun_train", "evaluate", "find_newest_data"]
