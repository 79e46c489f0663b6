"""The experiment report: intervals over seeds, steps to a threshold, and the files it writes."""

import csv
import math

import pytest

from qerl.evaluation.report import RunRecord, mean_ci, steps_to_threshold, summary_rows, write_report


def test_mean_ci_is_the_student_t_interval():
    mean, half = mean_ci([1.0, 2.0, 3.0])
    assert mean == 2.0
    assert half == pytest.approx(4.302653 * 1.0 / math.sqrt(3), rel=1e-6)  # t(0.975, 2) * sd / sqrt(n)
    assert math.isnan(mean_ci([5.0])[1]) and mean_ci([5.0])[0] == 5.0
    assert math.isnan(mean_ci([])[0])


def test_steps_to_threshold_reads_a_trailing_mean_not_one_lucky_step():
    rewards = {1: 0.0, 2: 0.9, 3: 0.0, 4: 0.6, 5: 0.6, 6: 0.6}
    assert steps_to_threshold(rewards, 0.55) == 6  # step 2 alone is 0.9, but its trailing mean is 0.45
    assert steps_to_threshold(rewards, 0.7) is None
    assert steps_to_threshold({1: 0.8}, 0.5) == 1


def run(arm, seed, rewards, accuracy):
    steps = [{"step": i + 1, "reward_mean": r, "entropy": 1.0 - 0.1 * i, "sigma": 0.01} for i, r in enumerate(rewards)]
    return RunRecord(arm, seed, steps, {"accuracy": accuracy, "num_examples": 200})


def test_report_writes_curves_tables_and_markdown(tmp_path):
    runs = [run("a", 0, [0.1, 0.5, 0.6], 0.30), run("a", 1, [0.1, 0.2, 0.3], 0.20),
            run("b", 0, [0.0, 0.1, 0.1], 0.10), run("b", 1, [0.0, 0.0, 0.1], 0.12)]
    base = [{"scheme": "bf16", "entropy": 0.5, "completions": 8, "tokens": 40},
            {"scheme": "nvfp4", "entropy": 0.7, "completions": 8, "tokens": 41}]
    paths = write_report(runs, base, tmp_path, threshold=0.35)
    assert {p.name for p in paths} == {"reward_by_arm.png", "entropy_by_arm.png", "summary.csv", "base_entropy.csv",
                                       "report.md"}
    assert all(p.stat().st_size > (10_000 if p.suffix == ".png" else 50) for p in paths)
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert [r["arm"] for r in rows] == ["a", "b"]
    assert float(rows[0]["accuracy_mean"]) == pytest.approx(0.25)
    assert rows[0]["runs_reaching_threshold"] == "1" and float(rows[0]["steps_to_threshold_mean"]) == 3
    report = (tmp_path / "report.md").read_text()
    assert "| a | 2 | 25.0 ± 63.5% |" in report  # t(0.975, 1) = 12.71 times a 5-point standard error
    assert "not reached in 3 (0/2)" in report and "| nvfp4 | 0.7000 | 8 | 41 |" in report
    assert summary_rows(runs, 0.35)[1]["final_reward_mean"] == pytest.approx(0.05)  # mean of 0.2/3 and 0.1/3
