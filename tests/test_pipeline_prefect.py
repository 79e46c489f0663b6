"""The orchestration end to end, with real components: a Prefect server on loopback and a process worker, the
`train-embedded` deployment of prefect.yaml run through the `prefect` CLI on params/tiny.yaml, its MLflow run and
registry version, then the retrain flow's promote and keep paths on that champion.

Slow on 2 cores (each flow loads SmolLM2-135M and generates): marked `slow`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.patience import patience
from tests.prefect_server import ROOT, prefect_cli, start, start_server, tail

pytest.importorskip("prefect")
pytest.importorskip("mlflow")

pytestmark = pytest.mark.slow

TINY = str(ROOT / "params" / "tiny.yaml")
DEFAULT = str(ROOT / "params" / "default.yaml")
SMOKE_MODEL = "qerl-smoke"  # tiny.yaml's registry: the smoke run never becomes the team's champion
POOL = "qerl-process"  # the work pool prefect.yaml names
# The flows after the deployment run need no more than one short step and two eval examples to show their logic.
QUICK = ["train.steps=1", "eval.n=2", "rollout.max_new_tokens=8", "eval.max_new_tokens=8"]


@dataclass
class Stack:
    api_url: str
    env: dict
    tmp: Path
    tracking_uri: str
    quantized_root: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory, request):
    """Prefect server (temporary PREFECT_HOME, SQLite) + an MLflow SQLite store, visible to this process and to
    every child. The scheduler service is off so the nightly cron deployment never fires during a test."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    tmp = tmp_path_factory.mktemp("pipeline")
    tracking_uri = f"sqlite:///{tmp}/mlflow.db"
    api_url, env = start_server(tmp, request, PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED="false",
                                PREFECT_WORKER_QUERY_SECONDS="2", MLFLOW_TRACKING_URI=tracking_uri)
    mp = pytest.MonkeyPatch()
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
        mp.setenv(key, env[key])
    request.addfinalizer(mp.undo)
    with temporary_settings(updates={PREFECT_API_URL: api_url, PREFECT_HOME: env["PREFECT_HOME"]}):
        yield Stack(api_url, env, tmp, tracking_uri, str(tmp / "quantized"))
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all()  # send what this process still holds before the server goes away
        EventsWorker.drain_all()


def prefect(stack: Stack, *args: str, timeout: float = patience(120)):
    return prefect_cli(stack.env, *args, timeout=timeout)


@pytest.fixture(scope="module")
def deployed_run(stack, request):
    """`prefect deploy --all`, a worker, and `prefect deployment run 'qerl-train/train-embedded' --watch`."""
    created = prefect(stack, "work-pool", "create", POOL, "--type", "process")
    assert created.returncode == 0, created.stdout + created.stderr
    deployed = prefect(stack, "deploy", "--all")
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    assert "qerl-retrain/retrain-nightly" in deployed.stdout
    log = stack.tmp / "worker.log"
    start(["prefect", "worker", "start", "--pool", POOL, "--type", "process"], stack.env, log, request)
    out_dir = stack.tmp / "runs" / "deployed"
    run = prefect(stack, "deployment", "run", "qerl-train/train-embedded", "--param", f"params={TINY}",
                  "--param", f"out_dir={out_dir}", "--param", f"quantized_root={stack.quantized_root}",
                  "--watch", "--watch-timeout", "1500", timeout=patience(1600))
    return run, out_dir, log


def test_deployment_run_completes_with_an_mlflow_run(stack, deployed_run):
    from mlflow import MlflowClient

    run, out_dir, worker_log = deployed_run
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n--- worker ---\n{tail(worker_log, 80)}"
    assert "Completed" in run.stdout
    assert (out_dir / "adapter" / "adapter_model.safetensors").is_file()

    client = MlflowClient(stack.tracking_uri)
    experiment = client.get_experiment_by_name("qerl")
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.`qerl.flow` = 'train'")
    assert len(runs) == 1
    mlrun = runs[0]
    # named by what differs (no -S overrides but the deployment's tracking.backend), and tagged for filtering
    tags = mlrun.data.tags
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == f"nvfp4-aqn tiny {tags['qerl.settings_hash']}"
    assert tags["qerl.params"] == "tiny" and tags["qerl.params_file"] == TINY and "qerl.overrides" not in tags
    assert mlrun.data.params["rollout.group_size"] == "2" and mlrun.data.params["aqn.enabled"] == "True"
    rewards = client.get_metric_history(mlrun.info.run_id, "reward_mean")
    assert [m.step for m in rewards] == [1, 2]
    assert [m.step for m in client.get_metric_history(mlrun.info.run_id, "eval/accuracy")] == [1, 2]
    assert {"entropy", "sigma", "eval/accuracy"} <= set(mlrun.data.metrics)
    adapter = {f.path for f in client.list_artifacts(mlrun.info.run_id, "adapter")}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= adapter
    plots = {f.path for f in client.list_artifacts(mlrun.info.run_id, "plots")}
    assert {"plots/reward_curve.png", "plots/training_curves.png"} <= plots
    assert {f.path for f in client.list_artifacts(mlrun.info.run_id, "eval")} == {"eval/samples.json"}

    champion = client.get_model_version_by_alias(SMOKE_MODEL, "champion")  # the first version becomes champion
    assert champion.run_id == mlrun.info.run_id and "eval.accuracy" in champion.tags
    assert client.search_registered_models() == [client.get_registered_model(SMOKE_MODEL)]  # not the team's model


