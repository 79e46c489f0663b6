"""Plain entry points for the DVC stages the `qerl` CLI does not cover (no Prefect or MLflow imported here).

    python -m qerl.flows.stages fingerprint --params params/default.yaml --out data/fingerprint.json
    python -m qerl.flows.stages prepare --params params/default.yaml --out data/prepared
    python -m qerl.flows.stages curves runs/dvc/train runs/dvc/curves
"""

from __future__ import annotations

from qerl.flows import startup  # noqa: F401 (first of all: the process's settings, before Prefect, MLflow, torch)

import argparse
import csv
import json
import shutil
import sys
from pathlib import Path

from qerl.flows import cli
from qerl.config import Settings, load_settings
from qerl.run import atomic


def prepare(settings: Settings, out_dir: str | Path) -> dict[str, Path]:
    """Materialize the training and evaluation sets named by `data` and `eval` as `train.jsonl` / `test.jsonl`.

    Rows use the MATH hub layout (`problem` / `answer` = the bare gold), which `qerl.data.problems.load_jsonl` reads
    back exactly, so training on `-S data.name=<dir>/train.jsonl -S data.n=null` sees the same examples.
    """
    from qerl.data import problems as data
    from qerl.evaluation.evaluate import eval_examples

    train = data.examples_for(settings.data)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, examples in (("train", train), ("test", eval_examples(settings))):
        path = out / f"{name}.jsonl"
        atomic.write_text(path, "".join(json.dumps({"id": ex.id, "problem": ex.question, "answer": ex.gold,
                                                    "source": ex.source}) + "\n" for ex in examples))
        written[name] = path
    return written


def fingerprint(settings: Settings, out_json: str | Path) -> Path:
    """Write what identifies the training and evaluation data (`qerl.data.problems.fingerprint`) as JSON.

    DVC cannot see a hub dataset, or a file named only in the params, so its `fingerprint` stage runs this on every
    `dvc repro` and `prepare` depends on the result: data preparation reruns exactly when a fingerprint changes.
    """
    from qerl.data import problems as data

    prints = {"train": data.fingerprint(settings.data), "test": data.fingerprint(settings.eval, knobs=settings.data)}
    out = Path(out_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prints, indent=2) + "\n")
    return out


def curves(metrics_jsonl: str | Path, out_csv: str | Path) -> Path:
    """metrics.jsonl -> CSV (one row per step, a column per metric): `dvc plots` reads CSV/JSON, not JSON Lines."""
    rows = [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines() if line.strip()]
    columns = list(dict.fromkeys(k for r in rows for k in r))
    out = Path(out_csv)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return out


def plot_sources(run_dir: str | Path, out_dir: str | Path) -> Path:
    """The run's curves as `dvc plots` reads them: `curves.csv` from metrics.jsonl, and copies of the trainer's PNGs.

    A folder of its own, outside the run folder, so that dvc.yaml can cache it: `dvc plots diff exp-a exp-b` then
    loads each experiment's curves from the cache, while the run folder's own outputs stay uncached (`dvc exp run`
    checks cached outputs out before a stage runs, and must not write into a live run's folder).
    """
    from qerl.rl.plots import REWARD_CURVE, TRAINING_CURVES

    run, out = Path(run_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves(run / "metrics.jsonl", out / "curves.csv")
    for png in (REWARD_CURVE, TRAINING_CURVES):
        if (run / png).is_file():
            shutil.copyfile(run / png, out / png)
    return out


def _arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="write train.jsonl and test.jsonl from the data/eval parameters")
    cli.add_params(p, default=None)
    p.add_argument("--out", required=True)
    p = sub.add_parser("fingerprint", help="write the fingerprints of the data/eval datasets as JSON")
    cli.add_params(p, default=None)
    p.add_argument("--out", required=True)
    p = sub.add_parser("curves", help="a run's metrics.jsonl -> curves.csv, and its PNG curves, for dvc plots")
    p.add_argument("run_dir")
    p.add_argument("out_dir")


def _run(args: argparse.Namespace) -> str:
    if args.command == "prepare":
        written = prepare(load_settings(args.params, args.overrides), args.out)
        return "\n".join(f"{name}: {path} ({sum(1 for _ in path.open())} examples)" for name, path in written.items())
    if args.command == "fingerprint":
        return fingerprint(load_settings(args.params, args.overrides), args.out).read_text().rstrip("\n")
    return str(plot_sources(args.run_dir, args.out_dir))


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, module="qerl.flows.stages", doc=__doc__, arguments=_arguments, run=_run, params=None)

if __name__ == "__main__":
    sys.exit(main())
