"""Fast checks of the pipeline's declarative parts and small helpers: params files, dvc.yaml, prefect.yaml, the DVC
stage helpers, the quantization cache key, the retry and promotion rules."""

from __future__ import annotations

import csv
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from qerl.config import load_settings
from tests.patience import patience

ROOT = Path(__file__).resolve().parent.parent


def _flat(path: str) -> dict:
    return load_settings(ROOT / path).to_flat_dict()


def test_bf16_lora_params_differ_from_the_default_only_in_the_base():
    """The two runs `mlflow ui` compares must be the same experiment but for the quantized base and AQN."""
    default, bf16 = _flat("params/default.yaml"), _flat("params/bf16_lora.yaml")
    differing = {k for k in default if default[k] != bf16[k]}
    allowed = {"quant.scheme", "aqn.enabled", "train.out_dir", "eval.out_dir", "tracking.backend"}
    assert {"quant.scheme", "aqn.enabled"} <= differing <= allowed
    assert bf16["quant.scheme"] == "bf16" and bf16["aqn.enabled"] is False


def test_tiny_params_are_tiny():
    s = load_settings(ROOT / "params/tiny.yaml")
    assert s.model.path == "embedded" and s.train.steps <= 2 and s.train.eval_every >= 1
    assert s.rollout.prompts_per_step * s.rollout.group_size <= 4 and s.rollout.max_new_tokens <= 16
    assert s.eval.n <= 4 and s.tracking.backend == "mlflow"


def _dvc_params(stage: dict) -> list[str]:
    keys = []
    for entry in stage.get("params", []):
        for file, names in entry.items():
            assert file == "params/default.yaml", "DVC stages read the default params file, named explicitly"
            keys += names
    return keys


@pytest.mark.parametrize("params_file", ["params/default.yaml", "params/tiny.yaml"])
def test_dvc_params_exist_in_the_params_files(params_file):
    """DVC refuses to run a stage whose tracked parameter is missing from the file (it does not know qerl's
    defaults); tiny.yaml stands in for default.yaml in the DVC test, so both must spell out every tracked key."""
    raw = yaml.safe_load((ROOT / params_file).read_text())
    for name, stage in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].items():
        for key in _dvc_params(stage):
            node = raw
            for part in key.split("."):
                assert isinstance(node, dict) and part in node, f"stage {name}: {key} is not set in {params_file}"
                node = node[part]


def test_dvc_pipeline_is_valid():
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    listed = subprocess.run(["dvc", "stage", "list"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=patience(120))
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[0] for line in listed.stdout.splitlines()] == ["fingerprint", "prepare", "quantize", "train",
                                                                          "evaluate"]
    dag = subprocess.run(["dvc", "dag", "--dot"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=patience(120))
    assert dag.returncode == 0, dag.stderr
    for edge in ('"fingerprint" -> "prepare"', '"prepare" -> "train"', '"quantize" -> "train"', '"train" -> "evaluate"'):
        assert edge in dag.stdout


def test_prefect_yaml_deployments():
    load_flow_from_entrypoint = pytest.importorskip("prefect.flows").load_flow_from_entrypoint
    config = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in config["deployments"]}
    assert set(deployments) == {"train-embedded", "retrain-nightly"}
    assert "schedules" not in deployments["train-embedded"]  # on demand
    assert deployments["retrain-nightly"]["schedules"][0]["cron"]
    for d in deployments.values():
        assert d["work_pool"]["name"] == "qerl-process"
        # as a worker loads it: the file by its path (the flows import as qerl.flows.*, the folder stays flows/)
        flow = load_flow_from_entrypoint(str(ROOT / d["entrypoint"]))
        assert set(d["parameters"]) <= set(flow.parameters.properties)


def test_prepare_writes_what_training_reads(tmp_path):
    from qerl.flows.stages import curves, prepare
    from qerl.data import problems as data

    settings = load_settings(ROOT / "params/tiny.yaml")
    written = prepare(settings, tmp_path)
    generated = data.arithmetic_task("train", settings.data.n, digits=2, operators="+-")
    loaded = data.load_dataset(str(written["train"]))
    assert [(e.question, e.gold) for e in loaded] == [(e.question, e.gold) for e in generated]
    assert len(data.load_dataset(str(written["test"]))) == settings.eval.n

    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text('{"step": 1, "reward_mean": 0.0}\n{"step": 2, "reward_mean": 0.5, "sigma": 0.01}\n')
    rows = list(csv.DictReader(curves(jsonl, tmp_path / "curves.csv").open()))
    assert rows[1] == {"step": "2", "reward_mean": "0.5", "sigma": "0.01"} and rows[0]["sigma"] == ""


def test_quantization_cache_key(tmp_path):
    pytest.importorskip("prefect")
    from qerl.tasks.quantize import code_version, quantized_dir

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    first = quantized_dir(str(model), "nvfp4", "runs/q")
    assert first == quantized_dir(str(model), "nvfp4", "runs/q") and first.parent == Path("runs/q")
    assert first.name.startswith("model-nvfp4-")
    assert quantized_dir(str(model), "mxfp4", "runs/q") != first
    time.sleep(0.01)
    (model / "config.json").write_text("{ }")  # a rewritten source is a new key
    assert quantized_dir(str(model), "nvfp4", "runs/q") != first
    assert code_version() == code_version() and len(code_version()) == 12


def test_retry_only_transient_faults():
    pytest.importorskip("prefect")
    from qerl.tasks.retry import is_transient

    assert is_transient(ConnectionResetError()) and is_transient(TimeoutError()) and is_transient(OSError(5, "EIO"))
    assert not is_transient(FileNotFoundError()) and not is_transient(ValueError()) and not is_transient(KeyError())


