"""The seeds experiment's driver (benchmarks/aqn_seeds.py: plan order, settings checks, a worker's failures and
deadline) and its analysis (benchmarks/analyze_aqn_seeds.py) on synthetic results whose truth is known."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


driver = _module("aqn_seeds")
analysis = _module("analyze_aqn_seeds")


# ---------------------------------------------------------------------------------------------- driver


def test_the_plan_measures_entropy_first_then_goes_seed_by_seed_so_any_prefix_is_balanced(tmp_path):
    arms = {a: driver.ARMS[a] for a in ("bf16-lora", "nvfp4", "nvfp4-aqn")}
    jobs = driver.plan(tmp_path, ["add2", "add3"], arms, [0, 1, 2], [])
    entropy = [j for j in jobs if j.kind == "entropy"]
    assert jobs[:len(entropy)] == entropy  # first
    assert {(j.task, j.arm) for j in entropy} == {(t, s) for t in ("add2", "add3") for s in ("bf16", "nvfp4")}
    runs = jobs[len(entropy):]
    assert len(runs) == 3 * 3 * 2
    for k in range(0, len(runs), 6):  # every block of 6 = one seed, every (arm, task) once
        block = runs[k:k + 6]
        assert {j.seed for j in block} == {k // 6}
        assert {(j.arm, j.task) for j in block} == {(a, t) for a in arms for t in ("add2", "add3")}
    run = runs[0]
    assert run.folder == tmp_path / "add2" / "bf16-lora" / "seed-00"
    assert "train.seed=0" in run.overrides and "aqn.seed=0" in run.overrides
    assert run.overrides.index("eval.n=500") < run.overrides.index("quant.scheme=bf16")  # the task, then the arm


def test_a_rerun_with_other_settings_is_refused_before_anything_trains(tmp_path):
    from qerl.config import ConfigError

    arms = {"nvfp4": driver.ARMS["nvfp4"]}
    driver.check_and_record(driver.plan(tmp_path, ["add2"], arms, [0], ["train.steps=3"]))
    driver.check_and_record(driver.plan(tmp_path, ["add2"], arms, [0, 1], ["train.steps=3"]))  # a seed more: fine
    with pytest.raises(ConfigError, match="other settings"):
        driver.check_and_record(driver.plan(tmp_path, ["add2"], arms, [0], ["train.steps=4"]))


def test_a_worker_records_a_failed_run_goes_on_and_stops_taking_runs_when_time_is_short(tmp_path, monkeypatch):
    arms = {"bf16-lora": driver.ARMS["bf16-lora"], "nvfp4": driver.ARMS["nvfp4"]}
    jobs = [j for j in driver.plan(tmp_path, ["add2"], arms, [0, 1, 2], []) if j.kind == "run"]
    driver.check_and_record(jobs)
    done, clock = [], [0.0]

    def fake_run(job, entropy_prompts):
        if job.arm == "nvfp4" and job.seed == 0:
            clock[0] += 10  # fails after 10 s
            raise ValueError("boom")
        clock[0] += 100  # a run takes 100 s
        done.append((job.arm, job.seed))
        return {"task": job.task, "arm": job.arm, "seed": job.seed, "eval": {"accuracy": 0.5}, "seconds": 100.0}

    monkeypatch.setattr(driver, "run_job", fake_run)
    monkeypatch.setattr(driver, "time", type("Clock", (), {"time": staticmethod(lambda: clock[0])}))
    # Deadline at 250 s. Before the first run the estimate is --first-estimate-s (100 s), after it 1.2 x 100 s:
    # runs start at 0 (bf16 seed 0), 100 (nvfp4 seed 0: fails at 110), 110 (bf16 seed 1, until 210); at 210 the
    # next would end at 330: the worker stops.
    assert driver.work(jobs, tmp_path, 250.0, 100.0, 2) == 0
    assert done == [("bf16-lora", 0), ("bf16-lora", 1)]
    error = json.loads((tmp_path / "add2" / "nvfp4" / "seed-00" / "error.json").read_text())
    assert error["error"] == "ValueError: boom"
    status = driver.status(jobs, tmp_path, 0.0)
    assert status["done"] == 2 and [f["job"] for f in status["failed"]] == ["add2/nvfp4/seed-00"]
    assert status["remaining"] == ["add2/nvfp4/seed-01", "add2/bf16-lora/seed-02", "add2/nvfp4/seed-02"]


def test_a_cuda_error_ends_the_worker_so_a_fresh_process_takes_over(tmp_path, monkeypatch):
    jobs = [j for j in driver.plan(tmp_path, ["add2"], {"nvfp4": driver.ARMS["nvfp4"]}, [0, 1], []) if j.kind == "run"]
    driver.check_and_record(jobs)
    monkeypatch.setattr(driver, "run_job", lambda job, n: (_ for _ in ()).throw(
        RuntimeError("CUDA error: an illegal memory access was encountered")))
    assert driver.work(jobs, tmp_path, None, 60.0, 2) == 3
    assert (jobs[0].folder / "error.json").is_file() and not (jobs[1].folder / ".attempts").exists()


# ---------------------------------------------------------------------------------------------- statistics


def test_pairs_are_two_sided_and_find_a_planted_difference_but_none_where_there_is_none(tmp_path):
    _synthetic(tmp_path / "results")
    pairs = [("nvfp4", "bf16-lora"), ("nvfp4-aqn-entropy", "nvfp4"), ("no-such-arm", "nvfp4")]
    fragment = analysis.analyze(tmp_path / "results", tmp_path / "report", threshold=0.3, n_boot=2000, seed=0,
                                pairs=pairs)
    rows = [c for c in csv.DictReader((tmp_path / "report" / "claims.csv").open()) if c["claim"].startswith("same")]
    verdict = {(c["task"], c["arm"], c["against"], c["metric"]): c["verdict"] for c in rows}
    assert len(rows) == 2 * 2 * 2  # two known pairs x two metrics x two tasks; the unknown arm is skipped
    for task in ("add2", "add3"):
        assert verdict[(task, "nvfp4", "bf16-lora", "auc")] == "no difference found"
        assert verdict[(task, "nvfp4-aqn-entropy", "nvfp4", "accuracy")] == "differs"  # lower: two-sided
    assert "add2, nvfp4 vs bf16-lora (auc): no difference found; the difference lies in [" in fragment.read_text()
    assert analysis.main(["--results", str(tmp_path / "results"), "--report", str(tmp_path / "r2"), "--bootstrap",
                          "200", "--pair", "nvfp4=bf16-lora"]) == 0
    with pytest.raises(SystemExit):
        analysis.main(["--results", str(tmp_path / "results"), "--pair", "nvfp4"])


def test_the_statistics_helpers():
    assert analysis.wilson(0, 20)[0] == 0.0 and analysis.wilson(0, 20)[1] == pytest.approx(0.161, abs=1e-3)
    assert analysis.wilson(10, 20) == pytest.approx((0.299, 0.701), abs=1e-3)
    rng = np.random.default_rng(0)
    assert analysis.sign_flip_p([1, 2, 3, 4, 5], rng, 1000) == pytest.approx(2 / 32)  # exact: all + or all -
    assert analysis.sign_flip_p([0, 0, 0], rng, 1000) == 1.0
    assert analysis.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    rewards = np.array([0.0, 0.1, 0.2, 0.4, 0.5, np.nan, 0.6])
    assert analysis.steps_to_threshold(rewards, 0.3) == 5  # step 4: (0.1 + 0.2 + 0.4) / 3 < 0.3; step 5: 0.37
    assert analysis.steps_to_threshold(rewards, 0.55) == 7  # step 7 averages 0.5 and 0.6: the logged steps only
    assert analysis.steps_to_threshold(rewards, 0.9) is None
    low, high = analysis.bootstrap_ci(np.arange(100.0), rng, 4000)
    assert low < 49.5 < high and high - low == pytest.approx(2 * 1.96 * np.std(np.arange(100.0)) / 10, rel=0.15)


# ---------------------------------------------------------------------------------------------- synthetic results

STEPS, SEEDS = 20, 20
# Per arm: the reward curve's slope per step, and the held-out accuracy's mean. nvfp4-aqn is truly better than
# nvfp4, nvfp4-aqn-entropy truly worse, bf16-lora and nvfp4 truly equal.
TRUTH = {"bf16-lora": (0.02, 0.40), "qlora-bnb": (0.02, 0.40), "nvfp4": (0.02, 0.40),
         "nvfp4-aqn": (0.035, 0.55), "nvfp4-aqn-entropy": (0.005, 0.20)}


def _synthetic(root: Path) -> None:
    rng = np.random.default_rng(7)
    for task in ("add2", "add3"):
        for arm, (slope, acc) in TRUTH.items():
            for seed in range(SEEDS):
                folder = root / task / arm / f"seed-{seed:02d}"
                folder.mkdir(parents=True)
                (folder / "job.json").write_text("{}")
                rows = [{"step": s, "reward_mean": float(np.clip(slope * s + rng.normal(0, 0.05), 0, 1)),
                         "entropy": float(1.5 + rng.normal(0, 0.1)) if s > 1 else (1.8 if arm == "bf16-lora" else 1.6),
                         "sigma": 0.01 if arm == "nvfp4-aqn-entropy" else 0.0} for s in range(1, STEPS + 1)]
                (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2')
                (folder / "result.json").write_text(json.dumps(
                    {"task": task, "arm": arm, "seed": seed, "eval": {"accuracy": float(acc + rng.normal(0, 0.05))},
                     "seconds": 30.0}))
        for scheme, value in (("bf16", 1.79), ("nvfp4", 1.59)):
            folder = root / task / "base_entropy" / scheme
            folder.mkdir(parents=True)
            (folder / "result.json").write_text(json.dumps({"task": task, "scheme": scheme, "entropy": value,
                                                            "completions": 256, "tokens": 4000}))
    unfinished = root / "add3" / "nvfp4" / "seed-20"
    unfinished.mkdir()
    (unfinished / "job.json").write_text("{}")


def test_the_analysis_finds_the_planted_effects_and_no_effect_where_there_is_none(tmp_path):
    _synthetic(tmp_path / "results")
    fragment = analysis.analyze(tmp_path / "results", tmp_path / "report", threshold=0.3, n_boot=2000, seed=0)
    claims = list(csv.DictReader((tmp_path / "report" / "claims.csv").open()))
    verdict = {(c["task"], c["arm"], c["against"], c["metric"]): c for c in claims}
    for task in ("add2", "add3"):
        assert verdict[(task, "nvfp4-aqn", "nvfp4", "auc")]["verdict"] == "holds"
        assert verdict[(task, "nvfp4-aqn", "nvfp4", "accuracy")]["verdict"] == "holds"
        assert verdict[(task, "nvfp4-aqn-entropy", "nvfp4", "accuracy")]["verdict"] == "contradicted"
        same = verdict[(task, "nvfp4", "bf16-lora", "auc")]
        assert same["verdict"] == "not resolved" and float(same["low"]) < 0 < float(same["high"])
        planted = verdict[(task, "nvfp4-aqn", "nvfp4", "accuracy")]
        assert float(planted["low"]) < 0.15 < float(planted["high"])  # the interval covers the true difference
        assert int(planted["seeds"]) == SEEDS
    rows = {(r["task"], r["arm"]): r for r in csv.DictReader((tmp_path / "report" / "summary.csv").open())}
    assert int(rows[("add2", "nvfp4-aqn")]["learned"]) == SEEDS  # reaches 0.3 by step ~9
    assert int(rows[("add2", "nvfp4-aqn-entropy")]["learned"]) == 0  # tops out at ~0.1
    assert float(rows[("add2", "bf16-lora")]["step1_entropy"]) == pytest.approx(1.8)
    assert math.isnan(float(rows[("add2", "nvfp4-aqn-entropy")]["step1_entropy"]))  # noisy first rollouts: not the base's
    assert math.isinf(float(rows[("add2", "nvfp4-aqn-entropy")]["steps_to_threshold_median"]))
    text = fragment.read_text()
    assert "| add2 | bf16 | 1.790 |" in text and "1 unfinished" in text and "not reached in 20" in text
    for name in ("reward_add2.png", "accuracy_add2.png", "reward_add3.png", "accuracy_add3.png"):
        assert (tmp_path / "report" / name).stat().st_size > 10_000
    # Seeded: the same results give the same report.
    again = analysis.analyze(tmp_path / "results", tmp_path / "report2", threshold=0.3, n_boot=2000, seed=0)
    assert again.read_text() == text