def _task_states(flow_run_id) -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name.rsplit("-", 1)[0]: r.state.name for r in runs}


@pytest.fixture(scope="module")
def incoming(stack):
    """A 'new data' drop for the retrain flow: the newest *.jsonl in the folder is what it trains on."""
    from qerl.flows.stages import prepare
    from qerl.config import load_settings

    folder = stack.tmp / "incoming"
    written = prepare(load_settings(TINY, ["data.seed=1"]), stack.tmp / "prepared")
    folder.mkdir()
    (folder / "old.jsonl").write_text("not read: an older file\n")
    time.sleep(0.01)
    newest = folder / "new.jsonl"
    newest.write_text(written["train"].read_text())
    return folder, newest


@pytest.mark.parametrize("min_improvement, promoted", [(-1.0, True), (1.0, False)], ids=["promote", "keep"])
def test_retrain_promotes_only_a_better_adapter(stack, deployed_run, incoming, min_improvement, promoted):
    """The margin makes "beats" certain: accuracies lie in [0, 1], so -1 always promotes and +1 never does."""
    from mlflow import MlflowClient

    from qerl.flows.retrain import retrain

    assert deployed_run[0].returncode == 0, "needs the champion the deployment run registered"
    client = MlflowClient(stack.tracking_uri)
    before = client.get_model_version_by_alias(SMOKE_MODEL, "champion")
    folder, newest = incoming
    state = retrain(params=TINY, overrides=QUICK, data_dir=str(folder),
                    min_improvement=min_improvement, out_dir=str(stack.tmp / "runs" / f"retrain-{promoted}"),
                    quantized_root=stack.quantized_root, return_state=True)
    result = state.result()
    after = client.get_model_version_by_alias(SMOKE_MODEL, "champion")

    assert result["promoted"] is promoted
    assert result["previous_champion_version"] == str(before.version)
    assert (str(after.version) == result["candidate_version"]) is promoted
    assert (after.version == before.version) is not promoted
    assert ("promoted" if promoted else "kept champion") in result["verdict"]
    assert f"by more than {min_improvement:g}" in result["verdict"]
    mlrun = client.get_run(result["run_id"])
    assert mlrun.data.tags["promoted"] == str(promoted) and mlrun.data.tags["data"] == str(newest)
    assert mlrun.data.tags["parent_version"] == str(before.version)
    assert "champion_eval/accuracy" in mlrun.data.metrics and "eval/accuracy" in mlrun.data.metrics
    candidate = client.get_model_version(SMOKE_MODEL, result["candidate_version"])
    assert candidate.tags["promoted"] == str(promoted)
    # the base was quantized by the deployment run: this flow run took it from Prefect's cache
    assert _task_states(state.state_details.flow_run_id)["quantize-checkpoint"] == "Cached"


def test_evaluate_flow_scores_the_champion(stack, deployed_run):
    from mlflow import MlflowClient

    from qerl.flows.evaluate import evaluate

    assert deployed_run[0].returncode == 0, "needs the champion the deployment run registered"
    out = stack.tmp / "runs" / "eval-champion"
    result = evaluate(params=TINY, overrides=["eval.max_new_tokens=8"], alias="champion", out_dir=str(out), limit=2,
                      quantized_root=stack.quantized_root)
    assert result["metrics"]["num_examples"] == 2 and (out / "metrics.json").is_file()
    assert Path(result["adapter"], "adapter_model.safetensors").is_file()  # downloaded from the registry
    mlrun = MlflowClient(stack.tracking_uri).get_run(result["run_id"])
    assert mlrun.data.tags["qerl.flow"] == "evaluate" and "eval/accuracy" in mlrun.data.metrics


