"""The README's figures of the main job, read from what `dvc repro` (scripts/run.sh) left, to paste after a rerun:
the held-out accuracy, the reward per step, entropy and answer length, the step and job times, and what the numbers
depend on (README "Determinism"). Reads only files: nothing is trained or loaded.

    python scripts/readme_figures.py [--root .] [--plots docs]

Reads runs/dvc/train/metrics.jsonl and params.yaml, runs/dvc/eval/metrics.json, dvc.lock and data/fingerprint.json
(the job's first output: its time stamp starts the wall-time estimate, metrics.json's ends it). `--plots DIR` also
draws the README's two pictures there (embedded_default_reward_curve.png, embedded_default_training_curves.png):
the trainer's curves with the held-out accuracy on them, which the trainer cannot draw (it is measured after the
training, by the evaluate stage). Seconds on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

TRAIN, EVAL = Path("runs/dvc/train"), Path("runs/dvc/eval")


def read_json_lines(path: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None
    return rows


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def figures(root: Path) -> str:
    steps = read_json_lines(root / TRAIN / "metrics.jsonl")
    evaluation = json.loads((root / EVAL / "metrics.json").read_text())
    params = yaml.safe_load((root / TRAIN / "params.yaml").read_text())
    if not steps:
        raise ValueError(f"{root / TRAIN / 'metrics.jsonl'}: no steps")
    n = evaluation["num_examples"] * evaluation["num_samples"]
    right = round(evaluation["accuracy"] * n)
    step_seconds = [r["seconds_rollout"] + r.get("seconds_scoring", 0.0) + r["seconds_update"] for r in steps]
    started = (root / "data" / "fingerprint.json").stat().st_mtime
    ended = (root / EVAL / "metrics.json").stat().st_mtime
    lock = (root / "dvc.lock").stat().st_mtime
    noisy = [(r["step"], r["sigma"]) for r in steps if r.get("sigma")]
    lines = [
        f"held-out accuracy: {100 * evaluation['accuracy']:.1f}% ({right}/{n}), truncation rate "
        f"{evaluation['truncation_rate']:.3f}, {evaluation['mean_completion_tokens']:.1f} tokens per answer",
        f"reward per step ({len(steps)} steps): " + ", ".join(f"{r['reward_mean']:.2f}" for r in steps),
        "entropy per step (nats/token): " + ", ".join(f"{r['entropy']:.2f}" for r in steps),
        "answer length per step (tokens): " + ", ".join(f"{r['response_length']:.1f}" for r in steps),
        f"AQN: noise-free steps {steps[0]['step']}-{noisy[0][0] - 1 if noisy else steps[-1]['step']}"
        + (f", sigma {noisy[0][1]:.3g} at step {noisy[0][0]} -> {noisy[-1][1]:.3g} at step {noisy[-1][0]}"
           if noisy else ""),
        f"grader timeouts: {sum(r.get('grader_timeouts', 0) for r in steps)} (each a completion scored 0)",
        f"step time: {min(step_seconds) / 60:.1f}-{max(step_seconds) / 60:.1f} min (sampling "
        f"{min(r['seconds_rollout'] for r in steps):.0f}-{max(r['seconds_rollout'] for r in steps):.0f} s, update "
        f"{min(r['seconds_update'] for r in steps):.0f}-{max(r['seconds_update'] for r in steps):.0f} s); all steps "
        f"{minutes(sum(step_seconds))}; evaluation {evaluation['seconds']:.0f} s",
        f"job wall time (data/fingerprint.json to runs/dvc/eval/metrics.json, set-up not included): "
        f"{minutes(ended - started)}; dvc.lock written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(lock))}",
        f"numerics: model.cpu_threads {params['model'].get('cpu_threads', 'not recorded')} (README \"Determinism\")",
    ]
    return "\n".join(lines)


README_PICTURES = {"reward_curve.png": "embedded_default_reward_curve.png",
                   "training_curves.png": "embedded_default_training_curves.png"}


def pictures(root: Path, out: Path) -> list[Path]:
    """The README's pictures of the job in `root`, written to `out`: its per-step curves, the held-out accuracy at
    the last step."""
    import tempfile

    from qerl.rl.plots import plot_training_curves

    steps = read_json_lines(root / TRAIN / "metrics.jsonl")
    accuracy = json.loads((root / EVAL / "metrics.json").read_text())["accuracy"]
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as drawn:
        for path in plot_training_curves(steps, drawn, held_out={steps[-1]["step"]: accuracy}):
            written.append(out / README_PICTURES[path.name])
            path.replace(written[-1])
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="readme_figures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository the job ran in")
    parser.add_argument("--plots", type=Path, default=None, help="also draw the README's pictures in this folder")
    args = parser.parse_args(argv)
    try:
        print(figures(args.root))
        for path in pictures(args.root, args.plots) if args.plots else []:
            print(f"picture: {path}")
    except (OSError, ValueError, KeyError) as e:  # one line naming what is missing or damaged
        what = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename else e
        if isinstance(e, KeyError):
            what = f"the job's outputs lack {e.args[0]!r} (written by another qerl version?)"
        print(f"readme_figures: error: {what}" + (" (run bash scripts/run.sh first)" if isinstance(e, OSError)
                                                  else ""), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
