"""The retraining flow: continue the registered champion adapter on the newest data, evaluate it against the champion
on the same evaluation set, and move the `champion` alias only if the new adapter is better.

    python -m qerl.flows.retrain --params params/default.yaml [--data-dir data/incoming] [--min-improvement 0.01]
        [--out DIR [--resume]]

A retrain stopped by SIGTERM or Ctrl-C after a checkpoint prints the command that continues it (`--resume`: the same
params, -S overrides, data folder, margin and run folder; its MLflow run reopened).
"""

from __future__ import annotations

from qerl.flows import startup  # noqa: F401 (first of all: the process's settings, before Prefect, MLflow, torch)

import argparse
import dataclasses
import sys
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.states import Failed

from qerl.flows import cli, prefect_api
from qerl.flows.tracking import CHAMPION, Registry, open_tracker, probe, resolve_tracking_uri
from qerl.flows.train import (EVAL_METRIC, QUANTIZED_ROOT, claim_run_folder, default_out_dir, log_eval, run_name,
                              run_tags, train_and_evaluate)
from qerl.config import ConfigError, Settings, load_settings
from qerl.rl.stopping import TrainingStopped
from qerl.tasks.data import find_newest_data
from qerl.tasks.evaluation import evaluate


class NoChampion(LookupError):
    """The registered model has no `champion` alias yet."""


class ChampionMismatch(ConfigError):
    """The champion was trained on another base (model or quantization) than the settings name: exit 2."""


# What the champion's adapter is continued with, whatever the params say: its shape and how it is scaled (the
# adapter's weights only fit these). The other settings (data, rollout, optimizer) are the retrain's own.
ADAPTER_KEYS = ("lora.",)
BASE_KEYS = ("model.path", "quant.scheme")  # an adapter continues only on the base it was trained on


def champion_overrides(recorded: dict[str, str], settings: Settings, version: str) -> list[str]:
    """`section.key=value` overrides that give `settings` the champion's adapter settings, from the parameters its
    MLflow run recorded. A champion on another base is refused in one line that says what to do: a smoke run
    registered as the champion of a team's model used to fail every nightly retrain on the adapter's shape."""
    flat = {k: str(v) for k, v in settings.to_flat_dict().items()}
    other_base = {k: recorded[k] for k in BASE_KEYS if k in recorded and recorded[k] != flat[k]}
    if other_base:
        said = ", ".join(f"{k}={flat[k]}" for k in other_base)
        raise ChampionMismatch(
            f"champion version {version} of {settings.tracking.registered_model!r} was trained on "
            f"{', '.join(f'{k}={v}' for k, v in other_base.items())}, not {said}: retrain with its base (-S "
            f"{' -S '.join(f'{k}={v}' for k, v in other_base.items())}), or train an adapter on this base with "
            f"qerl.flows.train and move the {CHAMPION!r} alias to its version (MLflow UI, Models)")
    return [f"{k}={v}" for k, v in recorded.items() if k.startswith(ADAPTER_KEYS) and v != flat.get(k)]


def require_champion(registry: Registry, params: str):
    """The champion's ModelVersion, or NoChampion saying how to make one. A user who had just run the README's smoke
    run (params/tiny.yaml) met "run the train flow first": the smoke run registers as `qerl-smoke`, which the
    nightly's params never continue; the line names the command for these params and the store's other models."""
    champion = registry.champion()
    if champion is None:
        others = registry.other_models()
        raise NoChampion(
            f"registered model {registry.name!r} has no {CHAMPION!r} version yet: run the train flow on these params "
            f"first (python -m qerl.flows.train --params {params} -S tracking.backend=mlflow, or the train-embedded "
            "deployment); its first registered adapter becomes the champion"
            + (f". Not {', '.join(map(repr, others))}: each params file registers under its own "
               "tracking.registered_model, and smoke runs (params/tiny.yaml) register as 'qerl-smoke'" if others else ""))
    return champion


def beats(candidate: float, champion: float, min_improvement: float = 0.0) -> bool:
    """Promotion rule: strictly better than the champion by more than `min_improvement` (ties keep the champion)."""
    return candidate > champion + min_improvement


def margin(min_improvement: float) -> str:
    """The verdict's margin clause: none for the default 0 (a plain "beats")."""
    return f" by more than {min_improvement:g}" if min_improvement else ""


