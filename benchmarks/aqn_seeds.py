"""The "does quantization noise help RL?" experiment on one machine, with only the qerl core installed (no Prefect,
no MLflow): arms x seeds x tasks, N worker processes sharing the GPU(s), a deadline, and a result file per run.

    python benchmarks/aqn_seeds.py --out runs/aqn_seeds --seeds 20 --jobs 14 --per-gpu auto --budget-s 520
    python benchmarks/aqn_seeds.py --out /tmp/dry --seeds 2 --arms bf16-lora nvfp4 -S train.steps=2 ...  # CPU dry run

Jobs, in the order workers take them (so that the runs finished at any moment are balanced across arms and tasks):
first the step-0 entropy of each base format on each task (fresh LoRA, AQN off, `--entropy-prompts` held-out
questions x rollout.group_size samples, the same sampling seed for every format), then seed by seed every
(arm, task). Folders: `<out>/<task>/<arm>/seed-<NN>/` (the trainer's params.yaml and metrics.jsonl, eval/ with
metrics.json and samples.jsonl, result.json written last) and `<out>/<task>/base_entropy/<scheme>/result.json`.
Checkpoints are deleted once a run is evaluated (they are ~30 MB each and only serve a resume).

- A run that raises writes `error.json` and the worker goes on (after a CUDA error, which poisons the process, it
  exits and the supervisor starts a fresh one); a worker that crashes or is killed is replaced (`--restarts`), and
  its run resumes from its last checkpoint. A run taken twice without finishing is given up (`failed` in status.json).
- `--budget-s`: workers stop taking runs when the time left is less than a run takes (the median of the finished
  runs' seconds, x1.2), and at the deadline the supervisor stops what is still running. What did not run is listed
  in `<out>/status.json`; running the same command again (with the folder carried back) trains only what is missing.
- The tasks: `add2` = params/compare.yaml (2-digit addition, the README's CPU experiment) with 500 held-out
  questions; `add3` = params/compare_add3.yaml (3-digit addition). The arms: flows/arms.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qerl.flows.arms import ARMS, parse_arm  # noqa: E402
from qerl.flows.workers import claimed_runs, read_json, slot_environments, supervise, write_json  # noqa: E402

TASKS: dict[str, tuple[str, list[str]]] = {
    "add2": ("params/compare.yaml", ["eval.n=500", "eval.batch_size=250"]),
    "add3": ("params/compare_add3.yaml", []),
}
DEFAULT_ARMS = ["bf16-lora", "qlora-bnb", "nvfp4", "nvfp4-aqn", "nvfp4-aqn-entropy"]
# For every run, before the -S overrides: no tracking server, a checkpoint every 10 steps (a crashed worker's run
# resumes from there), the NVFP4 GEMM backend per shape from the shape-generic defaults, not measured (14 workers
# timing candidates at once would time each other, pick differently from run to run (backends differ in rounding)
# and compile them all).
RUN_OVERRIDES = ["tracking.backend=none", "train.save_every=10", "execution.gemm_tuning=defaults"]
DONE, ERROR, JOB = "result.json", "error.json", "job.json"
MAX_ATTEMPTS = 2


@dataclass
class Job:
    kind: str  # "entropy" | "run"
    task: str
    arm: str  # the arm, or for an entropy job the base format (quant.scheme)
    seed: int
    folder: Path
    params: str
    overrides: list[str]

    def describe(self) -> str:
        return f"{self.task} {self.arm}" + (f" seed {self.seed}" if self.kind == "run" else " step-0 entropy")


def plan(out: Path, tasks: list[str], arms: dict[str, list[str]], seeds: list[int], common: list[str]) -> list[Job]:
    """Every job in the order workers take them: entropy first, then seed-major over (arm, task)."""
    from qerl.config import load_settings

    jobs = []
    for task in tasks:
        params, task_overrides = TASKS[task]
        schemes = []
        for arm_overrides in arms.values():
            scheme = load_settings(params, [*task_overrides, *common, *arm_overrides]).quant.scheme
            if scheme not in schemes:
                schemes.append(scheme)
        for scheme in schemes:
            folder = out / task / "base_entropy" / scheme
            jobs.append(Job("entropy", task, scheme, 0, folder, params,
                            [*task_overrides, *RUN_OVERRIDES, *common, f"quant.scheme={scheme}",
                             "aqn.enabled=false", f"train.out_dir={folder}"]))
    for seed in seeds:
        for arm, arm_overrides in arms.items():
            for task in tasks:
                params, task_overrides = TASKS[task]
                folder = out / task / arm / f"seed-{seed:02d}"
                jobs.append(Job("run", task, arm, seed, folder, params,
                                [*task_overrides, *RUN_OVERRIDES, *common, *arm_overrides, f"train.seed={seed}",
                                 f"aqn.seed={seed}", f"train.out_dir={folder}", f"eval.out_dir={folder / 'eval'}"]))
    return jobs


def check_and_record(jobs: list[Job]) -> None:
    """Validate every job's settings now (a bad override fails in a line, before any worker starts), and refuse a
    folder started with other settings (a rerun would silently skip or resume it)."""
    from qerl.config import ConfigError, load_settings

    for job in jobs:  # the folder's own path is left out: results unpacked elsewhere still resume
        fingerprint = load_settings(job.params, [o for o in job.overrides if not o.startswith(
            ("train.out_dir=", "eval.out_dir="))]).fingerprint()
        earlier = read_json(job.folder / JOB)
        if earlier is not None and earlier.get("fingerprint") != fingerprint:
            raise ConfigError(f"{job.folder} holds a run started with other settings: rerun with the same ones, "
                              f"or choose another --out")
        if earlier is None:
            job.folder.mkdir(parents=True, exist_ok=True)
            write_json(job.folder / JOB, {"kind": job.kind, "task": job.task, "arm": job.arm, "seed": job.seed,
                                          "params": job.params, "overrides": job.overrides,
                                          "fingerprint": fingerprint})


def run_seconds(out: Path) -> list[float]:
    return [r["seconds"] for p in out.glob(f"*/*/seed-*/{DONE}") if (r := read_json(p)) and "seconds" in r]


def without_export(trainer):
    """`trainer` with no final adapter export and plots (the evaluation runs on the in-process model)."""
    trainer.export = lambda: trainer.out
    return trainer


def run_job(job: Job, entropy_prompts: int) -> dict:
    import torch

    from qerl.config import load_settings
    from qerl.evaluation.evaluate import eval_examples, run_eval
    from qerl.rl.trainer import Trainer

    settings = load_settings(job.params, job.overrides)
    start = time.time()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    info = {"kind": job.kind, "task": job.task, "arm": job.arm, "seed": job.seed, "device": device,
            "host": socket.gethostname(), "pid": os.getpid(), "started": start}
    if job.kind == "entropy":
        with Trainer(settings, out_dir=job.folder, resume=False, overwrite=True, progress=False) as trainer:
            measured = trainer.measure_entropy(eval_examples(settings, limit=entropy_prompts))
        return {**info, "scheme": job.arm, **measured, "seconds": time.time() - start}
    with Trainer(settings, out_dir=job.folder, resume=True, progress=False) as trainer:
        without_export(trainer).train()
        trained = time.time()
        result = run_eval(settings, out_dir=job.folder / "eval", model=trainer.model, tokenizer=trainer.tokenizer,
                          progress=False)
        steps = trainer.step
    return {**info, "steps": steps, "eval": result.metrics, "seconds_train": trained - start,
            "seconds": time.time() - start}


def work(jobs: list[Job], out: Path, deadline: float | None, first_estimate_s: float, entropy_prompts: int) -> int:
    """A worker: every unfinished job nobody holds, in order, until the time left is too short for another run."""
    by_folder = {job.folder: job for job in jobs}

    def too_late() -> bool:
        if deadline is None:
            return False
        seconds = run_seconds(out)
        estimate = 1.2 * statistics.median(seconds) if seconds else first_estimate_s
        return time.time() + estimate > deadline

    for folder in claimed_runs(list(by_folder), done=lambda d: (d / DONE).is_file(), max_attempts=MAX_ATTEMPTS,
                               describe=lambda d: by_folder[d].describe(), stop=too_late):
        job = by_folder[folder]
        try:
            result = run_job(job, entropy_prompts)
        except Exception as exc:  # noqa: BLE001 - recorded, and the next job goes on
            write_json(folder / ERROR, {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                                        "pid": os.getpid(), "time": time.time()})
            print(f"[worker {os.getpid()}] {job.describe()}: FAILED {type(exc).__name__}: {exc}", flush=True)
            if "CUDA" in str(exc) and "out of memory" not in str(exc):  # the context is gone: a fresh process
                return 3
            _release_memory()
            continue
        write_json(folder / DONE, result)
        shutil.rmtree(folder / "checkpoints", ignore_errors=True)  # only a resume needs them
        _release_memory()
        shown = (f"accuracy={result['eval'].get('accuracy', float('nan')):.3f}" if job.kind == "run"
                 else f"entropy={result['entropy']:.3f}")
        print(f"[worker {os.getpid()}] {job.describe()}: {shown} in {result['seconds']:.1f}s", flush=True)
    return 0


def progress(jobs: list[Job], out: Path, started: float) -> str:
    done = sum((j.folder / DONE).is_file() for j in jobs)
    seconds = run_seconds(out)
    median = f"{statistics.median(seconds):.0f}s" if seconds else "-"
    return f"[{time.time() - started:.0f}s] {done} of {len(jobs)} jobs done, median run {median}"


def _release_memory() -> None:
    """Give the finished run's GPU memory back (the caching allocator keeps it): workers share the GPU."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def status(jobs: list[Job], out: Path, started: float) -> dict:
    done, failed, remaining = [], [], []
    for job in jobs:
        name = str(job.folder.relative_to(out))
        if (job.folder / DONE).is_file():
            done.append(name)
        elif (job.folder / ERROR).is_file() or (job.folder / ".attempts").is_file() and \
                int((job.folder / ".attempts").read_text().strip() or 0) >= MAX_ATTEMPTS:
            failed.append({"job": name, "error": (read_json(job.folder / ERROR) or {}).get("error", "worker died")})
        else:
            remaining.append(name)
    seconds = run_seconds(out)
    return {"jobs": len(jobs), "done": len(done), "failed": failed, "remaining": remaining,
            "wall_s": time.time() - started, "run_seconds_median": statistics.median(seconds) if seconds else None,
            "finished": done}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="results folder")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, help=f"built-in: {', '.join(ARMS)}")
    parser.add_argument("--seeds", type=int, default=20, help="seeds 0..N-1 (default 20)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("-S", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every run, e.g. -S train.steps=30")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--per-gpu", default="1", help="workers per GPU: a number or 'auto' (default 1)")
    parser.add_argument("--worker-gib", type=float, default=4.0, help="GPU memory per worker for --per-gpu auto")
    parser.add_argument("--restarts", type=int, default=2, help="replacements of a crashed worker, per slot")
    parser.add_argument("--budget-s", type=float, default=None, help="stop cleanly this many seconds from now")
    parser.add_argument("--deadline", type=float, default=None, help="stop cleanly at this time.time() (overrides "
                                                                     "--budget-s; what the shell script passes)")
    parser.add_argument("--first-estimate-s", type=float, default=60.0,
                        help="a run's seconds until the first one finished (for the deadline)")
    parser.add_argument("--entropy-prompts", type=int, default=32,
                        help="held-out questions the step-0 entropy of each base format is measured on")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    started = time.time()

    out = Path(args.out)
    arms = dict(parse_arm(spec) for spec in args.arms)
    jobs = plan(out, args.tasks, arms, list(range(args.first_seed, args.first_seed + args.seeds)), args.overrides)
    deadline = args.deadline if args.deadline is not None else (
        started + args.budget_s if args.budget_s is not None else None)
    if args.worker:
        return work(jobs, out, deadline, args.first_estimate_s, args.entropy_prompts)

    check_and_record(jobs)
    from qerl.model.loading import embedded_model_path

    embedded_model_path()  # converted once here, not raced by every worker
    per_gpu = args.per_gpu if args.per_gpu == "auto" else int(args.per_gpu)
    envs = slot_environments(args.jobs, per_gpu, args.worker_gib)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out), "--tasks", *args.tasks,
               "--arms", *args.arms, "--seeds", str(args.seeds), "--first-seed", str(args.first_seed),
               "--first-estimate-s", str(args.first_estimate_s), "--entropy-prompts", str(args.entropy_prompts)]
    for override in args.overrides:
        command += ["-S", override]
    if deadline is not None:
        command += ["--deadline", str(deadline)]
    print(f"{len(jobs)} jobs ({sum(not (j.folder / DONE).is_file() for j in jobs)} to do), {args.jobs} worker(s) on "
          f"{sorted({e.get('CUDA_VISIBLE_DEVICES', 'cpu') for e in envs})}, deadline "
          f"{'none' if deadline is None else f'in {deadline - time.time():.0f}s'}", flush=True)
    todo = [j for j in jobs if not (j.folder / DONE).is_file()]
    slots = [] if not todo else supervise(command, envs[:len(todo)], restarts=args.restarts,
                      deadline=None if deadline is None else deadline + 15.0,  # the workers stop first
                      grace_s=5.0, log=lambda m: print(m, flush=True),
                      progress=lambda: progress(jobs, out, started), progress_every_s=30.0)
    report = {**status(jobs, out, started), "worker_exit_codes": [s.codes for s in slots],
              "command": sys.argv, "seeds": args.seeds, "tasks": args.tasks, "arms": arms}
    write_json(out / "status.json", report)
    print(f"done {report['done']} of {report['jobs']} jobs in {report['wall_s']:.0f}s "
          f"(median run {report['run_seconds_median']}s); failed {len(report['failed'])}, "
          f"not run {len(report['remaining'])}", flush=True)
    for f in report["failed"]:
        print(f"  failed: {f['job']}: {f['error']}", flush=True)
    return 0 if not report["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
