"""Training curves as PNGs, where people would rather look than read metrics.jsonl."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

# One panel per metric. Accuracy shares the reward's panel: with the default rewards ({accuracy: 1.0}) the two are
# the same numbers, and two panels of one curve read as two findings.
CURVES = (("reward_mean", "reward"), ("entropy", "policy entropy (nats/token)"), ("sigma", "AQN σ"),
          ("response_length", "response length (tokens)"), ("kl", "KL to reference"))
REWARD_CURVE, TRAINING_CURVES = "reward_curve.png", "training_curves.png"  # in the run folder


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def _series(records: list[dict], key: str) -> tuple[list, list]:
    return [r["step"] for r in records if key in r], [r[key] for r in records if key in r]


def _accuracy_differs(records: list[dict]) -> bool:
    """Whether the accuracy curve says anything the reward curve does not (other reward terms, or weights)."""
    return any("accuracy" in r and abs(r["accuracy"] - r["reward_mean"]) > 1e-9 for r in records)


def _draw(ax, xs: list, ys: list, window: int, color: str, name: str) -> None:
    """A metric per step (faint) and its moving mean, both named in the legend."""
    ax.plot(xs, ys, color=color, alpha=0.35, marker=".", label=f"{name}, per step")
    ax.plot(xs, _smooth(ys, window), color=color, label=f"{name}, moving mean of {window}")


def plot_training_curves(records: list[dict], out_dir: str | Path, title: str | None = None) -> list[Path]:
    """Writes `training_curves.png` (a grid of the main metrics) and `reward_curve.png`; returns the paths (none
    when no step has a reward: every step was skipped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    records = [r for r in records if "reward_mean" in r]
    if not records:
        return []
    window = max(1, len(records) // 10, min(3, len(records) // 3))  # short runs still get a smoothed line
    paths = []

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    _draw(ax, *_series(records, "reward_mean"), window, "tab:blue", "mean reward")
    ax.set(xlabel="step", ylabel="mean reward", title=title or "reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    paths.append(out_dir / REWARD_CURVE)
    fig.savefig(paths[-1])
    plt.close(fig)

    present = [(k, label) for k, label in CURVES if any(k in r for r in records)]
    cols = 3
    rows = (len(present) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(12, 3.2 * rows), dpi=100, squeeze=False)
    for ax, (key, label) in zip(axes.flat, present):
        xs, ys = _series(records, key)
        if key == "sigma":  # a step schedule: smoothing would blur the stage boundaries
            ax.step(xs, ys, where="post", color="tab:blue", label="σ of the step's rollouts")
        elif key == "reward_mean":
            _draw(ax, xs, ys, window, "tab:blue", "mean reward")
            if _accuracy_differs(records):
                _draw(ax, *_series(records, "accuracy"), window, "tab:orange", "accuracy")
            elif any("accuracy" in r for r in records):
                label = "reward (= accuracy)"
        else:
            _draw(ax, xs, ys, window, "tab:blue", label.split(" (")[0])
        ax.set(title=label, xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    fig.tight_layout()
    paths.append(out_dir / TRAINING_CURVES)
    fig.savefig(paths[-1])
    plt.close(fig)
    return paths
