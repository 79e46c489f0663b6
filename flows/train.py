"""The training flow: quantize -> N x (rollout -> score -> GRPO update) with periodic evaluation -> final evaluation ->
adapter logged and registered in MLflow.

    python -m qerl.flows.train --params params/tiny.yaml -S tracking.backend=mlflow [--out DIR] [--max-steps N]
"""

from __future__ import annotations

from qerl.flows import startup  # noqa: F401 (first of all: the process's settings, before Prefect, MLflow, torch)

import argparse
import contextlib
import dataclasses
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from qerl.flows import cli, prefect_api
from qerl.flows.tracking import MlflowTracker, Registry, open_tracker, probe, resolve_tracking_uri
from qerl.config import ConfigError, Settings, load_settings, require_extras
from qerl.evaluation.evaluate import eval_examples
from qerl.rl.plots import REWARD_CURVE, TRAINING_CURVES
from qerl.rl.stopping import TrainingStopped
from qerl.rl.tracking import log_step
from qerl.run.lock import FolderLock, run_folder_lock
from qerl.run.metrics import MetricsLog
from qerl.tasks.evaluation import evaluate
from qerl.tasks.quantize import is_complete, quantize_checkpoint
from qerl.tasks.training import build_trainer, run_phases_as_tasks, torchrun_train

QUANTIZED_ROOT = "runs/quantized"  # quantized bases, one folder per (source, scheme, codec version), shared by runs
EVAL_METRIC = "accuracy"  # what "better" means when the retrain flow compares adapters (higher is better)


@dataclass
class TrainOutcome:
    out_dir: str
    adapter: str
    steps: int
    eval: dict[str, float]
    run_id: str | None = None
    model_version: str | None = None


def describe(settings: Settings) -> str:
    """What kind of run it is: nvfp4-aqn, bf16-lora, ..."""
    return f"{settings.quant.scheme}-{'aqn' if settings.aqn.enabled else 'lora'}"


def settings_hash(settings: Settings) -> str:
    """Six hex digits that tell two runs' settings apart (where results go and tracking aside)."""
    return settings.fingerprint(*(f.name for f in dataclasses.fields(settings) if f.name != "tracking"))[:6]


def shown_overrides(overrides: list[str]) -> list[str]:
    """The `-S` overrides that make a run differ: tracking's (e.g. the deployment's tracking.backend=mlflow) do not."""
    return [o for o in overrides if not o.strip().startswith("tracking.")]


def run_name(settings: Settings, params: str, overrides: list[str], prefix: str = "") -> str:
    """A run name that says what differs, for `mlflow ui`'s list and compare page: kind, params file, overrides and
    the settings' short hash, e.g. `nvfp4-aqn default optim.lr=1e-4 3fa2c1` (`tracking.run_name` wins)."""
    if settings.tracking.run_name:
        return settings.tracking.run_name
    return " ".join([prefix + describe(settings), Path(params).stem, *shown_overrides(overrides),
                     settings_hash(settings)])


def run_tags(settings: Settings, params: str, overrides: list[str], **extra: Any) -> dict[str, str]:
    """Tags to filter runs by in MLflow (e.g. `tags.qerl.params = 'tiny'`, `tags.qerl.settings_hash = '3fa2c1'`)."""
    from prefect.runtime import flow_run

    tags = {"quant.scheme": settings.quant.scheme, "aqn.enabled": settings.aqn.enabled,
            "model.path": settings.model.path, "prefect.flow_run_id": flow_run.id, "qerl.params": Path(params).stem,
            "qerl.params_file": params, "qerl.overrides": " ".join(shown_overrides(overrides)) or None,
            "qerl.settings_hash": settings_hash(settings), **extra}
    return {k: str(v) for k, v in tags.items() if v is not None}


