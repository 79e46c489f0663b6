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


def _steps_axis(ax) -> None:
    """Whole steps only: matplotlib's default ticks of a 15-step run were 2.5, 5.0, 7.5, ..."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _from_zero(ax, values: Sequence[float]) -> None:
    """A share (reward, accuracy) read against 0: an axis starting at 0.03 made a 0.03 -> 0.25 wobble look like a
    climb from nothing to the top. Negative rewards keep their own bottom."""
    if min(values, default=0.0) >= 0:
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.1)  # headroom for the legend above the curves


def _held_out(ax, held_out: dict[int, float]) -> None:
    """The held-out accuracy (greedy, on the evaluation set) at the steps it was measured: the job's headline, on
    the reward's axis (both are shares of right answers; the reward on the training prompts, sampled)."""
    steps = sorted(held_out)
    ax.plot(steps, [held_out[s] for s in steps], color="tab:red", marker="D", markersize=7, linestyle="--",
            label=f"held-out accuracy ({100 * held_out[steps[-1]]:.1f}% at step {steps[-1]})")


def _grid(plt, n: int):
    """`n` panels in rows of three (four: two by two), the last row's panels widened to fill it: no empty cells
    (a 3-column grid of four panels left two)."""
    import math

    cols = 2 if n == 4 else min(n, 3)
    rows = (n + cols - 1) // cols
    last = n - cols * (rows - 1)
    width = math.lcm(cols, last)  # the grid's columns: each full-row panel spans width // cols, a last-row one more
    fig = plt.figure(figsize=(12, 3.2 * rows), dpi=100)
    spec = fig.add_gridspec(rows, width)
    axes = []
    for i in range(n):
        row, col = divmod(i, cols)
        span = width // (last if row == rows - 1 else cols)
        axes.append(fig.add_subplot(spec[row, col * span:(col + 1) * span]))
    return fig, axes


def plot_training_curves(records: list[dict], out_dir: str | Path, title: str | None = None,
                         held_out: dict[int, float] | None = None) -> list[Path]:
    """Writes `training_curves.png` (a grid of the main metrics) and `reward_curve.png`; returns the paths (none
    when no step has a reward: every step was skipped). `held_out`: the held-out accuracy by step, where known
    (it is measured after the trainer draws its curves: scripts/readme_figures.py draws them again with it)."""
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
    xs, ys = _series(records, "reward_mean")
    _draw(ax, xs, ys, window, "tab:blue", "mean reward")
    if held_out:
        _held_out(ax, held_out)
    ax.set(xlabel="step", ylabel="mean reward" + (" / accuracy" if held_out else ""), title=title or "reward")
    _from_zero(ax, ys)
    _steps_axis(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    paths.append(out_dir / REWARD_CURVE)
    fig.savefig(paths[-1])
    plt.close(fig)

    present = [(k, label) for k, label in CURVES if any(k in r for r in records)]
    fig, axes = _grid(plt, len(present))
    for ax, (key, label) in zip(axes, present):
        xs, ys = _series(records, key)
        if key == "sigma":  # a step schedule: smoothing would blur the stage boundaries
            ax.step(xs, ys, where="post", color="tab:blue", label="σ of the step's rollouts")
        elif key == "reward_mean":
            _draw(ax, xs, ys, window, "tab:blue", "mean reward")
            if _accuracy_differs(records):
                _draw(ax, *_series(records, "accuracy"), window, "tab:orange", "accuracy")
            elif any("accuracy" in r for r in records):
                label = "reward (= accuracy)"
            if held_out:
                _held_out(ax, held_out)
            _from_zero(ax, ys)
        else:
            _draw(ax, xs, ys, window, "tab:blue", label.split(" (")[0])
        ax.set(title=label, xlabel="step")
        _steps_axis(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.tight_layout()
    paths.append(out_dir / TRAINING_CURVES)
    fig.savefig(paths[-1])
    plt.close(fig)
    return paths
