"""The experiment flow: arms x seeds of one parameter set, under one MLflow parent run, and the report that compares
them (does quantization noise help RL here?).

    python -m qerl.flows.compare --params params/compare.yaml --arms bf16-lora nvfp4 nvfp4-aqn --seeds 3

An arm is a named set of `section.key=value` overrides: the built-in ones are in ARMS, and `--arms NAME:K=V,K=V`
defines another. Every run is `qerl.flows.train.train_and_evaluate` in `<out>/runs/<arm>/seed-<n>` (seed n sets
train.seed and aqn.seed; the data and the held-out split stay the same), logged as an MLflow run nested under the
experiment's parent run and tagged `arm` and `seed`. A rerun skips finished runs (their `result.json`), resumes a
crashed one from its last checkpoint into the same MLflow run, then rebuilds the report from the run folders.

`--jobs N` trains N runs at once, each in its own worker process (qerl.flows.workers): on a GPU machine worker i sees
GPU i mod G, `--per-gpu K` (or `auto`: as many as the free memory holds at `--worker-gib` each) workers sharing a
GPU; every worker gets cores / N torch threads (a small model's decode steps use several threads poorly, so N
workers of fewer threads get more done; README, "Does AQN help?"). Workers take the next run nobody holds (a lock
file per run folder), so they stay busy until the plan is done; a worker that crashes or is killed is replaced
(`--restarts` per slot) and its run resumes from its last checkpoint, and an interrupted experiment resumes the same
way with any N.
"""

from __future__ import annotations

from qerl.flows import startup  # noqa: F401 (first of all: the process's settings, before Prefect, MLflow, torch)

import argparse
import gc
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from prefect import flow, get_run_logger

from qerl.flows import cli, prefect_api
from qerl.flows.arms import ARMS, DEFAULT_ARMS, parse_arm
from qerl.flows.tracking import MlflowTracker, probe, resolve_tracking_uri
from qerl.flows.train import QUANTIZED_ROOT, run_tags, train_and_evaluate, with_quantized_base
from qerl.flows.workers import CLAIM, claimed_runs, slot_environments, supervise  # noqa: F401 (CLAIM: for callers)
from qerl.config import ConfigError, Settings, load_settings
from qerl.evaluation.report import RunRecord, write_report
from qerl.run.metrics import MetricsLog

__all__ = ["ARMS", "DEFAULT_ARMS", "parse_arm", "compare", "plan_runs", "work"]
DONE = "result.json"  # written last: a run folder without it is unfinished (never started, or crashed)
MLFLOW_RUN = "mlflow_run.json"  # the run's MLflow id, written first: a resumed run continues that MLflow run
PARENT = "experiment.json"  # the parent run's id: a rerun files its runs under the same parent


def run_overrides(common: list[str], arm: list[str], seed: int, run_dir: Path) -> list[str]:
    """What one run trains with: the experiment's overrides, then the arm's, then the seed and the folder."""
    return [*common, *arm, f"train.seed={seed}", f"aqn.seed={seed}", f"train.out_dir={run_dir}",
            "tracking.backend=mlflow"]


@dataclass
class PlannedRun:
    arm: str
    seed: int
    overrides: list[str]
    run_dir: Path


def plan_runs(params: str, common: list[str], arms: dict[str, list[str]], seeds: int, out: Path) -> list[PlannedRun]:
    """Every (arm, seed) run, seed-major (an experiment stopped early still has every arm on the same seeds), each
    one's settings validated and checked against what its folder was started with: a bad arm, or a folder from
    other settings that a rerun would silently skip or resume, fails here in a line, before anything trains."""
    if seeds < 1:
        raise ConfigError(f"--seeds {seeds}: must be >= 1")
    planned = []
    for seed in range(seeds):
        for arm, arm_overrides in arms.items():
            run_dir = out / "runs" / arm / f"seed-{seed}"
            overrides = run_overrides(common, arm_overrides, seed, run_dir)
            fingerprint = load_settings(params, overrides).fingerprint()
            earlier = _read_json(run_dir / MLFLOW_RUN)
            if earlier is not None and earlier.get("settings") != fingerprint:
                raise ConfigError(f"{run_dir} holds a run started with other settings (params, arms or -S): rerun "
                                  f"with the same ones, or choose another --out")
            planned.append(PlannedRun(arm, seed, overrides, run_dir))
    return planned


