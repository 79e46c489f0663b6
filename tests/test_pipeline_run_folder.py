"""The pipeline never touches a folder a live run holds: a second training flow on it fails in one line before MLflow
or Prefect start (in a fresh directory, where MLflow's database does not exist yet); `dvc repro` of the real `train`
stage on a folder a real `qerl train` is using leaves that run untouched and fails naming it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_run_folder import wait_for

ROOT = Path(__file__).resolve().parent.parent


def start(cmd: list[str], cwd: Path, env: dict, log: Path) -> subprocess.Popen:
    """A child in its own process group (Prefect starts a server of its own), output in `log`."""
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


@pytest.fixture
def long_params(tmp_path, tiny_llama_dir) -> Path:
    """params/tiny.yaml on the tiny random Llama (bf16: nothing to quantize), long enough to still be running when
    the second command starts."""
    raw = yaml.safe_load((ROOT / "params" / "tiny.yaml").read_text())
    raw["model"]["path"] = str(tiny_llama_dir)
    raw["quant"]["scheme"] = "bf16"
    raw["train"].update(steps=1000, save_every=1, eval_every=0)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_second_training_flow_on_a_folder_fails_before_mlflow_and_prefect_start(tmp_path, long_params, main_here,
                                                                                   monkeypatch):
    """The first flow is a `python -m qerl.flows.train` child; the second, the same command's main, runs here."""
    pytest.importorskip("prefect")
    pytest.importorskip("mlflow")
    from qerl.flows.train import main

    fresh = tmp_path / "fresh"  # no MLflow database yet: its set-up is where the loser used to die
    fresh.mkdir()
    run = fresh / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_HOME": str(tmp_path / "prefect-home"),
           "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    args = ["--params", str(long_params), "-S", "tracking.backend=mlflow", "--out", str(run)]
    first = start([sys.executable, "-m", "qerl.flows.train", *args], fresh, env, tmp_path / "first.log")
    try:
        wait_for(run / ".qerl.lock", first)
        monkeypatch.chdir(fresh)
        for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
            monkeypatch.delenv(key, raising=False)
        code, out, err = main_here(main, *args)
    finally:
        stop(first)
    assert code == 2
    assert out == ""  # no Prefect start-up output
    assert err.splitlines() == [
        f"python -m qerl.flows.train: error: run folder {run} is in use by PID {first.pid} on host {socket.gethostname()} "
        f"(lock file {run / '.qerl.lock'}); wait for it to finish or stop it, or choose another folder"]


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "qerl-test", "GIT_AUTHOR_EMAIL": "test@qerl",
                        "GIT_COMMITTER_NAME": "qerl-test", "GIT_COMMITTER_EMAIL": "test@qerl"})


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_dvc_repro_and_exp_run_leave_a_live_run_untouched_and_name_it(tmp_path, tiny_llama_dir):
    """The repository's own `train` stage (command and outputs as committed in dvc.yaml) in a DVC repository of its
    own: reproduced once, then continued by a real `qerl train --resume` while `dvc repro -f` and `dvc exp run -f`
    try to run the stage again on the same folder."""
    pytest.importorskip("dvc")
    repo = tmp_path / "repo"
    (repo / "params").mkdir(parents=True)
    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]
    stage["deps"] = ["data/prepared/train.jsonl", "runs/dvc/quantized"]  # the upstream stages' outputs, made here
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": stage}}, sort_keys=False))
    raw = yaml.safe_load((ROOT / "params" / "tiny.yaml").read_text())
    raw["quant"]["scheme"] = "bf16"  # the "quantized" base below is the tiny Llama itself
    raw["train"].update(steps=2, save_every=1, eval_every=0)
    (repo / "params" / "default.yaml").write_text(yaml.safe_dump(raw))
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")  # runs/ is no git file, as in this repository
    (repo / "data" / "prepared").mkdir(parents=True)
    (repo / "data" / "prepared" / "train.jsonl").write_text("".join(
        json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(4)))
    shutil.copytree(tiny_llama_dir, repo / "runs" / "dvc" / "quantized")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DVC_NO_ANALYTICS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # `qerl` of this environment
    git(repo, "init", "-q")
    subprocess.run(["dvc", "init", "-q"], cwd=repo, env=env, check=True, capture_output=True)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "a repository with the train stage")
    done = subprocess.run(["dvc", "repro", "train"], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "the stage reproduced")  # an experiment's baseline, with the outputs' hashes

    run = repo / "runs" / "dvc" / "train"
    written_once = {name: snapshot(run / name) if (run / name).is_dir() else (run / name).read_bytes()
                    for name in ("adapter", "reward_curve.png", "training_curves.png")}  # the live run's, untouched
    command = stage["cmd"][0].split() + ["-S", "train.steps=1000"]
    command[command.index("--overwrite")] = "--resume"
    live = start(command, repo, env, tmp_path / "live.log")
    try:
        wait_for(run / "checkpoints" / "step-000003", live)  # holds the folder and has trained on
        for attempt in (["dvc", "repro", "-f", "train"], ["dvc", "exp", "run", "-f", "train"]):
            proc = subprocess.run(attempt, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
            assert proc.returncode != 0, proc.stdout + proc.stderr
            lines = (proc.stdout + proc.stderr).splitlines()
            assert [line.strip() for line in lines if "qerl: error:" in line] == [
                f"qerl: error: run folder runs/dvc/train is in use by PID {live.pid} on host {socket.gethostname()} "
                f"(lock file runs/dvc/train/.qerl.lock); wait for it to finish or stop it, or choose another folder"]
            assert live.poll() is None, (tmp_path / "live.log").read_text()  # the live run goes on
            rows = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
            assert rows == list(range(1, len(rows) + 1)) and len(rows) >= 3  # every row of the run, in order
            assert (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir())
            assert {name: snapshot(run / name) if (run / name).is_dir() else (run / name).read_bytes()
                    for name in written_once} == written_once
    finally:
        stop(live)


def test_the_training_flows_check_the_evaluation_data_before_training(tmp_path, long_params):
    """The final evaluation comes after the whole run: its `eval.n` is checked before anything is quantized or built."""
    pytest.importorskip("prefect")
    from qerl.flows.train import train_and_evaluate
    from qerl.config import load_settings

    table = tmp_path / "problems.csv"
    table.write_text("question,answer\nWhat is 1 + 1?,2\n")
    settings = load_settings(long_params, [f"eval.name={table}", "eval.n=5"])
    with pytest.raises(ValueError) as info:
        train_and_evaluate(settings, str(tmp_path / "run"), tracker=None)
    assert str(info.value) == (f"eval.n = 5: {table} has only 1 example (lower eval.n, or set it to null for all "
                               "of them)")
    assert not (tmp_path / "run").exists()
