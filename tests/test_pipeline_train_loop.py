"""The training flow on a tiny random Llama (Prefect's temporary server, a real MLflow store): in one process it runs
the trainer's own loop, writing what `qerl train` writes for the same parameters, DAPO resampling rounds included;
with nproc=2 it runs `qerl train` under torchrun (gloo on the CPU) and then evaluates and logs as one process does."""

from __future__ import annotations

import json
import os
import shlex
import signal
from pathlib import Path

import pytest
import yaml

from tests.test_distributed import TIMINGS
from tests.test_trainer import adapter_tensors

pytest.importorskip("prefect")

ROOT = Path(__file__).resolve().parent.parent


def odd_gold_length_reward(completion: str, gold: str) -> float:
    """Informative only for odd golds: an even-gold group scores 0 throughout, so DAPO must draw again."""
    return len(completion) / 100 if int(gold) % 2 else 0.0


@pytest.fixture
def params_file(tmp_path, tiny_llama_dir) -> Path:
    """params/tiny.yaml on the tiny random Llama (bf16 base: nothing to quantize), DAPO dynamic sampling on."""
    raw = yaml.safe_load((ROOT / "params" / "tiny.yaml").read_text())
    raw["model"]["path"] = str(tiny_llama_dir)
    raw["quant"]["scheme"] = "bf16"
    raw["grpo"].update(dynamic_sampling=True, max_resample_rounds=2)
    raw["train"].update(steps=3, rewards={f"{__name__}:odd_gold_length_reward": 1.0})
    raw["rollout"]["max_new_tokens"] = raw["eval"]["max_new_tokens"] = 8
    raw["tracking"]["backend"] = "none"
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def task_run_counts(flow_run_id) -> dict[str, int]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    counts: dict[str, int] = {}
    for r in runs:
        name = r.name.rsplit("-", 1)[0]
        counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.fixture
def prefect_home(tmp_path, monkeypatch):
    """Prefect's temporary local server in a temporary home, for the flow runs of one test."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(updates={PREFECT_HOME: str(tmp_path / "prefect-home"), PREFECT_API_URL: None}):
        yield


def test_the_flow_writes_what_the_command_line_writes_resampling_rounds_as_tasks(tmp_path, params_file,
                                                                                   prefect_home):
    from qerl.flows.train import train
    from qerl.cli import main as qerl_main

    assert qerl_main(["train", "--params", str(params_file), "--out", str(tmp_path / "cli")]) == 0
    state = train(params=str(params_file), out_dir=str(tmp_path / "flow"), return_state=True)
    result = state.result()
    tasks = task_run_counts(state.state_details.flow_run_id)

    expected, got = metrics(tmp_path / "cli"), metrics(tmp_path / "flow")
    assert [m["step"] for m in got] == [1, 2, 3]
    for e, g in zip(expected, got):
        assert e.keys() == g.keys()
        assert {k: e[k] for k in e.keys() - TIMINGS} == {k: g[k] for k in g.keys() - TIMINGS}
    ta, tb = adapter_tensors(tmp_path / "cli"), adapter_tensors(tmp_path / "flow")
    assert ta.keys() == tb.keys() and all((ta[k] == tb[k]).all() for k in ta)
    checkpoints = sorted(p.name for p in (tmp_path / "cli" / "checkpoints").iterdir())
    assert sorted(p.name for p in (tmp_path / "flow" / "checkpoints").iterdir()) == checkpoints

    rounds = sum(m["dynamic_sampling/rounds"] for m in got)
    assert rounds > len(got), "no step resampled: the test's data should draw an even-gold question"
    assert tasks["generate-rollouts"] == tasks["score-rewards"] == rounds  # each round is a task of its own
    assert tasks["grpo-update"] == 3 and tasks["export-adapter"] == 1
    assert tasks["evaluate"] == 3  # after steps 1 and 2 (train.eval_every: 1), and the final one
    assert (tmp_path / "flow" / "eval" / "step-000002" / "metrics.json").is_file()
    assert result["steps"] == 3 and Path(result["adapter"]) == tmp_path / "flow" / "adapter"


@pytest.mark.slow  # two training flows, each with its evaluation and registration: ~60 s on 2 busy cores
def test_a_resumed_flow_continues_its_mlflow_run(tmp_path, params_file, prefect_home):
    """`python -m qerl.flows.train --resume` used to open a second MLflow run, so a killed or stopped run's curves
    were split over two runs. The run folder records its MLflow run (flows/tracking.py RUN_RECORD) and the resumed
    flow reopens it: one run, every step's metrics, FINISHED again."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from qerl.flows.tracking import RUN_RECORD
    from qerl.flows.train import train

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    out = tmp_path / "run"
    overrides = ["grpo.dynamic_sampling=false", "train.eval_every=0", "tracking.backend=mlflow",
                 f"tracking.tracking_uri={uri}"]
    first = train(params=str(params_file), overrides=overrides, out_dir=str(out), max_steps=1)
    assert first["steps"] == 1 and (out / RUN_RECORD).is_file()
    resumed = train(params=str(params_file), overrides=overrides, out_dir=str(out), resume=True)
    assert resumed["steps"] == 3 and resumed["run_id"] == first["run_id"]

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("qerl").experiment_id])
    assert [r.info.run_id for r in runs] == [first["run_id"]] and runs[0].info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(first["run_id"], "reward_mean")] == [1, 2, 3]
    assert [m.step for m in client.get_metric_history(first["run_id"], "eval/accuracy")] == [1, 3]