def test_bf16_lora_run_sits_next_to_the_nvfp4_run(stack, deployed_run):
    """The baseline of the comparison: same experiment and metric names, told apart by run name and tags."""
    from mlflow import MlflowClient

    from qerl.flows.train import train

    assert deployed_run[0].returncode == 0
    result = train(params=TINY, overrides=["quant.scheme=bf16", "aqn.enabled=false", *QUICK],
                   out_dir=str(stack.tmp / "runs" / "bf16"), quantized_root=stack.quantized_root)
    client = MlflowClient(stack.tracking_uri)
    runs = {r.info.run_name.split()[0]: r for r in client.search_runs(
        [client.get_experiment_by_name("qerl").experiment_id], filter_string="tags.`qerl.flow` = 'train'")}
    assert set(runs) == {"nvfp4-aqn", "bf16-lora"} and runs["bf16-lora"].info.run_id == result["run_id"]
    assert runs["bf16-lora"].info.run_name.startswith("bf16-lora tiny quant.scheme=bf16 aqn.enabled=false ")
    assert set(runs["bf16-lora"].data.metrics) == set(runs["nvfp4-aqn"].data.metrics)
    assert runs["bf16-lora"].data.metrics["sigma"] == 0.0 and runs["bf16-lora"].data.tags["quant.scheme"] == "bf16"
    assert runs["bf16-lora"].data.params["quant.quantized_path"] == "None"  # nothing quantized for the baseline


def test_the_nightly_retrain_continues_a_smoke_champion_of_another_adapter_shape(stack, deployed_run, incoming):
    """The nightly's params (default.yaml: rank 16, alpha 32) against a champion trained on tiny.yaml's (rank 8, alpha
    16): it failed on the adapter's shape ("settings (rank 8, ...) disagree with ... (rank 16, ...)"); now the retrain
    continues the champion with the adapter settings its run recorded, and says so. Quick sizes, the smoke registry."""
    from mlflow import MlflowClient

    from qerl.flows.retrain import retrain

    assert deployed_run[0].returncode == 0, "needs the champion the deployment run registered"
    folder, _ = incoming
    result = retrain(params=DEFAULT, data_dir=str(folder), min_improvement=1.0,
                     out_dir=str(stack.tmp / "runs" / "retrain-default"), quantized_root=stack.quantized_root,
                     overrides=[*QUICK, f"tracking.registered_model={SMOKE_MODEL}", "rollout.prompts_per_step=2",
                                "rollout.group_size=2", "grpo.micro_batch_size=4"])
    assert result["promoted"] is False  # +1 is never beaten: the champion stays
    mlrun = MlflowClient(stack.tracking_uri).get_run(result["run_id"])
    assert mlrun.data.params["lora.rank"] == "8" and mlrun.data.params["lora.alpha"] == "16.0"
    assert mlrun.info.run_name.startswith("retrain-nvfp4-aqn default train.steps=1 ")


def test_the_nightly_without_a_champion_fails_in_one_line_and_no_traceback(stack, deployed_run):
    """The README's order (smoke run, then the retrain deployment) met "run the train flow first" inside two Prefect
    tracebacks in the worker's log, for an expected refusal. The flow run now ends Failed with the line as its
    message. A registry nobody trained, so that the other tests' champions do not matter. ~30 s: one flow process."""
    run, _, log = deployed_run
    assert run.returncode == 0, "needs the worker the deployment run started"
    before = log.read_text()
    refused = prefect(stack, "deployment", "run", "qerl-retrain/retrain-nightly",
                      "--param", f"out_dir={stack.tmp / 'runs' / 'no-champion'}",
                      "--param", 'overrides=["tracking.registered_model=never-trained"]',
                      "--watch", "--watch-timeout", "600", timeout=patience(700))
    assert refused.returncode != 0 and "Failed" in refused.stdout, refused.stdout
    deadline = time.monotonic() + patience(30)  # the worker writes the run's end after the CLI saw it
    while "has no 'champion' version yet" not in log.read_text()[len(before):] and time.monotonic() < deadline:
        time.sleep(0.5)
    worker = log.read_text()[len(before):]
    assert "Finished in state Failed(\"registered model 'never-trained' has no 'champion' version yet" in worker, \
        worker[-3000:]
    assert "Traceback" not in worker, worker[-6000:]
