"""Training curves as PNGs, where people would rather look than read metrics.jsonl."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

CURVES = (("reward_mean", "mean reward"), ("accuracy", "accuracy"), ("entropy", "policy entropy (nats/token)"),
          ("sigma", "AQN σ"), ("response_length", "response length (tokens)"), ("kl", "KL to reference"))
REWARD_CURVE, TRAINING_CURVES = "reward_curve.png", "training_curves.png"  # in the run folder


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


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
    steps = [r["step"] for r in records]
    window = max(1, len(records) // 10, min(3, len(records) // 3))  # short runs still get a smoothed line
    paths = []

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    rewards = [r["reward_mean"] for r in records]
    ax.plot(steps, rewards, color="tab:blue", alpha=0.35, label="per step")
    ax.plot(steps, _smooth(rewards, window), color="tab:blue", label=f"moving mean ({window})")
    ax.set(xlabel="step", ylabel="mean reward", title=title or "reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / REWARD_CURVE)
    fig.savefig(paths[-1])
    plt.close(fig)

    present = [(k, label) for k, label in CURVES if any(k in r for r in records)]
    cols = 3
    rows = (len(present) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(12, 3.2 * rows), dpi=100, squeeze=False)
    for ax, (key, label) in zip(axes.flat, present):
        xs = [r["step"] for r in records if key in r]
        ys = [r[key] for r in records if key in r]
        if key == "sigma":  # a step schedule: smoothing would blur the stage boundaries
            ax.step(xs, ys, where="post")
        else:
            ax.plot(xs, ys, alpha=0.4)
            ax.plot(xs, _smooth(ys, window))
        ax.set(title=label, xlabel="step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    fig.tight_layout()
    paths.append(out_dir / TRAINING_CURVES)
    fig.savefig(paths[-1])
    plt.close(fig)
    return paths
