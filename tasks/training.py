"""The RL step as Prefect tasks over one in-process `Trainer`: rollout -> score -> GRPO update (AQN inside). The
training flow hands them to `Trainer.train` as its phases, so the loop (DAPO resampling rounds included) is the
trainer's own.

The Trainer, its model and the rollout batches stay in this process: none of these tasks caches or persists its result
(gigabytes of weights and tensors do not belong in Prefect's result store, and they are not reusable across runs).
State that must survive a crash is the trainer's own checkpoint in the run folder.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

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


@task(name="generate-rollouts", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_transient, **_IN_PROCESS)
def generate_rollouts(trainer, round_: int = 0):
    """`group_size` completions per prompt from the policy, AQN noise in the norm weights (σ of this step); `round_`
    > 0 is a DAPO resampling round of the same step."""
    return trainer.rollout(round_=round_)


@task(name="score-rewards", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_transient, **_IN_PROCESS)
def score_rewards(trainer, batch):
    """Rewards (the `train.rewards` mix) and accuracy of every completion."""
    return trainer.score(batch)


# No retries: a failure after the optimizer step would apply it twice. Resume from the last checkpoint instead.
@task(name="grpo-update", **_IN_PROCESS)
def grpo_update(trainer, batch) -> dict[str, float]:
    """The policy-gradient update of the LoRA weights; logs the step's metrics and checkpoints when due."""
    return trainer.finish_step(batch)


@task(name="export-adapter", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_transient, **_IN_PROCESS)
def export_adapter(trainer) -> tuple[Path, list[Path]]:
    """The final adapter (PEFT format) and the training-curve PNGs, in the run folder."""
    adapter = trainer.export_adapter(trainer.out / "adapter")
    return adapter, trainer.write_plots()


# No retries: a failed multi-process run continues from its checkpoint (resume), not from step 0.
@task(name="torchrun-train", **_IN_PROCESS)
def torchrun_train(nproc: int, qerl_args: list[str]) -> None:
    """`qerl <qerl_args>` (a `train` command) over `nproc` processes with torchrun; its output goes to the run's log,
    and a non-zero exit fails the task with the ranks' last lines."""
    from qerl.rl.launch import run_qerl

    run_qerl(nproc, qerl_args, get_run_logger().info)