def with_quantized_base(settings: Settings, quantized_root: str) -> Settings:
    """Settings whose base is a quantized folder (made once, then cached); bf16, given folders and bases that exist only
    quantized at load (per-layer schemes, error correction: no folder holds them) pass through."""
    q = settings.quant
    if q.scheme == "bf16" or q.quantized_path or q.quantized_at_load_only:
        return settings
    folder = quantize_checkpoint(settings.model.path, q.scheme, quantized_root)
    if not is_complete(folder):  # cached, but the folder was deleted since: quantize again
        folder = quantize_checkpoint.with_options(refresh_cache=True)(settings.model.path, q.scheme, quantized_root)
    return dataclasses.replace(settings, quant=dataclasses.replace(q, quantized_path=folder))


def claim_run_folder(out_dir: str, nproc: int = 1) -> FolderLock | contextlib.AbstractContextManager:
    """The run folder's lock, taken before MLflow and Prefect do any work: a second flow on the folder fails here in
    one line naming the holder, not inside MLflow's database set-up or after Prefect's start-up. The trainer this
    process builds joins it (`hand_over`); over several processes the torchrun job takes it itself, so here the
    folder is only checked free. Release it (or leave the `with` block) after the trainer has closed."""
    lock = run_folder_lock(out_dir, hand_over=True).acquire()
    if nproc > 1:
        lock.release()
        # Not the lock itself: a `with` on a released lock takes it again, and the torchrun job would find its
        # own folder in use by this process.
        return contextlib.nullcontext(lock)
    return lock


def default_out_dir(settings: Settings) -> str:
    """A fresh folder per flow run (the trainer refuses to overwrite a previous run without --overwrite)."""
    return str(Path(settings.train.out_dir) / time.strftime("%Y%m%d-%H%M%S"))


def train_and_evaluate(settings: Settings, out_dir: str, tracker, *, quantized_root: str = QUANTIZED_ROOT,
                       max_steps: int | None = None, resume: bool = False, init_adapter: str | None = None,
                       before_training=None, overwrite: bool = False) -> TrainOutcome:
    """The body both training flows share. `before_training(trainer)` runs once the policy is loaded (the retrain
    flow evaluates the champion there, on the same in-process model)."""
    eval_examples(settings)  # the final evaluation's data: a bad eval.n fails now, not after the training
    settings = with_quantized_base(settings, quantized_root)
    trainer = build_trainer(settings, out_dir, tracker, resume=resume, init_adapter=init_adapter, overwrite=overwrite)
    try:
        return _train_and_evaluate(trainer, settings, out_dir, tracker, max_steps, before_training)
    finally:
        trainer.close()  # the run folder's lock: held through the final evaluation, which writes into the folder


def _train_and_evaluate(trainer, settings: Settings, out_dir: str, tracker, max_steps: int | None,
                        before_training) -> TrainOutcome:
    if before_training is not None:
        before_training(trainer)
    run_phases_as_tasks(trainer)
    trainer.evaluate = functools.partial(evaluate_between_steps, trainer, settings, Path(out_dir), tracker)
    adapter = trainer.train(max_steps)
    return evaluate_and_log(settings, Path(out_dir), tracker, adapter, plots(Path(out_dir)), trainer.step,
                            policy=dict(model=trainer.model, tokenizer=trainer.tokenizer))


def evaluate_between_steps(trainer, settings: Settings, out: Path, tracker) -> None:
    """`Trainer.evaluate` in the flow: the `evaluate` task on the in-process model, logged to the run's tracker."""
    result = evaluate(settings, out_dir=str(out / "eval" / f"step-{trainer.step:06d}"), model=trainer.model,
                      tokenizer=trainer.tokenizer)
    log_eval(tracker, result.metrics, trainer.step)


def plots(out: Path) -> list[Path]:
    """The training-curve PNGs the run wrote into its folder."""
    return [path for path in (out / REWARD_CURVE, out / TRAINING_CURVES) if path.is_file()]


