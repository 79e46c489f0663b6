"""The experiment flow on params/tiny.yaml with real Prefect and a real MLflow store: 2 arms x 1 seed x 1 step trained
by two worker processes (--jobs 2), the nested runs, the report files, then a rerun in this process that skips the
finished run and resumes the "crashed" one.

The base is the tests' tiny random Llama (conftest's `tiny_llama_dir`, with SmolLM2's tokenizer), not SmolLM2-135M:
what is checked here is the flow's bookkeeping (plan, nesting, skip and resume, workers, report), which does not
depend on the model; loading, quantizing and training SmolLM2 four times per test only made it slow. The real model
runs through the same `train_and_evaluate` in the deployment test (test_pipeline_prefect.py) and the DVC test."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

pytest.importorskip("prefect")
pytest.importorskip("mlflow")

pytestmark = pytest.mark.slow  # Prefect's temporary server, and for --jobs two worker processes with their own

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "params" / "tiny.yaml")
ARMS = ["bf16-lora", "nvfp4-aqn-entropy"]  # two base formats (so two step-0 entropies), the new schedule end to end
REPORT = {"reward_by_arm.png", "entropy_by_arm.png", "summary.csv", "base_entropy.csv", "report.md"}


def nested_runs(client, experiment_id, parent_id):
    return client.search_runs([experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")


def test_compare_flow_trains_in_workers_nests_runs_writes_the_report_and_skips_finished_runs_on_rerun(
        tmp_path, monkeypatch, tiny_llama_dir):
    """--jobs 2: two worker processes share the plan through per-run claim locks; the flow only reads their results
    back (it cannot train here: its own training is disabled), reports both arms and nests both MLflow runs. Then a
    rerun in this process (--jobs 1, training enabled) skips the finished run and resumes the "crashed" one.

    (One test for what were two, the in-process run and the --jobs run, each paying for a whole comparison: the rerun
    goes through the in-process path, the first run through the workers.)"""
    from mlflow import MlflowClient
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    import qerl.flows.compare as compare_flow

    def no_training_here(*args, **kwargs):
        raise AssertionError("the flow process trained a run itself")

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.delenv("PREFECT_API_URL", raising=False)  # Prefect's temporary local server, in a temporary home
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the workers import this checkout
    quick = [f"model.path={tiny_llama_dir}", "train.steps=1", "eval.n=2", "rollout.max_new_tokens=8",
             "eval.max_new_tokens=8", "aqn.target_entropy=1.0", f"tracking.tracking_uri={uri}",
             "tracking.experiment=compare-test"]
    out = tmp_path / "exp"

    def run(jobs: int):
        return compare_flow.compare(params=TINY, arms=ARMS, seeds=1, overrides=quick, out_dir=str(out),
                                    quantized_root=str(tmp_path / "quantized"), reward_threshold=0.5,
                                    entropy_prompts=2, jobs=jobs)

    with temporary_settings(updates={PREFECT_HOME: str(tmp_path / "prefect-home"), PREFECT_API_URL: None}):
        with monkeypatch.context() as patched:
            patched.setattr(compare_flow, "train_and_evaluate", no_training_here)
            first = run(jobs=2)

        assert sorted(r["arm"] for r in first["runs"]) == sorted(ARMS)
        assert all((out / "runs" / arm / "seed-0" / "result.json").is_file() for arm in ARMS)
        assert not list(out.glob("runs/*/seed-0/" + compare_flow.CLAIM))  # claims released
        client = MlflowClient(uri)
        parent = client.get_run(first["parent_run_id"])
        assert parent.info.status == "FINISHED" and parent.data.tags["qerl.flow"] == "compare"
        children = nested_runs(client, parent.info.experiment_id, parent.info.run_id)
        assert sorted((r.data.tags["arm"], r.data.tags["seed"]) for r in children) == [("bf16-lora", "0"),
                                                                                       ("nvfp4-aqn-entropy", "0")]
        for child in children:
            assert child.info.status == "FINISHED"
            assert {"reward_mean", "entropy", "sigma", "eval/accuracy"} <= set(child.data.metrics)
        entropy_arm = next(r for r in children if r.data.tags["arm"] == "nvfp4-aqn-entropy")
        assert entropy_arm.data.params["aqn.schedule"] == "entropy" and entropy_arm.data.metrics["sigma"] > 0
        logged = {Path(f.path).name for f in client.list_artifacts(parent.info.run_id, "report")}
        assert logged == REPORT
        report = out / "report"
        assert {p.name for p in report.iterdir()} == REPORT
        assert [r["arm"] for r in csv.DictReader((report / "summary.csv").open())] == ARMS
        entropies = {r["scheme"]: float(r["entropy"]) for r in csv.DictReader((report / "base_entropy.csv").open())}
        assert set(entropies) == {"bf16", "nvfp4"} and all(e > 0 for e in entropies.values())

        # Rerun: bf16-lora finished and is skipped; nvfp4-aqn-entropy "crashed" after its last checkpoint (its
        # result.json is gone) and resumes into the same MLflow run; nothing else is trained or measured again.
        finished = out / "runs" / "bf16-lora" / "seed-0"
        crashed = out / "runs" / "nvfp4-aqn-entropy" / "seed-0"
        untouched = {p: p.stat().st_mtime_ns for p in [finished / "metrics.jsonl", finished / "result.json",
                                                       out / "base_entropy" / "bf16.json"]}
        (crashed / "result.json").unlink()
        second = run(jobs=1)

    assert second["parent_run_id"] == first["parent_run_id"]
    assert {p: p.stat().st_mtime_ns for p in untouched} == untouched
    assert (crashed / "result.json").is_file()
    again = nested_runs(client, parent.info.experiment_id, parent.info.run_id)
    assert sorted(r.info.run_id for r in again) == sorted(r.info.run_id for r in children)
    assert all(r.info.status == "FINISHED" for r in again)
    assert client.get_run(first["parent_run_id"]).info.status == "FINISHED"

    # The same folder with other settings is refused up front, not skipped as if it were finished.
    from qerl.flows.compare import ARMS as BUILT_IN
    from qerl.flows.compare import plan_runs
    from qerl.config import ConfigError

    with pytest.raises(ConfigError, match=r"seed-0 holds a run started with other settings .* another --out$"):
        plan_runs(TINY, [*(o for o in quick if o != "train.steps=1"), "train.steps=2"],
                  {arm: BUILT_IN[arm] for arm in ARMS}, 1, out)
    assert len(plan_runs(TINY, quick, {arm: BUILT_IN[arm] for arm in ARMS}, 2, out)) == 4  # seed 1 is new: fine


def test_unknown_arm_is_a_one_line_error_before_anything_starts(tmp_path, main_here):
    from qerl.flows.compare import ARMS as BUILT_IN
    from qerl.flows.compare import main

    code, _, err = main_here(main, "--params", TINY, "--arms", "fp8-lora", "--out", tmp_path / "exp")
    assert code == 2
    # The list grows with each study; what a user relies on is that every built-in arm is named, in order.
    assert {"bf16-lora", "nvfp4", "fp8", "qlora-bnb"} <= set(BUILT_IN)
    assert err.strip().splitlines() == [
        "python -m qerl.flows.compare: error: --arms fp8-lora: unknown arm "
        f"(built-in: {', '.join(BUILT_IN)}; or define one as NAME:section.key=value,...)"]
    assert not (tmp_path / "exp").exists()


def test_a_defined_arm_may_hold_a_per_layer_scheme_map():
    from qerl.flows.arms import parse_arm

    assert parse_arm('fs:quant.scheme=nvfp4,quant.layer_schemes={"*.down_proj": fp8, "*.v_proj": fp8}') == (
        "fs", ["quant.scheme=nvfp4", 'quant.layer_schemes={"*.down_proj": fp8, "*.v_proj": fp8}'])


def test_jobs_must_be_positive(tmp_path):
    from qerl.flows.compare import main

    assert main(["--params", TINY, "--jobs", "0", "--out", str(tmp_path / "x")]) == 2
