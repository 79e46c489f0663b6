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


def fifteen_steps() -> list[dict]:
    """The shape of the embedded default's run: 15 steps, rewards 0.03-0.25, AQN from step 4."""
    rewards = [0.14, 0.03, 0.12, 0.11, 0.09, 0.23, 0.17, 0.16, 0.20, 0.14, 0.25, 0.23, 0.14, 0.20, 0.14]
    return [{"step": i + 1, "reward_mean": r, "accuracy": r, "entropy": 1.4 + 0.02 * (i % 5),
             "sigma": 0.0 if i < 3 else 0.01 * 0.37 ** ((i - 3) // 3), "response_length": 21.0 + 0.1 * (i % 4)}
            for i, r in enumerate(rewards)]


@pytest.fixture
def figures(monkeypatch):
    """Each saved figure's axes, kept open for a look at their limits, ticks and places."""
    from matplotlib.figure import Figure

    saved = {}
    real_savefig = Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        result = real_savefig(fig, path, *args, **kwargs)  # drawn first: the ticks are the ones in the PNG
        saved[path.name] = [ax for ax in fig.axes if ax.axison]
        saved[path.name + ":hidden"] = [ax for ax in fig.axes if not ax.axison]
        return result

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def test_the_reward_is_read_from_zero_on_whole_steps(tmp_path, figures):
    """The README's reward curve started its axis at 0.03 (a wobble read as a climb from nothing) and ticked steps
    2.5, 5.0, 7.5."""
    plot_training_curves(fifteen_steps(), tmp_path)
    reward_curve, grid = figures["reward_curve.png"][0], figures["training_curves.png"]
    for ax in (reward_curve, grid[0]):
        assert ax.get_ylim()[0] == 0
    for ax in [reward_curve, *grid]:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)


@pytest.mark.parametrize("dropped, panels", [((), 4), (("sigma",), 3), ((), 5)])
def test_the_grid_has_no_empty_cells(tmp_path, figures, dropped, panels):
    """Four panels in a grid of three columns left two empty cells; the last row's panels now fill it."""
    rows = [{k: v for k, v in r.items() if k not in dropped} | ({"kl": 0.01} if panels == 5 else {})
            for r in fifteen_steps()]
    plot_training_curves(rows, tmp_path)
    shown = figures["training_curves.png"]
    assert len(shown) == panels and figures["training_curves.png:hidden"] == []
    rows_of = {}
    for ax in shown:
        box = ax.get_position()
        rows_of.setdefault(round(box.y0, 3), []).append(box)
    for boxes in rows_of.values():  # each row spans the figure's width: from the first panel's left to the last's right
        assert min(b.x0 for b in boxes) < 0.1 and max(b.x1 for b in boxes) > 0.9, boxes


def test_the_held_out_accuracy_is_on_the_reward_curve(tmp_path, drawn):
    """The job's headline (the held-out accuracy) was in no picture."""
    plot_training_curves(fifteen_steps(), tmp_path, held_out={15: 6 / 18})
    assert "held-out accuracy (33.3% at step 15)" in drawn["reward_curve.png"][0][1]
    assert "held-out accuracy (33.3% at step 15)" in drawn["training_curves.png"][0][1]