def train_over_processes(settings: Settings, params: str, overrides: list[str], out_dir: str, tracker, nproc: int, *,
                         quantized_root: str = QUANTIZED_ROOT, max_steps: int | None = None, resume: bool = False,
                         overwrite: bool = False) -> TrainOutcome:
    """`qerl train` over `nproc` processes (torchrun: the data-parallel trainer), then what a one-process run does
    after its loop, from the run folder the job wrote: its parameters and per-step metrics into the tracker (the job
    itself tracks nothing), the final evaluation of the base + adapter, the artifacts. No evaluations between steps:
    the job's ranks train only."""
    eval_examples(settings)  # the final evaluation's data: a bad eval.n fails now, not after the training
    settings = with_quantized_base(settings, quantized_root)
    if settings.train.eval_every:
        get_run_logger().warning("train.eval_every=%d: no evaluations between steps over %d processes, only the "
                                 "final one", settings.train.eval_every, nproc)
    torchrun_train(nproc, qerl_train_args(settings, params, overrides, out_dir, max_steps, resume, overwrite))
    out = Path(out_dir)
    records = MetricsLog(out / "metrics.jsonl").read()
    tracker.log_params(settings.to_flat_dict())
    for record in records:
        log_step(tracker, record)
    adapter = out / "adapter"
    return evaluate_and_log(settings, out, tracker, adapter, plots(out), records[-1]["step"] if records else 0,
                            policy=dict(adapter=str(adapter)))


def qerl_train_args(settings: Settings, params: str, overrides: list[str], out_dir: str, max_steps: int | None,
                    resume: bool, overwrite: bool) -> list[str]:
    """The `qerl train` arguments of this flow's run: its params and overrides, and the quantized base it made."""
    args = ["train", "--params", params, "--out", out_dir]
    quantized = [f"quant.quantized_path={settings.quant.quantized_path}"] if settings.quant.quantized_path else []
    for override in [*overrides, *quantized]:
        args += ["-S", override]
    if max_steps is not None:
        args += ["--max-steps", str(max_steps)]
    return args + (["--resume"] if resume else []) + (["--overwrite"] if overwrite else [])


def evaluate_and_log(settings: Settings, out: Path, tracker, adapter: Path, plots: list[Path], step: int,
                     policy: dict[str, Any]) -> TrainOutcome:
    """What follows training however it ran: the final evaluation of the policy (`policy`: the `evaluate` task's
    model and tokenizer in process, or the adapter folder to load on the base), its metrics and per-sample table,
    the plots, metrics.jsonl and the adapter, all logged."""
    result = evaluate(settings, out_dir=str(out / "eval" / "final"), **policy)
    log_eval(tracker, result.metrics, step)
    tracker.log_table(result.records, artifact_file="eval/samples.json")
    for png in plots:
        tracker.log_artifact(png, "plots")
    tracker.log_artifact(out / "metrics.jsonl")
    tracker.log_artifact(adapter, "adapter")
    get_run_logger().info("step %d: eval %s = %.4f, adapter %s", step, EVAL_METRIC, result.metrics[EVAL_METRIC],
                          adapter)
    return TrainOutcome(str(out), str(adapter), step, result.metrics, tracker.run_id)


def log_eval(tracker, metrics: dict[str, float], step: int, prefix: str = "eval") -> None:
    tracker.log_metrics({f"{prefix}/{k}": v for k, v in metrics.items()}, step=step)