def default_out_dir(params: str) -> Path:
    return Path("runs/compare") / Path(params).stem


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    tmp.replace(path)


def _record(run_dir: Path, result: dict) -> RunRecord:
    return RunRecord(result["arm"], result["seed"], MetricsLog(run_dir / "metrics.jsonl").read(), result["eval"])


@flow(name="qerl-compare-run", flow_run_name="{arm}-seed{seed}", log_prints=True)
def train_arm_seed(params: str, overrides: list[str], arm: str, seed: int, run_dir: str, parent_run_id: str,
                   quantized_root: str = QUANTIZED_ROOT) -> dict:
    """One (arm, seed): skipped if finished, resumed if it crashed, else trained from scratch; then evaluated."""
    logger = get_run_logger()
    folder = Path(run_dir)
    if (result := _read_json(folder / DONE)) is not None:
        logger.info("%s seed %d: finished earlier (%s), skipped", arm, seed, folder / DONE)
        return result
    settings = load_settings(params, overrides)
    folder.mkdir(parents=True, exist_ok=True)
    earlier = _read_json(folder / MLFLOW_RUN)
    with MlflowTracker.from_settings(
            settings, run_name=f"{arm}-seed{seed}", parent_run_id=parent_run_id,
            run_id=earlier["run_id"] if earlier else None,
            tags=run_tags(settings, params, overrides,
                          **{"qerl.flow": "compare", "arm": arm, "seed": seed, "out_dir": run_dir})
    ) as tracker:
        _write_json(folder / MLFLOW_RUN, {"run_id": tracker.run_id, "settings": settings.fingerprint()})
        if earlier:
            logger.info("%s seed %d: resuming MLflow run %s from %s", arm, seed, tracker.run_id, folder)
        outcome = train_and_evaluate(settings, run_dir, tracker, quantized_root=quantized_root, resume=True)
    result = {"arm": arm, "seed": seed, "steps": outcome.steps, "eval": outcome.eval, "run_id": tracker.run_id}
    _write_json(folder / DONE, result)
    gc.collect()  # the model goes with the trainer; give its memory back before the next run loads another
    return result


def base_entropy(settings: Settings, out: Path, num_prompts: int, quantized_root: str) -> dict:
    """The policy entropy of `settings.quant.scheme`'s base (fresh LoRA, AQN off) at step 0 on the first
    `num_prompts` held-out questions, sampled with the same seed for every format; cached in `out/<scheme>.json`."""
    from qerl.evaluation.evaluate import eval_examples
    from qerl.tasks.training import build_trainer

    scheme = settings.quant.scheme
    cached = out / f"{scheme}.json"
    if (found := _read_json(cached)) is not None:
        return found
    settings = with_quantized_base(settings, quantized_root)
    trainer = build_trainer(settings, str(out / scheme))
    measured = {"scheme": scheme, **trainer.measure_entropy(eval_examples(settings, limit=num_prompts))}
    del trainer
    gc.collect()
    out.mkdir(parents=True, exist_ok=True)
    _write_json(cached, measured)
    return measured


