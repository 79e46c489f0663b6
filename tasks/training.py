"""The RL step as Prefect tasks over one in-process `Trainer`: `run_phases_as_tasks` makes its rollout, score, update
and export methods task runs (AQN inside the rollout), so the step (`Trainer.train_step`) and the loop (DAPO
resampling rounds included) stay the trainer's own.

The Trainer, its model and the rollout batches stay in this process: none of these tasks caches or persists its result
(gigabytes of weights and tensors do not belong in Prefect's result store, and they are not reusable across runs).
State that must survive a crash is the trainer's own checkpoint in the run folder.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote

from qerl.config import Settings
from qerl.rl.tracking import Tracker
from qerl.tasks.retry import retry_transient

_IN_PROCESS = dict(cache_policy=NO_CACHE, persist_result=False)


@task(name="load-trainer", retries=1, retry_delay_seconds=5, retry_condition_fn=retry_transient, **_IN_PROCESS)
def build_trainer(settings: Settings, out_dir: str, tracker: Tracker | None = None, resume: bool = False,
                  init_adapter: str | None = None, overwrite: bool = False):
    """Load the (quantized) base, attach LoRA, and optionally start from an existing adapter's weights. The trainer
    holds the run folder's lock until the caller's `trainer.close()`."""
    from qerl.model import lora
    from qerl.rl.trainer import Trainer

    trainer = Trainer(settings, out_dir, tracker=tracker, resume=resume, overwrite=overwrite)
    if init_adapter is not None and trainer.step == 0:
        try:
            lora.load_adapter(trainer.model, init_adapter)  # copies in place: the optimizer keeps its parameters
        except BaseException:
            trainer.close()
            raise
    return trainer


# The trainer's phases (its methods, called by `Trainer.train_step` and `Trainer.train`) and the task each runs as.
# Retries only for faults of I/O (`retry_transient`): a phase that failed on a bug fails the same way again.
_TRANSIENT = dict(retries=2, retry_delay_seconds=5, retry_condition_fn=retry_transient)
PHASE_TASKS = {
    # `group_size` completions per prompt from the policy, AQN noise in the norm weights (σ of this step); a DAPO
    # resampling round (round_ > 0) is a task of its own.
    "rollout": dict(name="generate-rollouts", **_TRANSIENT),
    # Rewards (the `train.rewards` mix) and accuracy of every completion.
    "score": dict(name="score-rewards", **_TRANSIENT),
    # The policy-gradient update of the LoRA weights. No retries: a failure after the optimizer step would apply it
    # twice. Resume from the last checkpoint instead.
    "update": dict(name="grpo-update"),
    # The final adapter (PEFT format) and the training-curve PNGs, in the run folder.
    "export": dict(name="export-adapter", **_TRANSIENT),
}


def run_phases_as_tasks(trainer) -> None:
    """From now on `trainer` runs each phase of `PHASE_TASKS` as a Prefect task: the method is replaced, on this one
    instance, by a task around the original bound method. The step and the loop (DAPO rounds, checkpoints,
    evaluation points) stay the trainer's, which knows nothing of Prefect."""
    for name, options in PHASE_TASKS.items():
        setattr(trainer, name, as_task(getattr(trainer, name), **options, **_IN_PROCESS))


def as_task(method: Callable[..., Any], **options) -> Callable[..., Any]:
    """`method` called as a Prefect task run (`options`: the task's). Its arguments go in `quote`d: Prefect need not
    walk a batch's tensors, and it unwraps them before the call."""
    run = task(**options)(method)

    @functools.wraps(method)
    def call(*args, **kwargs):
        return run(*map(quote, args), **{k: quote(v) for k, v in kwargs.items()})

    return call


# No retries: a failed multi-process run continues from its checkpoint (resume), not from step 0.
@task(name="torchrun-train", **_IN_PROCESS)
def torchrun_train(nproc: int, qerl_args: list[str]) -> None:
    """`qerl <qerl_args>` (a `train` command) over `nproc` processes with torchrun; its output goes to the run's log,
    and a non-zero exit fails the task with the ranks' last lines."""
    from qerl.rl.launch import run_qerl

    run_qerl(nproc, qerl_args, get_run_logger().info)