@flow(name="qerl-train", log_prints=True)
def train(params: str = "params/default.yaml", overrides: list[str] | None = None, out_dir: str | None = None,
          max_steps: int | None = None, resume: bool = False, quantized_root: str = QUANTIZED_ROOT,
          overwrite: bool = False, nproc: int = 1) -> dict:
    """Train a LoRA adapter on the quantized base (params file + `section.key=value` overrides), evaluate it, and
    register it as a new version of `tracking.registered_model` (the first one becomes the champion).

    `nproc` > 1: the training runs as `qerl train` over that many processes (torchrun, one GPU each; gloo on the
    CPU), then the same evaluation, logging and registration follow."""
    if nproc < 1:
        raise ConfigError(f"nproc={nproc}: must be >= 1 (the number of training processes)")
    settings = load_settings(params, overrides or [])
    if resume and out_dir is None:
        raise ConfigError("resume=True needs out_dir: the run folder whose checkpoints to continue from")
    out_dir = out_dir or default_out_dir(settings)
    with claim_run_folder(out_dir, nproc), \
            open_tracker(settings, run_name=run_name(settings, params, overrides or []),
                         tags=run_tags(settings, params, overrides or [],
                                       **{"qerl.flow": "train", "out_dir": out_dir}),
                         folder=out_dir, resume=resume) as tracker:  # resumed: the same MLflow run
        if nproc == 1:
            outcome = train_and_evaluate(settings, out_dir, tracker, quantized_root=quantized_root,
                                         max_steps=max_steps, resume=resume, overwrite=overwrite)
        else:
            outcome = train_over_processes(settings, params, overrides or [], out_dir, tracker, nproc,
                                           quantized_root=quantized_root, max_steps=max_steps, resume=resume,
                                           overwrite=overwrite)
        if isinstance(tracker, MlflowTracker):
            outcome.model_version = register(tracker, settings, outcome)
    return dataclasses.asdict(outcome)


def register(tracker: MlflowTracker, settings: Settings, outcome: TrainOutcome) -> str:
    """A new registry version carrying its eval metric; the very first version also becomes the champion."""
    logger = get_run_logger()
    name = settings.tracking.registered_model
    version = tracker.register_adapter(name, tags={f"eval.{EVAL_METRIC}": outcome.eval[EVAL_METRIC],
                                                   "quant.scheme": settings.quant.scheme})
    tracker.set_tags({"registered_model": name, "model_version": version})
    registry = Registry(tracker.tracking_uri, name)
    if registry.champion() is None:
        registry.promote(version)
        logger.info("registered %s version %s and made it the champion (there was none)", name, version)
    else:
        logger.info("registered %s version %s (the champion alias is unchanged: the retrain flow moves it)", name,
                    version)
    return version


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="run folder (default: <train.out_dir>/<timestamp>)")
    parser.add_argument("--max-steps", type=int, default=None)
    again = parser.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue the run in --out from its newest intact checkpoint")
    again.add_argument("--overwrite", action="store_true", help="delete a previous run's outputs in --out first")
    parser.add_argument("--nproc", type=int, default=1,
                        help="training processes (torchrun, one GPU each; default 1: in the flow's process)")


def _run(args: argparse.Namespace) -> str:
    settings = load_settings(args.params, args.overrides)
    require_extras(settings)  # a package the params need (vLLM, bitsandbytes): before any server or model starts
    if args.resume and args.out is None:
        raise ConfigError("--resume needs --out: the run folder whose checkpoints to continue from")
    out_dir = args.out or default_out_dir(settings)
    with claim_run_folder(out_dir, args.nproc):  # first: a folder in use fails before MLflow and Prefect start
        if settings.tracking.backend == "mlflow":
            probe(resolve_tracking_uri(settings))  # fail in a line, before Prefect and the model start up
        prefect_api.connect()
        try:
            result = train(args.params, args.overrides, out_dir, args.max_steps, args.resume,
                           overwrite=args.overwrite, nproc=args.nproc)
        except TrainingStopped as stop:  # SIGTERM / Ctrl-C: checkpoint written; its line says how to continue
            stop.resume_with(["python", "-m", "qerl.flows.train"], args.params, args.overrides, out_dir, args.max_steps)
            raise
    return (f"adapter: {result['adapter']}  eval {EVAL_METRIC}: {result['eval'][EVAL_METRIC]:.4f}"
            + (f"  mlflow run {result['run_id']}, version {result['model_version']}" if result["run_id"] else ""))


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, module="qerl.flows.train", doc=__doc__, arguments=_arguments, run=_run)

if __name__ == "__main__":
    sys.exit(main())
