"""The report of `benchmarks/aqn_seeds.py`'s results: per task and arm, held-out accuracy, reward curves, steps to a
reward threshold, the share of seeds that learn, step-0 entropy per base format, and tests of the paper's two
claims, with effect sizes and 95% intervals. CPU only (numpy + matplotlib); reads only the results folder.

    python benchmarks/analyze_aqn_seeds.py --results docs/results/aqn-seeds --report docs/aqn_seeds

Statistics (every interval is a seeded percentile bootstrap over seeds, `--bootstrap` resamples):
- **AUC** = a run's mean per-step training reward over all its steps: how fast the reward grows and how high it ends,
  in one number per run. **Steps to threshold** = the first step whose trailing 3-step mean reward reaches
  `--threshold`; a run that never does is censored (counted as never: the median is then "not reached").
- **Learns** = reaches the threshold within the run; the share has a Wilson 95% interval.
- **Claims.** (1) "NVFP4 (+AQN) grows the reward faster than bf16 LoRA and QLoRA": AUC of each NVFP4 arm minus each
  baseline's. (2) "AQN beats no AQN": each AQN arm minus `nvfp4`, in AUC and held-out accuracy. Runs of one seed
  share the prompt order in every arm, so the differences are paired by seed (seeds that both arms finished); p is
  a two-sided sign-flip permutation test of the mean paired difference, Holm-adjusted over the task's tests.
  A claim **holds** where the adjusted p < 0.05 and the interval lies on the claimed side, is **contradicted** where
  it lies on the other side, and is **not resolved** otherwise (the interval's width says how large an effect the
  data could still hide).
- **Pairs** (`--pair ARM=REFERENCE`, repeatable): any other paired comparison, e.g. an FP8-compute arm against the same
  base in bf16 compute, where the question is whether learning changed at all: AUC and held-out accuracy, two-sided,
  Holm-adjusted with the task's other tests. A pair **differs** where the adjusted p < 0.05 (the interval then lies on
  one side); otherwise **no difference found**, and the interval bounds the difference the seeds could still hide.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ARM_ORDER = ["bf16-lora", "qlora-bnb", "nf4-lora", "nvfp4", "nvfp4-aqn", "nvfp4-aqn-entropy"]
NVFP4_ARMS = ["nvfp4", "nvfp4-aqn", "nvfp4-aqn-entropy"]
BASELINES = ["bf16-lora", "qlora-bnb"]
AQN_ARMS = ["nvfp4-aqn", "nvfp4-aqn-entropy"]


@dataclass
class Run:
    task: str
    arm: str
    seed: int
    accuracy: float
    rewards: np.ndarray  # per step, NaN where a step logged none
    entropy: np.ndarray
    sigma: np.ndarray
    seconds: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def auc(self) -> float:
        return float(np.nanmean(self.rewards)) if np.isfinite(self.rewards).any() else float("nan")


def read_metrics(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line of a killed run
            continue
    return rows


def load_runs(results: Path) -> tuple[list[Run], list[dict], list[str]]:
    """Finished runs (result.json), the step-0 entropy measurements, and the unfinished run folders."""
    runs, entropies, unfinished = [], [], []
    for job in sorted(results.glob("*/*/seed-*/job.json")):
        folder = job.parent
        result_file = folder / "result.json"
        if not result_file.is_file():
            unfinished.append(str(folder.relative_to(results)))
            continue
        result = json.loads(result_file.read_text())
        rows = read_metrics(folder / "metrics.jsonl") if (folder / "metrics.jsonl").is_file() else []
        steps = max([int(r["step"]) for r in rows], default=0)

        def series(key: str) -> np.ndarray:
            out = np.full(steps, np.nan)
            for r in rows:
                if key in r and r[key] is not None:
                    out[int(r["step"]) - 1] = float(r[key])
            return out

        runs.append(Run(result["task"], result["arm"], int(result["seed"]), float(result["eval"]["accuracy"]),
                        series("reward_mean"), series("entropy"), series("sigma"), result.get("seconds")))
    for path in sorted(results.glob("*/base_entropy/*/result.json")):
        entropies.append(json.loads(path.read_text()))
    return runs, entropies, unfinished


# ---------------------------------------------------------------------------------------------- statistics


def bootstrap_ci(values, rng: np.random.Generator, n: int, stat=np.mean) -> tuple[float, float]:
    values = np.asarray(values, dtype=float)
    if len(values) == 0:
        return float("nan"), float("nan")
    if len(values) == 1:
        return float(values[0]), float(values[0])
    idx = rng.integers(0, len(values), size=(n, len(values)))
    stats = stat(values[idx], axis=1)
    # Censored values (inf: never reached) are order statistics only: no interpolation between inf and a number.
    method = "linear" if np.isfinite(stats).all() else "nearest"
    return float(np.percentile(stats, 2.5, method=method)), float(np.percentile(stats, 97.5, method=method))


def wilson(k: int, n: int) -> tuple[float, float]:
    if n == 0:
        return float("nan"), float("nan")
    z, p = 1.959964, k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def sign_flip_p(diffs, rng: np.random.Generator, n: int) -> float:
    """Two-sided permutation p of the mean paired difference (exact over all sign patterns up to 2^16)."""
    d = np.asarray(diffs, dtype=float)
    if len(d) == 0 or not np.any(d):
        return 1.0
    observed = abs(d.mean())
    if len(d) <= 16:
        signs = ((np.arange(2 ** len(d))[:, None] >> np.arange(len(d))) & 1) * 2 - 1
    else:
        signs = rng.choice([-1, 1], size=(n, len(d)))
    means = np.abs((signs * d).mean(axis=1))
    return float((np.sum(means >= observed - 1e-12) + (0 if len(d) <= 16 else 1)) / (len(means) + (0 if len(d) <= 16
                                                                                                 else 1)))


def holm(pvalues: list[float]) -> list[float]:
    order = np.argsort(pvalues)
    adjusted, running = [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def steps_to_threshold(rewards: np.ndarray, threshold: float, window: int = 3) -> int | None:
    for step in range(1, len(rewards) + 1):
        recent = rewards[max(0, step - window):step]
        if np.isfinite(recent).any() and np.nanmean(recent) >= threshold:
            return step
    return None


@dataclass
class Comparison:
    task: str
    claim: str
    arm: str
    against: str
    metric: str
    seeds: int
    diff: float
    low: float
    high: float
    p: float
    p_holm: float = float("nan")
    two_sided: bool = False  # a --pair: "is there any difference?", not a claim with a side

    @property
    def verdict(self) -> str:
        if self.seeds < 2 or not math.isfinite(self.low):
            return "too few seeds"
        if self.two_sided:
            return ("differs" if self.p_holm < 0.05 and (self.low > 0 or self.high < 0)
                    else "no difference found")
        if self.p_holm < 0.05 and self.low > 0:
            return "holds"
        if self.p_holm < 0.05 and self.high < 0:
            return "contradicted"
        return "not resolved"


def compare(runs: list[Run], task: str, arm: str, against: str, metric: str, claim: str,
            rng: np.random.Generator, n_boot: int) -> Comparison | None:
    a = {r.seed: r for r in runs if r.task == task and r.arm == arm}
    b = {r.seed: r for r in runs if r.task == task and r.arm == against}
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    value = (lambda r: r.auc) if metric == "auc" else (lambda r: r.accuracy)
    diffs = np.array([value(a[s]) - value(b[s]) for s in seeds])
    low, high = bootstrap_ci(diffs, rng, n_boot)
    return Comparison(task, claim, arm, against, metric, len(seeds), float(diffs.mean()), low, high,
                      sign_flip_p(diffs, rng, n_boot))


# ---------------------------------------------------------------------------------------------- report


def summarize(runs: list[Run], task: str, arm: str, threshold: float, rng, n_boot: int) -> dict:
    mine = sorted((r for r in runs if r.task == task and r.arm == arm), key=lambda r: r.seed)
    acc = np.array([r.accuracy for r in mine])
    auc = np.array([r.auc for r in mine])
    reach = [steps_to_threshold(r.rewards, threshold) for r in mine]
    steps = max((len(r.rewards) for r in mine), default=0)
    censored = np.array([s if s is not None else np.inf for s in reach], dtype=float)
    learned = sum(s is not None for s in reach)
    # The base format's own entropy: the first rollouts of fresh LoRA, only where they carried no AQN noise.
    step1 = np.array([r.entropy[0] for r in mine if len(r.entropy) and np.isfinite(r.entropy[0])
                      and len(r.sigma) and r.sigma[0] == 0])
    median_low, median_high = bootstrap_ci(censored, rng, n_boot, stat=np.median) if len(mine) else (np.nan, np.nan)
    return {
        "task": task, "arm": arm, "seeds": len(mine), "steps": steps,
        "accuracy": float(acc.mean()) if len(acc) else float("nan"), "accuracy_ci": bootstrap_ci(acc, rng, n_boot),
        "auc": float(np.nanmean(auc)) if len(auc) else float("nan"), "auc_ci": bootstrap_ci(auc, rng, n_boot),
        "learned": learned, "learned_ci": wilson(learned, len(mine)),
        "steps_to_threshold_median": float(np.median(censored)) if len(mine) else float("nan"),
        "steps_to_threshold_ci": (median_low, median_high),
        "step1_entropy": float(step1.mean()) if len(step1) else float("nan"),
        "step1_entropy_ci": bootstrap_ci(step1, rng, n_boot),
        "seconds_median": float(np.median([r.seconds for r in mine if r.seconds])) if any(r.seconds for r in mine)
        else float("nan"),
    }


def _fmt_steps(value: float, steps: int) -> str:
    return f"not reached in {steps}" if not math.isfinite(value) else f"{value:g}"


def _entropy(row: dict) -> str:
    if not math.isfinite(row["step1_entropy"]):
        return "– (noise at step 1)"
    low, high = row["step1_entropy_ci"]
    return f"{row['step1_entropy']:.3f} [{low:.3f}, {high:.3f}]"


def _pct(x: float) -> str:
    return "–" if not math.isfinite(x) else f"{100 * x:.1f}%"


def plot_task(runs: list[Run], task: str, arms: list[str], report: Path, rng, n_boot: int, threshold: float) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm in arms:
        mine = [r for r in runs if r.task == task and r.arm == arm]
        if not mine:
            continue
        steps = max(len(r.rewards) for r in mine)
        curves = np.full((len(mine), steps), np.nan)
        for i, r in enumerate(mine):
            curves[i, :len(r.rewards)] = r.rewards
        mean = np.nanmean(curves, axis=0)
        lows, highs = zip(*(bootstrap_ci(col[np.isfinite(col)], rng, min(n_boot, 2000)) for col in curves.T))
        x = np.arange(1, steps + 1)
        ax.plot(x, mean, label=f"{arm} (n={len(mine)})")
        ax.fill_between(x, lows, highs, alpha=0.15)
    ax.axhline(threshold, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="step", ylabel="training reward (mean over seeds)", title=f"{task}: reward per step, 95% bootstrap CI")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(report / f"reward_{task}.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, arm in enumerate(arms):
        acc = np.array([r.accuracy for r in runs if r.task == task and r.arm == arm])
        if not len(acc):
            continue
        jitter = np.random.default_rng(i).uniform(-0.15, 0.15, len(acc))
        ax.scatter(np.full(len(acc), i) + jitter, acc, s=10, alpha=0.6)
        low, high = bootstrap_ci(acc, rng, n_boot)
        ax.errorbar(i, acc.mean(), yerr=[[acc.mean() - low], [high - acc.mean()]], fmt="o", color="black", capsize=4)
    ax.set_xticks(range(len(arms)), arms, fontsize=8)
    ax.set(ylabel="held-out accuracy", title=f"{task}: held-out accuracy per seed, mean and 95% CI")
    fig.tight_layout()
    paths.append(report / f"accuracy_{task}.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def analyze(results: Path, report: Path, threshold: float, n_boot: int, seed: int,
            pairs: list[tuple[str, str]] = ()) -> Path:
    rng = np.random.default_rng(seed)
    runs, entropies, unfinished = load_runs(results)
    if not runs:
        raise SystemExit(f"{results}: no finished run (no */*/seed-*/result.json)")
    report.mkdir(parents=True, exist_ok=True)
    tasks = sorted({r.task for r in runs})
    arms = [a for a in ARM_ORDER if any(r.arm == a for r in runs)] + sorted({r.arm for r in runs} - set(ARM_ORDER))
    status = json.loads((results / "status.json").read_text()) if (results / "status.json").is_file() else {}

    rows, comparisons, lines = [], [], []
    for task in tasks:
        rows += [summarize(runs, task, arm, threshold, rng, n_boot) for arm in arms
                 if any(r.task == task and r.arm == arm for r in runs)]
        tests = []
        for arm in NVFP4_ARMS:
            for base in BASELINES:
                tests.append(compare(runs, task, arm, base, "auc", "1: faster than " + base, rng, n_boot))
        for arm in AQN_ARMS:
            for metric in ("auc", "accuracy"):
                tests.append(compare(runs, task, arm, "nvfp4", metric, "2: AQN beats no AQN", rng, n_boot))
        for arm, against in pairs:
            for metric in ("auc", "accuracy"):
                pair = compare(runs, task, arm, against, metric, f"same as {against}", rng, n_boot)
                if pair is not None:
                    pair.two_sided = True
                tests.append(pair)
        tests = [t for t in tests if t is not None]
        for t, adjusted in zip(tests, holm([t.p for t in tests])):
            t.p_holm = adjusted
        comparisons += tests

    with (report / "summary.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["task", "arm", "seeds", "steps", "accuracy", "accuracy_low", "accuracy_high", "auc", "auc_low",
                         "auc_high", "learned", "learned_low", "learned_high", "steps_to_threshold_median",
                         "steps_low", "steps_high", "step1_entropy", "step1_entropy_low", "step1_entropy_high",
                         "seconds_median"])
        for r in rows:
            writer.writerow([r["task"], r["arm"], r["seeds"], r["steps"], r["accuracy"], *r["accuracy_ci"], r["auc"],
                             *r["auc_ci"], r["learned"], *r["learned_ci"], r["steps_to_threshold_median"],
                             *r["steps_to_threshold_ci"], r["step1_entropy"], *r["step1_entropy_ci"],
                             r["seconds_median"]])
    with (report / "claims.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["task", "claim", "arm", "against", "metric", "seeds", "diff", "low", "high", "p", "p_holm",
                         "verdict"])
        for c in comparisons:
            writer.writerow([c.task, c.claim, c.arm, c.against, c.metric, c.seeds, c.diff, c.low, c.high, c.p,
                             c.p_holm, c.verdict])

    plots = []
    for task in tasks:
        plots += plot_task(runs, task, arms, report, rng, n_boot, threshold)

    lines.append(f"Results: `{results}` ({len(runs)} finished runs"
                 + (f", {len(unfinished)} unfinished" if unfinished else "")
                 + (f"; {status.get('done')} of {status.get('jobs')} jobs done in {status.get('wall_s', 0):.0f} s"
                    if status else "") + f"). Threshold: trailing 3-step mean reward ≥ {threshold:g}. "
                 f"± intervals: 95% percentile bootstrap over seeds ({n_boot} resamples, seed {seed}); the share "
                 f"that learns: Wilson 95%.\n")
    for task in tasks:
        lines.append(f"**{task}**\n")
        lines.append("| arm | seeds | held-out accuracy | reward AUC | learns (reaches threshold) | median steps to "
                     "threshold | step-1 entropy (nats/token) |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in (r for r in rows if r["task"] == task):
            lo, hi = r["steps_to_threshold_ci"]
            lines.append(
                f"| {r['arm']} | {r['seeds']} | {_pct(r['accuracy'])} [{_pct(r['accuracy_ci'][0])}, "
                f"{_pct(r['accuracy_ci'][1])}] | {r['auc']:.3f} [{r['auc_ci'][0]:.3f}, {r['auc_ci'][1]:.3f}] | "
                f"{r['learned']}/{r['seeds']} [{_pct(r['learned_ci'][0])}, {_pct(r['learned_ci'][1])}] | "
                f"{_fmt_steps(r['steps_to_threshold_median'], r['steps'])} [{_fmt_steps(lo, r['steps'])}, "
                f"{_fmt_steps(hi, r['steps'])}] | {_entropy(r)} |")
        lines.append("")
        lines.append(f"![reward per step, {task}](reward_{task}.png) ![held-out accuracy, {task}](accuracy_{task}.png)\n")
    if entropies:
        lines.append("**Step-0 policy entropy of each base format** (fresh LoRA, AQN off, the same held-out questions "
                     "and sampling seed for every format; one measurement each):\n")
        lines.append("| task | base format | entropy (nats/token) | completions | tokens |")
        lines.append("|---|---|---|---|---|")
        for e in sorted(entropies, key=lambda e: (e["task"], e["scheme"])):
            lines.append(f"| {e['task']} | {e['scheme']} | {e['entropy']:.3f} | {e['completions']} | {e['tokens']} |")
        lines.append("")
        lines.append("The step-1 entropy column above is the same quantity measured on each seed's first training "
                     "batch, where that batch carried no AQN noise (σ = 0 at step 1; else –), so its interval is over "
                     "seeds and prompts.\n")
    lines.append("**The paper's claims" + (" and the pairs asked for" if pairs else "") + "** (paired by seed; "
                 "difference = arm − reference; p: sign-flip permutation, Holm-adjusted within the task):\n")
    lines.append("| task | claim | arm | reference | metric | seeds | difference [95% CI] | p (Holm) | verdict |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for c in comparisons:
        scale = (lambda v: f"{100 * v:+.1f} pts") if c.metric == "accuracy" else (lambda v: f"{v:+.3f}")
        lines.append(f"| {c.task} | {c.claim} | {c.arm} | {c.against} | {c.metric} | {c.seeds} | {scale(c.diff)} "
                     f"[{scale(c.low)}, {scale(c.high)}] | {c.p:.3g} ({c.p_holm:.3g}) | {c.verdict} |")
    lines.append("")
    claims = [c for c in comparisons if not c.two_sided]  # the --pairs have their own lines below
    held = [c for c in claims if c.verdict == "holds"]
    against = [c for c in claims if c.verdict == "contradicted"]
    open_ = [c for c in claims if c.verdict in ("not resolved", "too few seeds")]
    if claims or not pairs:
        lines.append(f"In short: {len(held)} comparison(s) support a claim, {len(against)} contradict one, and "
                     f"{len(open_)} are not resolved.")
    for c in (c for c in comparisons if c.two_sided):
        scale = 100 if c.metric == "accuracy" else 1
        unit = "held-out accuracy points" if c.metric == "accuracy" else "reward AUC"
        lines.append(f"{c.task}, {c.arm} vs {c.against} ({c.metric}): {c.verdict}; the difference lies in "
                     f"[{scale * c.low:+.3g}, {scale * c.high:+.3g}] {unit}.")
    for metric, unit in (("auc", "reward AUC"), ("accuracy", "held-out accuracy points")):
        unresolved = [c for c in open_ if c.metric == metric and math.isfinite(c.low)]
        if unresolved:
            scale = 100 if metric == "accuracy" else 1
            lines.append(f"Where unresolved ({metric}), the intervals still allow differences from "
                         f"{scale * min(c.low for c in unresolved):+.3g} to {scale * max(c.high for c in unresolved):+.3g}"
                         f" {unit}: effects inside that range cannot be ruled out by these seeds.")
    if unfinished or status.get("remaining") or status.get("failed"):
        lines.append(f"\nNot finished: {len(status.get('remaining', unfinished))} job(s) not run, "
                     f"{len(status.get('failed', []))} failed (see `status.json`).")
    fragment = report / "report.md"
    fragment.write_text("\n".join(lines) + "\n")
    return fragment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", required=True, help="the folder benchmarks/aqn_seeds.py wrote (--out)")
    parser.add_argument("--report", default=None, help="where report.md, the CSVs and PNGs go (default: "
                                                       "<results>/report)")
    parser.add_argument("--threshold", type=float, default=0.3, help="reward threshold (trailing 3-step mean)")
    parser.add_argument("--bootstrap", type=int, default=10000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap's and permutations' seed")
    parser.add_argument("--pair", action="append", default=[], metavar="ARM=REFERENCE",
                        help="also compare ARM with REFERENCE, paired by seed, two-sided (repeatable)")
    args = parser.parse_args(argv)
    pairs = []
    for item in args.pair:
        arm, sep, against = item.partition("=")
        if not sep or not arm or not against:
            parser.error(f"--pair {item}: expected ARM=REFERENCE")
        pairs.append((arm, against))
    results = Path(args.results)
    fragment = analyze(results, Path(args.report) if args.report else results / "report", args.threshold,
                       args.bootstrap, args.seed, pairs)
    print(fragment.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