STOPS_SENT: list[int] = []


def reward_that_stops_the_process_once(completion: str, gold: str) -> float:
    """SIGTERM to this process while the first step scores, as a preempted job gets it: the step finishes, its
    checkpoint is written and the training stops."""
    if not STOPS_SENT:
        STOPS_SENT.append(os.getpid())
        os.kill(os.getpid(), signal.SIGTERM)
    return len(completion) / 100


@pytest.mark.slow  # a champion's training flow, then a retrain stopped after step 1 and resumed: ~90 s
def test_a_stopped_retrain_says_the_command_that_resumes_it_and_that_command_does(tmp_path, params_file,
                                                                                    prefect_home, main_here):
    """A retrain stopped by SIGTERM said where its checkpoint was but no command (the flow had no --resume): the
    user's -S overrides, data folder and run folder were lost. The line now holds the whole command, shell-quoted,
    and running it finishes the retrain in the same MLflow run."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from qerl.flows.retrain import main
    from qerl.flows.tracking import RUN_RECORD
    from qerl.flows.train import train

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    quick = ["grpo.dynamic_sampling=false", "train.eval_every=0", "tracking.backend=mlflow",
             f"tracking.tracking_uri={uri}"]
    train(params=str(params_file), overrides=quick, out_dir=str(tmp_path / "champion"), max_steps=1)
    overrides = [*quick, f"train.rewards={{{__name__}:reward_that_stops_the_process_once: 1.0}}"]
    out, data = tmp_path / "retrain", tmp_path / "no new data"
    args = ["--params", str(params_file), *(a for o in overrides for a in ("-S", o)), "--data-dir", str(data),
            "--out", str(out)]

    STOPS_SENT.clear()
    code, _, err = main_here(main, *args)
    assert code == 143, err  # 128 + SIGTERM
    resume = shlex.join(["python", "-m", "qerl.flows.retrain", "--data-dir", str(data), "--min-improvement", "0.0",
                         "--params", str(params_file), *(a for o in overrides for a in ("-S", o)), "--out", str(out),
                         "--resume"])
    assert err.splitlines()[-1] == (f"python -m qerl.flows.retrain: stopped by SIGTERM after step 1 of 3 (checkpoint "
                                    f"{out / 'checkpoints' / 'step-000001'}); resume with: {resume}")
    stopped_run = json.loads((out / RUN_RECORD).read_text())["run_id"]

    code, summary, err = main_here(main, *shlex.split(resume)[3:])
    assert code == 0, err
    assert "resuming from" in err and summary.startswith(("promoted", "kept"))
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]
    client = MlflowClient(uri)
    run = client.get_run(stopped_run)  # the stopped run, continued
    assert run.info.status == "FINISHED" and run.data.tags["verdict"] in summary
    assert [m.step for m in client.get_metric_history(stopped_run, "reward_mean")] == [1, 2, 3]
    assert [m.step for m in client.get_metric_history(stopped_run, "eval/accuracy")] == [3]
    # the champion scored by each leg: in process at step 0, then from its folder beside the resumed checkpoint
    assert [m.step for m in client.get_metric_history(stopped_run, "champion_eval/accuracy")] == [0, 1]


@pytest.fixture
def child_imports_this_checkout(monkeypatch):
    """torchrun's ranks import qerl and the test's reward from this checkout, wherever pytest was started."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