@flow(name="qerl-retrain", log_prints=True)
def retrain(params: str = "params/default.yaml", overrides: list[str] | None = None, data_dir: str = "data/incoming",
            min_improvement: float = 0.0, out_dir: str | None = None,
            quantized_root: str = QUANTIZED_ROOT, resume: bool = False) -> dict:
    """Fine-tune the champion on the newest `*.jsonl` in `data_dir` (else the params' data), then promote or keep.

    Both adapters are scored in this run on the current evaluation set, so the comparison is like for like.
    `resume`: continue the stopped retrain in `out_dir` from its newest checkpoint, in the same MLflow run.
    Returns {"promoted": bool, "champion_version", "candidate_version", "candidate": metric, "champion": metric, ...};
    without a champion, a Failed state whose message says what to run (called directly, the flow raises FailedRun).
    """
    logger = get_run_logger()
    if resume and out_dir is None:
        raise ConfigError("resume=True needs out_dir: the run folder whose checkpoints to continue from")
    overrides = list(overrides or [])
    given = list(overrides)  # the caller's, for the run's name and tags (the data and the champion's are tagged apart)
    newest = find_newest_data(data_dir)
    if newest:
        overrides += [f"data.name={newest}", "data.n=null", "data.path=null"]  # path belongs to gsm8k/math500 names
        logger.info("training on the newest data: %s", newest)
    else:
        logger.info("no *.jsonl in %s: training on the data the params name", data_dir)
    overrides.append("tracking.backend=mlflow")  # the registry lives in MLflow
    settings = load_settings(params, overrides)
    out_dir = out_dir or default_out_dir(settings)
    with claim_run_folder(out_dir):  # before the registry and MLflow: a folder in use fails here, in a line
        registry = Registry.from_settings(settings)
        try:
            champion = require_champion(registry, params)
        except NoChampion as refusal:
            # An expected refusal, not a crash: a Failed state with the line as its message. Raised, it put two
            # Prefect tracebacks in the worker's log (the engine's "Encountered exception", then the process's).
            return Failed(message=str(refusal))
        champion_version = str(champion.version)
        adopted = champion_overrides(registry.recorded_settings(champion), settings, champion_version)
        if adopted:
            settings = load_settings(params, overrides + adopted)
            logger.info("continuing champion version %s with its own adapter settings: %s", champion_version,
                        " ".join(adopted))
        champion_adapter = str(registry.download(champion, Path(out_dir) / "champion"))
        logger.info("continuing from %s version %s (run %s)", registry.name, champion_version, champion.run_id)

        scores: dict[str, float] = {}

        def score_champion(trainer) -> None:
            # At step 0 the trainer's policy is the champion's, untrained yet: scored in process. A resumed run's
            # holds its checkpoint's adapter: the champion is then scored from its folder.
            policy = dict(model=trainer.model, tokenizer=trainer.tokenizer) if trainer.step == 0 else \
                dict(adapter=champion_adapter)
            result = evaluate(settings, out_dir=str(Path(out_dir) / "eval" / "champion"), **policy)
            scores["champion"] = result.metrics[EVAL_METRIC]
            log_eval(tracker, result.metrics, trainer.step, prefix="champion_eval")

        tags = run_tags(settings, params, given, **{"qerl.flow": "retrain", "out_dir": out_dir,
                                                     "parent_version": champion_version, "data": newest})
        with open_tracker(settings, run_name=run_name(settings, params, given, prefix="retrain-"), tags=tags,
                          folder=out_dir, resume=resume) as tracker:  # resumed: the same MLflow run
            outcome = train_and_evaluate(settings, out_dir, tracker, quantized_root=quantized_root, resume=resume,
                                         init_adapter=champion_adapter, before_training=score_champion)
            candidate = outcome.eval[EVAL_METRIC]
            promoted = beats(candidate, scores["champion"], min_improvement)
            version = tracker.register_adapter(registry.name, tags={f"eval.{EVAL_METRIC}": candidate,
                                                                    "parent_version": champion_version,
                                                                    "promoted": promoted})
            if promoted:
                registry.promote(version)
                verdict = (f"promoted {registry.name} version {version} to {CHAMPION}: {EVAL_METRIC} {candidate:.4f} "
                           f"beats version {champion_version}'s {scores['champion']:.4f}{margin(min_improvement)}")
            else:
                verdict = (f"kept {CHAMPION} version {champion_version}: candidate version {version} {EVAL_METRIC} "
                           f"{candidate:.4f} does not beat {scores['champion']:.4f}{margin(min_improvement)}")
            logger.info(verdict)
            tracker.set_tags({"promoted": promoted, "model_version": version, "verdict": verdict})
            tracker.log_metrics({"promoted": float(promoted)}, step=outcome.steps)
        return {"promoted": promoted, "verdict": verdict, "champion_version": version if promoted else champion_version,
                "candidate_version": version, "previous_champion_version": champion_version, "candidate": candidate,
                "champion": scores["champion"], **{k: v for k, v in dataclasses.asdict(outcome).items() if k != "eval"}}


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", default="data/incoming", help="the newest *.jsonl here is trained on")
    parser.add_argument("--min-improvement", type=float, default=0.0, help="margin the candidate must beat by")
    parser.add_argument("--out", default=None, help="run folder (default: <train.out_dir>/<timestamp>)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the stopped retrain in --out from its newest intact checkpoint")


def _run(args: argparse.Namespace) -> str:
    settings = load_settings(args.params, args.overrides)
    if args.resume and args.out is None:
        raise ConfigError("--resume needs --out: the run folder whose checkpoints to continue from")
    out_dir = args.out or default_out_dir(settings)
    with claim_run_folder(out_dir):  # first: a folder in use fails before MLflow and Prefect start
        probe(resolve_tracking_uri(settings))
        prefect_api.check()
        require_champion(Registry.from_settings(settings), args.params)  # in a line, before Prefect starts
        prefect_api.connect()
        try:
            return retrain(args.params, args.overrides, args.data_dir, args.min_improvement, out_dir,
                           resume=args.resume)["verdict"]
        except TrainingStopped as stop:  # SIGTERM / Ctrl-C: checkpoint written; its line says how to continue
            stop.resume_with(["python", "-m", "qerl.flows.retrain", "--data-dir", args.data_dir,
                              "--min-improvement", str(args.min_improvement)], args.params, args.overrides, out_dir,
                             max_steps=None)
            raise


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, module="qerl.flows.retrain", doc=__doc__, arguments=_arguments, run=_run,
                    expected=(NoChampion,))

if __name__ == "__main__":
    sys.exit(main())
