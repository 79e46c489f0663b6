"""The trainer's PNG curves: one panel per metric (accuracy joins the reward's panel), a legend on every panel."""

from __future__ import annotations

import pytest

from qerl.rl.plots import plot_training_curves


def records(accuracy_offset: float = 0.0) -> list[dict]:
    rewards = [0.14, 0.03, 0.11, 0.11, 0.08, 0.25]
    return [{"step": i + 1, "reward_mean": r, "accuracy": r + accuracy_offset, "entropy": 1.5 - 0.1 * i,
             "sigma": 0.0 if i < 3 else 0.01, "response_length": 20.0 + i} for i, r in enumerate(rewards)]


@pytest.fixture
def drawn(monkeypatch):
    """The figures' panels as (title, legend labels), captured when they are saved."""
    from matplotlib.figure import Figure

    saved = {}
    real_savefig = Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        saved[path.name] = [(ax.get_title(), [t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend()
                             else None) for ax in fig.axes if ax.axison]
        return real_savefig(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def test_every_panel_has_a_legend_and_no_metric_is_drawn_twice(tmp_path, drawn):
    paths = plot_training_curves(records(), tmp_path)
    assert [p.name for p in paths] == ["reward_curve.png", "training_curves.png"] and all(p.is_file() for p in paths)
    panels = drawn["training_curves.png"]
    titles = [title for title, _ in panels]
    assert titles == ["reward (= accuracy)", "policy entropy (nats/token)", "AQN σ", "response length (tokens)"]
    assert all(legend for _, legend in panels)  # no panel without one
    assert panels[0][1] == ["mean reward, per step", "mean reward, moving mean of 2"]
    assert drawn["reward_curve.png"][0][1] == ["mean reward, per step", "mean reward, moving mean of 2"]


def test_accuracy_that_differs_from_the_reward_is_a_second_curve_in_its_panel(tmp_path, drawn):
    plot_training_curves(records(accuracy_offset=-0.02), tmp_path)
    title, legend = drawn["training_curves.png"][0]
    assert title == "reward" and legend == ["mean reward, per step", "mean reward, moving mean of 2",
                                            "accuracy, per step", "accuracy, moving mean of 2"]
