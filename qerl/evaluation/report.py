"""The report of an arms x seeds experiment (`flows/compare.py`): curves with confidence bands, and the tables.

Pure functions over plain records (each run's metrics.jsonl rows and final eval metrics), so a report can be rebuilt
from run folders alone. Intervals are 95% Student-t intervals of the mean over seeds: with 3 seeds the half-width is
4.3 standard errors, which is what honest error bars over so few seeds look like.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

CONFIDENCE = 0.95
SMOOTHING = 3  # steps in the trailing mean that "steps to reach the threshold" reads: one lucky batch is not a reach


@dataclass
class RunRecord:
    """One finished (arm, seed) run."""

    arm: str
    seed: int
    steps: list[dict]  # metrics.jsonl rows, one per step
    eval: dict[str, float] = field(default_factory=dict)


def mean_ci(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Mean and the half-width of its Student-t confidence interval (NaN for fewer than two values)."""
    from scipy import stats

    values = [float(v) for v in values]
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return mean, float(stats.t.ppf((1 + confidence) / 2, len(values) - 1)) * sd / math.sqrt(len(values))


def series(run: RunRecord, key: str) -> dict[int, float]:
    """`key` per step of one run (steps without it, e.g. skipped ones, are absent)."""
    return {int(r["step"]): float(r[key]) for r in run.steps if key in r}


def steps_to_threshold(rewards: dict[int, float], threshold: float, window: int = SMOOTHING) -> int | None:
    """The first step whose trailing `window`-step mean reward reaches `threshold`; None if none does."""
    steps = sorted(rewards)
    for i, step in enumerate(steps):
        recent = [rewards[s] for s in steps[max(0, i - window + 1):i + 1]]
        if sum(recent) / len(recent) >= threshold:
            return step
    return None


def by_arm(runs: Sequence[RunRecord]) -> dict[str, list[RunRecord]]:
    """Runs grouped by arm, arms in the order they first appear, seeds sorted."""
    groups: dict[str, list[RunRecord]] = {}
    for run in runs:
        groups.setdefault(run.arm, []).append(run)
    return {arm: sorted(group, key=lambda r: r.seed) for arm, group in groups.items()}


def _fmt(mean: float, half: float, percent: bool = False) -> str:
    if math.isnan(mean):
        return "n/a"
    scale, unit = (100, "%") if percent else (1, "")
    if math.isnan(half):
        return f"{mean * scale:.1f}{unit}" if percent else f"{mean:.3f}"
    return f"{mean * scale:.1f} ± {half * scale:.1f}{unit}" if percent else f"{mean:.3f} ± {half:.3f}"


def summary_rows(runs: Sequence[RunRecord], threshold: float) -> list[dict]:
    """Per arm: held-out accuracy, the last steps' reward and the steps to reach `threshold` (means, CI halves)."""
    rows = []
    for arm, group in by_arm(runs).items():
        acc = mean_ci([r.eval["accuracy"] for r in group if "accuracy" in r.eval])
        final = mean_ci([_tail_mean(series(r, "reward_mean")) for r in group])
        entropy = mean_ci([_tail_mean(series(r, "entropy")) for r in group])
        reached = [steps_to_threshold(series(r, "reward_mean"), threshold) for r in group]
        hit = [s for s in reached if s is not None]
        to_threshold = mean_ci(hit)
        rows.append({
            "arm": arm, "seeds": len(group), "steps": max(len(r.steps) for r in group),
            "eval_examples": int(group[0].eval.get("num_examples", 0)),
            "accuracy_mean": acc[0], "accuracy_ci95": acc[1],
            "final_reward_mean": final[0], "final_reward_ci95": final[1],
            "final_entropy_mean": entropy[0], "final_entropy_ci95": entropy[1],
            "reward_threshold": threshold, "runs_reaching_threshold": len(hit),
            "steps_to_threshold_mean": to_threshold[0], "steps_to_threshold_ci95": to_threshold[1],
        })
    return rows


def _tail_mean(values: dict[int, float], window: int = SMOOTHING) -> float:
    tail = [values[s] for s in sorted(values)[-window:]]
    return sum(tail) / len(tail) if tail else math.nan


def plot_by_arm(runs: Sequence[RunRecord], panels: Sequence[tuple[str, str]], path: Path, title: str) -> Path:
    """One panel per (metric, label): the mean over seeds per step and its 95% CI band, one colour per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4), dpi=110, squeeze=False)
    for ax, (key, label) in zip(axes.flat, panels):
        for i, (arm, group) in enumerate(by_arm(runs).items()):
            per_run = [series(r, key) for r in group]
            steps = sorted(set().union(*per_run))
            stats = [mean_ci([s[step] for s in per_run if step in s]) for step in steps]
            if not steps:
                continue
            mean = [m for m, _ in stats]
            half = [0.0 if math.isnan(h) else h for _, h in stats]
            color = f"C{i}"
            ax.plot(steps, mean, color=color, marker="o" if len(steps) < 30 else None, ms=3,
                    label=f"{arm} (n={len(group)})")
            ax.fill_between(steps, [m - h for m, h in zip(mean, half)], [m + h for m, h in zip(mean, half)],
                            color=color, alpha=0.15, linewidth=0)
        ax.set(xlabel="step", ylabel=label, title=label)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{title}: mean over seeds, shaded 95% CI")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _write_csv(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)
    return path


def markdown(rows: list[dict], base_entropy: list[dict], threshold: float) -> str:
    """The two tables as markdown: per-arm results, then the step-0 entropy of each base format."""
    lines = [
        f"| arm | seeds | held-out accuracy (n = {rows[0]['eval_examples'] if rows else 0}) | reward, last "
        f"{SMOOTHING} steps | entropy, last {SMOOTHING} steps | steps to reward ≥ {threshold:g} |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        reach = (f"{_fmt(r['steps_to_threshold_mean'], r['steps_to_threshold_ci95']).replace('.000', '')} "
                 f"({r['runs_reaching_threshold']}/{r['seeds']} runs)" if r["runs_reaching_threshold"]
                 else f"not reached in {r['steps']} (0/{r['seeds']})")
        lines.append(f"| {r['arm']} | {r['seeds']} | {_fmt(r['accuracy_mean'], r['accuracy_ci95'], True)} | "
                     f"{_fmt(r['final_reward_mean'], r['final_reward_ci95'])} | "
                     f"{_fmt(r['final_entropy_mean'], r['final_entropy_ci95'])} | {reach} |")
    if base_entropy:
        lines += ["", "| base format | policy entropy at step 0 (nats/token) | completions | tokens |",
                  "|---|---|---|---|"]
        lines += [f"| {e['scheme']} | {e['entropy']:.4f} | {e['completions']} | {e['tokens']} |"
                  for e in base_entropy]
    return "\n".join(lines) + "\n"


def write_report(runs: Sequence[RunRecord], base_entropy: list[dict], out_dir: str | Path,
                 threshold: float) -> list[Path]:
    """reward_by_arm.png, entropy_by_arm.png, summary.csv, base_entropy.csv and report.md in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(runs, threshold)
    paths = [
        plot_by_arm(runs, [("reward_mean", "mean reward")], out / "reward_by_arm.png", "Reward per step"),
        plot_by_arm(runs, [("entropy", "policy entropy (nats/token)"), ("sigma", "AQN σ")],
                    out / "entropy_by_arm.png", "Entropy and noise per step"),
        _write_csv(out / "summary.csv", rows),
        _write_csv(out / "base_entropy.csv", base_entropy),
    ]
    (out / "report.md").write_text(markdown(rows, base_entropy, threshold))
    return paths + [out / "report.md"]