def test_promotion_rule():
    pytest.importorskip("prefect")
    from qerl.flows.retrain import beats

    assert beats(0.6, 0.5) and not beats(0.5, 0.5) and not beats(0.4, 0.5)
    assert not beats(0.55, 0.5, min_improvement=0.1) and beats(0.0, 0.0, min_improvement=-1)


def test_the_verdict_names_a_margin_only_when_there_is_one():
    pytest.importorskip("prefect")
    from qerl.flows.retrain import margin

    assert margin(0.0) == "" and margin(0.01) == " by more than 0.01" and margin(-1) == " by more than -1"


def test_a_retrain_takes_the_champions_adapter_settings_and_refuses_another_base():
    """The champion's run recorded its settings: its adapter's win over the params; a champion on another base is
    refused in one line saying what to do (exit 2: a ConfigError)."""
    pytest.importorskip("prefect")
    from qerl.flows.retrain import ChampionMismatch, champion_overrides
    from qerl.config import ConfigError

    smoke = {k: str(v) for k, v in load_settings(ROOT / "params/tiny.yaml").to_flat_dict().items()}
    nightly = load_settings(ROOT / "params/default.yaml")
    assert champion_overrides(smoke, nightly, "1") == ["lora.rank=8", "lora.alpha=16.0"]
    assert load_settings(ROOT / "params/default.yaml", ["lora.rank=8", "lora.alpha=16.0"]).lora.rank == 8
    assert champion_overrides({}, nightly, "1") == []  # a version without recorded settings: the params' own
    with pytest.raises(ChampionMismatch) as info:
        champion_overrides({**smoke, "quant.scheme": "bf16"}, nightly, "3")
    assert isinstance(info.value, ConfigError) and str(info.value) == (
        "champion version 3 of 'qerl-adapter' was trained on quant.scheme=bf16, not quant.scheme=nvfp4: retrain with "
        "its base (-S quant.scheme=bf16), or train an adapter on this base with qerl.flows.train and move the 'champion' "
        "alias to its version (MLflow UI, Models)")


def test_a_smoke_run_registers_apart_from_the_team_model():
    """tiny.yaml's first registered adapter becomes the champion of its own registry, not of the one the nightly
    retrain (default.yaml) continues."""
    assert _flat("params/tiny.yaml")["tracking.registered_model"] != _flat("params/default.yaml")[
        "tracking.registered_model"]


def test_run_names_and_tags_say_what_differs():
    pytest.importorskip("prefect")
    from qerl.flows.train import run_name, run_tags, settings_hash

    overrides = ["optim.lr=1e-4", "tracking.backend=mlflow"]
    settings = load_settings(ROOT / "params/default.yaml", overrides)
    digest = settings_hash(settings)
    assert run_name(settings, "params/default.yaml", overrides) == f"nvfp4-aqn default optim.lr=1e-4 {digest}"
    assert digest != settings_hash(load_settings(ROOT / "params/default.yaml"))  # the learning rate differs
    assert digest == settings_hash(load_settings(ROOT / "params/default.yaml", ["optim.lr=1e-4"]))  # tracking doesn't
    tags = run_tags(settings, "params/default.yaml", overrides)
    assert {k: tags[k] for k in ("qerl.params", "qerl.params_file", "qerl.overrides", "qerl.settings_hash")} == {
        "qerl.params": "default", "qerl.params_file": "params/default.yaml", "qerl.overrides": "optim.lr=1e-4",
        "qerl.settings_hash": digest}
    named = load_settings(ROOT / "params/default.yaml", ["tracking.run_name=mine"])
    assert run_name(named, "params/default.yaml", ["tracking.run_name=mine"]) == "mine"


HOLD_AND_QUANTIZE = """
import sys, time
from qerl.quant.checkpoint import quantize_checkpoint
from qerl.run.lock import output_lock
src, dst = sys.argv[1:3]
with output_lock(dst, hand_over=True):  # as a flow's quantize task holds it, its core call joining
    print("holding", flush=True)
    time.sleep(1)
    quantize_checkpoint(src, dst, "nvfp4", progress=False)
"""


def test_a_flow_waits_for_a_quantization_in_progress_and_reuses_it(tmp_path, tiny_llama_dir, caplog):
    """Two flows with Prefect homes of their own share no cache: the second used to fail (exit 2) on the folder's
    lock while the first quantized. Now it says once whom it waits for, then takes the folder the first wrote. ~8 s
    (a child that imports torch)."""
    pytest.importorskip("prefect")
    import socket
    import subprocess
    import sys

    from qerl.tasks.quantize import quantize_checkpoint, quantized_dir

    root = tmp_path / "quantized"
    dst = quantized_dir(str(tiny_llama_dir), "nvfp4", str(root))
    first = subprocess.Popen([sys.executable, "-c", HOLD_AND_QUANTIZE, str(tiny_llama_dir), str(dst)], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline() == "holding\n"
        with caplog.at_level("INFO"):
            got = quantize_checkpoint.fn(str(tiny_llama_dir), "nvfp4", str(root))
    finally:
        first.communicate(timeout=patience(60))
    assert first.returncode == 0
    assert got == str(dst) and (dst / "config.json").is_file()
    assert [r.getMessage() for r in caplog.records] == [
        f"waiting for PID {first.pid} on host {socket.gethostname()}, which is quantizing {tiny_llama_dir} to nvfp4 "
        f"in {dst}; this run reuses it"]  # and it quantized nothing itself (the core would log its report)
