"""The evaluation flow: accuracy of the base model plus an adapter (a folder, or a registry alias such as `champion`).

    python -m qerl.flows.evaluate --params params/default.yaml [--adapter DIR | --alias champion] [--limit N]
"""

from __future__ import annotations

from qerl.flows import startup  # noqa: F401 (first of all: the process's settings, before Prefect, MLflow, torch)

import argparse
import sys
import time
from pathlib import Path

from prefect import flow, get_run_logger

from qerl.flows import cli, prefect_api
from qerl.flows.tracking import MlflowTracker, Registry, open_tracker, probe, resolve_tracking_uri
from qerl.flows.train import EVAL_METRIC, QUANTIZED_ROOT, log_eval, run_tags, with_quantized_base
from qerl.config import load_settings, require_extras
from qerl.tasks.evaluation import evaluate as evaluate_task


class NoVersion(LookupError):
    """The registered model has no version behind the alias asked for."""


def require_version(registry: Registry, alias: str):
    """The ModelVersion behind `alias`, or NoVersion saying how to get one."""
    version = registry.version(alias)
    if version is None:
        raise NoVersion(f"registered model {registry.name!r} has no {alias!r} version: train one first (python -m "
                        "qerl.flows.train ... -S tracking.backend=mlflow; its first becomes the champion), or pass "
                        "--adapter DIR")
    return version


@flow(name="qerl-evaluate", log_prints=True)
def evaluate(params: str = "params/default.yaml", overrides: list[str] | None = None, adapter: str | None = None,
             alias: str | None = None, out_dir: str | None = None, limit: int | None = None,
             quantized_root: str = QUANTIZED_ROOT) -> dict:
    """Evaluate `adapter` (or the registry version behind `alias`, or the bare base) on `settings.eval`; with
    `tracking.backend: mlflow`, the metrics and per-sample table land in an MLflow run of their own."""
    logger = get_run_logger()
    settings = load_settings(params, overrides or [])
    out_dir = out_dir or str(Path(settings.eval.out_dir) / time.strftime("%Y%m%d-%H%M%S"))
    version = None
    if alias is not None:
        registry = Registry.from_settings(settings)
        version = require_version(registry, alias)
        adapter = str(registry.download(version, Path(out_dir) / "adapter"))
    settings = with_quantized_base(settings, quantized_root)
    name = f"eval-{alias or (Path(adapter).parent.name if adapter else 'base')}"
    tags = run_tags(settings, params, overrides or [], **{"qerl.flow": "evaluate", "adapter": adapter,
                                                         "model_version": version.version if version else None})
    with open_tracker(settings, run_name=name, tags=tags) as tracker:
        result = evaluate_task(settings, adapter=adapter, out_dir=out_dir, limit=limit)
        log_eval(tracker, result.metrics, step=0)
        tracker.log_table(result.records, artifact_file="eval/samples.json")
    logger.info("%s: %s = %.4f (%s)", adapter or "base model", EVAL_METRIC, result.metrics[EVAL_METRIC], out_dir)
    return {"out_dir": out_dir, "adapter": adapter, "metrics": result.metrics,
            "run_id": tracker.run_id if isinstance(tracker, MlflowTracker) else None}


def _arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--adapter", default=None, help="a PEFT adapter folder")
    which.add_argument("--alias", default=None, help="a registry alias of tracking.registered_model, e.g. champion")
    parser.add_argument("--out", default=None)
    parser.add_argument("--limit", type=int, default=None)


def _run(args: argparse.Namespace) -> str:
    settings = load_settings(args.params, args.overrides)
    require_extras(settings)  # a package the params need (vLLM, bitsandbytes): before any server or model starts
    if settings.tracking.backend == "mlflow" or args.alias:
        probe(resolve_tracking_uri(settings))
    prefect_api.check()
    if args.alias:  # in a line, not after Prefect's traceback of the flow run
        require_version(Registry.from_settings(settings), args.alias)
    prefect_api.connect()
    result = evaluate(args.params, args.overrides, args.adapter, args.alias, args.out, args.limit)
    return f"{EVAL_METRIC}: {result['metrics'][EVAL_METRIC]:.4f}  ({result['out_dir']})"


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, module="qerl.flows.evaluate", doc=__doc__, arguments=_arguments, run=_run,
                    expected=(NoVersion,))

if __name__ == "__main__":
    sys.exit(main())