@pytest.mark.slow  # a 2-process training job (each rank imports torch and loads the model) and an evaluation
def test_two_processes_train_then_the_flow_evaluates_logs_and_registers(tmp_path, params_file, prefect_home,
                                                                          child_imports_this_checkout):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from qerl.flows.train import train

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    out = tmp_path / "dp2"
    state = train(params=str(params_file), out_dir=str(out), nproc=2, return_state=True,
                  overrides=["grpo.dynamic_sampling=false", "tracking.backend=mlflow", f"tracking.tracking_uri={uri}"])
    result = state.result()
    tasks = task_run_counts(state.state_details.flow_run_id)

    assert tasks["torchrun-train"] == 1 and tasks["evaluate"] == 1  # the ranks train only: one final evaluation
    assert "grpo-update" not in tasks
    assert [m["step"] for m in metrics(out)] == [1, 2, 3] and result["steps"] == 3
    assert (out / "eval" / "final" / "metrics.json").is_file()
    client = MlflowClient(uri)
    run = client.get_run(result["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["grpo.dynamic_sampling"] == "False"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [1, 2, 3]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] == [3]
    adapter = {f.path for f in client.list_artifacts(run.info.run_id, "adapter")}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= adapter
    assert {f.path for f in client.list_artifacts(run.info.run_id, "plots")} == {"plots/reward_curve.png",
                                                                                   "plots/training_curves.png"}
    from qerl.config import load_settings

    registered = load_settings(params_file).tracking.registered_model  # tiny.yaml's: qerl-smoke
    assert client.get_model_version_by_alias(registered, "champion").run_id == run.info.run_id


def test_a_failed_job_fails_the_flow_with_its_last_lines(tmp_path, params_file, prefect_home,
                                                         child_imports_this_checkout):
    """3 prompts per step do not split over 2 processes: every rank exits with that line, torchrun with 1."""
    from qerl.flows.train import train
    from qerl.rl.launch import LaunchFailed

    with pytest.raises(LaunchFailed) as failed:
        train(params=str(params_file), overrides=["rollout.prompts_per_step=3"], out_dir=str(tmp_path / "dp2"),
              nproc=2)
    message = str(failed.value)
    assert "-m torch.distributed.run --standalone --nproc-per-node 2 " in message
    assert "-m qerl.cli train --params" in message and "exited with status 1; its last lines:" in message
    # the ranks' own lines, not torchrun's report that follows them
    assert "]:qerl: error: 3 prompts per step do not split over 2 processes" in message
    assert "ChildFailedError" not in message


def test_nproc_below_one_is_refused_in_a_line(params_file):
    from qerl.flows.train import train
    from qerl.config import ConfigError

    with pytest.raises(ConfigError, match=r"^nproc=0: must be >= 1 \(the number of training processes\)$"):
        train.fn(params=str(params_file), nproc=0)