def work(params: str, common: list[str], arms: dict[str, list[str]], seeds: int, out: Path,
         quantized_root: str) -> list[str]:
    """A worker: train, in plan order, every unfinished run that no other worker holds; returns what it trained."""
    parent_run_id = json.loads((out / PARENT).read_text())["parent_run_id"]
    planned = {run.run_dir: run for run in plan_runs(params, common, arms, seeds, out)}
    trained = []
    for run_dir in claimed_runs(planned, done=lambda d: (d / DONE).is_file(),
                                describe=lambda d: f"{planned[d].arm} seed {planned[d].seed}"):
        run = planned[run_dir]
        train_arm_seed(params, run.overrides, run.arm, run.seed, str(run.run_dir), parent_run_id, quantized_root)
        trained.append(f"{run.arm}/seed-{run.seed}")
    return trained


def run_workers(params: str, common: list[str], arm_specs: list[str], seeds: int, out: Path, quantized_root: str,
                jobs: int, per_gpu: int | str = 1, worker_gib: float = 4.0, restarts: int = 2) -> None:
    """Start `jobs` worker processes (`python -m qerl.flows.compare --worker ...`) and wait for all of them; their logs
    interleave on this process's output. A worker that crashes is replaced up to `restarts` times per slot (its run
    resumes from its last checkpoint); a slot that still fails is named once every worker has ended."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME

    command = [sys.executable, "-m", "qerl.flows.compare", "--worker", "--params", params, "--seeds", str(seeds),
               "--out", str(out), "--quantized-root", quantized_root, "--arms", *arm_specs]
    for override in common:
        command += ["-S", override]
    envs = slot_environments(jobs, per_gpu, worker_gib)
    for i, env in enumerate(envs):
        if PREFECT_API_URL.value():  # a Prefect server: the workers' flow runs show up there beside ours
            env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
        else:  # each worker starts its own temporary server; one database each
            env["PREFECT_HOME"] = str(Path(PREFECT_HOME.value()) / f"compare-worker-{i}")
    slots = supervise(command, envs, restarts=restarts)
    failed = [f"worker {i} (exit code {s.codes[-1]})" for i, s in enumerate(slots) if s.codes and s.codes[-1] != 0]
    if failed:
        raise RuntimeError(f"{', '.join(failed)} failed; their runs resume on the next invocation")


@flow(name="qerl-compare", log_prints=True)
def compare(params: str = "params/compare.yaml", arms: list[str] | None = None, seeds: int = 3,
            overrides: list[str] | None = None, out_dir: str | None = None, quantized_root: str = QUANTIZED_ROOT,
            reward_threshold: float = 0.5, entropy_prompts: int = 32, jobs: int = 1, per_gpu: int | str = 1,
            worker_gib: float = 4.0, restarts: int = 2) -> dict:
    """Train every arm with seeds 0..seeds-1 (`jobs` at once), then write the report to `<out_dir>/report` and the
    parent run."""
    if jobs < 1:
        raise ConfigError(f"--jobs {jobs}: must be >= 1")
    logger = get_run_logger()
    common = list(overrides or [])
    chosen = dict(parse_arm(spec) for spec in (arms or DEFAULT_ARMS))
    out = Path(out_dir) if out_dir else default_out_dir(params)
    planned = plan_runs(params, common, chosen, seeds, out)
    first = load_settings(params, planned[0].overrides)
    probe(resolve_tracking_uri(first))
    out.mkdir(parents=True, exist_ok=True)
    earlier = _read_json(out / PARENT)
    with MlflowTracker.from_settings(first, run_name=f"compare-{Path(params).stem}",
                                     run_id=earlier["parent_run_id"] if earlier else None,
                                     tags={"qerl.flow": "compare", "out_dir": str(out)}) as parent:
        _write_json(out / PARENT, {"parent_run_id": parent.run_id})
        if not earlier:
            parent.log_params({"params": params, "arms": json.dumps(chosen), "seeds": seeds,
                               "overrides": json.dumps(common), "reward_threshold": reward_threshold})
        # Step-0 entropy of each base format: the paper's "quantization raises entropy", measured on the same prompts.
        formats = {}
        for run in planned:
            scheme = load_settings(params, run.overrides).quant.scheme
            if scheme not in formats:
                formats[scheme] = load_settings(params, [*common, f"quant.scheme={scheme}", "aqn.enabled=false",
                                                         "tracking.backend=mlflow"])
        entropies = [base_entropy(s, out / "base_entropy", entropy_prompts, quantized_root) for s in formats.values()]
        for e in entropies:
            logger.info("step-0 policy entropy of the %s base: %.4f nats/token", e["scheme"], e["entropy"])

        if jobs > 1:
            run_workers(params, common, list(arms or DEFAULT_ARMS), seeds, out, quantized_root, jobs, per_gpu,
                        worker_gib, restarts)
        records = []
        for run in planned:  # with workers, every run is finished now and only read back
            result = train_arm_seed(params, run.overrides, run.arm, run.seed, str(run.run_dir), parent.run_id,
                                    quantized_root)
            records.append(_record(run.run_dir, result))
        paths = write_report(records, entropies, out / "report", reward_threshold)
        for path in paths:
            parent.log_artifact(path, "report")
        parent.log_metrics({f"{e['scheme']}/step0_entropy": e["entropy"] for e in entropies}, step=0)
        logger.info("report: %s\n%s", out / "report", (out / "report" / "report.md").read_text())
    return {"out_dir": str(out), "parent_run_id": parent.run_id, "report": [str(p) for p in paths],
            "runs": [{"arm": r.arm, "seed": r.seed, "eval": r.eval} for r in records]}


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), metavar="ARM",
                        help=f"built-in: {', '.join(ARMS)}; or NAME:section.key=value,... "
                             f"(default: {' '.join(DEFAULT_ARMS)})")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per arm (default 3)")
    parser.add_argument("--out", default=None, help="experiment folder (default: runs/compare/<params stem>)")
    parser.add_argument("--reward-threshold", type=float, default=0.5,
                        help="the report's 'steps to reach' reward (3-step trailing mean; default 0.5)")
    parser.add_argument("--entropy-prompts", type=int, default=32,
                        help="held-out questions the step-0 entropy of each base format is measured on")
    parser.add_argument("--quantized-root", default=QUANTIZED_ROOT)
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs trained at once, each in its own process, spread over the GPUs (see --per-gpu) or "
                             "an equal share of the CPU cores (default 1)")
    parser.add_argument("--per-gpu", type=_per_gpu, default=1,
                        help="workers sharing one GPU: a number, or 'auto' (as many as its free memory holds at "
                             "--worker-gib each); default 1")
    parser.add_argument("--worker-gib", type=float, default=4.0,
                        help="GPU memory one worker needs, for --per-gpu auto (default 4)")
    parser.add_argument("--restarts", type=int, default=2,
                        help="times a crashed worker is replaced, per slot (default 2)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # what --jobs starts


def _per_gpu(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {value!r}") from None


def _run(args: argparse.Namespace) -> str:
    for spec in args.arms:  # fail in a line, before Prefect and the model start up
        parse_arm(spec)
    probe(resolve_tracking_uri(load_settings(args.params, args.overrides)))
    prefect_api.connect()
    if args.worker:
        out = Path(args.out) if args.out else default_out_dir(args.params)
        trained = work(args.params, list(args.overrides), dict(parse_arm(s) for s in args.arms), args.seeds, out,
                       args.quantized_root)
        return f"worker {os.getpid()} trained: {', '.join(trained) or 'nothing left'}"
    result = compare(args.params, args.arms, args.seeds, args.overrides, args.out, args.quantized_root,
                     args.reward_threshold, args.entropy_prompts, args.jobs, args.per_gpu, args.worker_gib,
                     args.restarts)
    return f"report: {Path(result['out_dir']) / 'report' / 'report.md'}  mlflow parent run {result['parent_run_id']}"


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, module="qerl.flows.compare", doc=__doc__, arguments=_arguments, run=_run,
                    params="params/compare.yaml", overrides_help="an override for every arm")

if __name__ == "__main__":
    sys.exit(main())
