"""The MLflow tracker and registry against a real SQLite store, and the one-line error for an unreachable server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.patience import patience

pytest.importorskip("mlflow")

from qerl.flows.tracking import (DEFAULT_TRACKING_URI, LocalOnly, MlflowTracker, Registry,  # noqa: E402
                                 TrackingUnavailable, open_tracker, probe, resolve_tracking_uri)
from qerl.config import load_settings  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A fresh SQLite tracking store (creating its tables takes a few seconds: once per module)."""
    root = tmp_path_factory.mktemp("mlflow")
    return f"sqlite:///{root}/mlflow.db"


def test_tracking_uri_precedence(monkeypatch):
    settings = load_settings(ROOT / "params/tiny.yaml")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(settings) == DEFAULT_TRACKING_URI == "sqlite:///mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    assert resolve_tracking_uri(settings) == "http://tracking.example:5000"
    settings = load_settings(ROOT / "params/tiny.yaml", ["tracking.tracking_uri=sqlite:///other.db"])
    assert resolve_tracking_uri(settings) == "sqlite:///other.db"
    assert isinstance(open_tracker(load_settings(ROOT / "params/default.yaml")), LocalOnly)  # backend: none


def test_tracker_logs_params_metrics_artifacts_table_and_registers(store, tmp_path):
    from mlflow import MlflowClient

    settings = load_settings(ROOT / "params/tiny.yaml")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    png = tmp_path / "reward_curve.png"
    png.write_bytes(b"\x89PNG")

    with MlflowTracker(store, "qerl-test", run_name="nvfp4-aqn", tags={"quant.scheme": "nvfp4"}) as tracker:
        tracker.log_params(settings.to_flat_dict())
        for step in (1, 2):
            tracker.log_metrics({"reward_mean": 0.1 * step, "pass@4": 0.5, "bad": float("nan"), "note": "x"}, step)
        tracker.log_artifact(adapter, "adapter")
        tracker.log_artifact(png, "plots")
        tracker.log_table([{"id": "a", "score": 1.0}, {"id": "b", "score": 0.0, "extra": "y"}], "eval/samples.json")
        version = tracker.register_adapter("qerl-test-adapter", tags={"eval.accuracy": 0.5})

    client = MlflowClient(store)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    # the experiment kind the UI's selector sets ("Machine learning"); the landing view is the link's: see below
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    assert run.data.params["lora.rank"] == "8" and json.loads(run.data.params["lora.target_modules"])
    assert len(run.data.params) == len(settings.to_flat_dict())
    assert [m.value for m in client.get_metric_history(tracker.run_id, "reward_mean")] == pytest.approx([0.1, 0.2])
    assert "pass_at_4" in run.data.metrics and "bad" not in run.data.metrics and "note" not in run.data.metrics
    listed = {f.path for f in client.list_artifacts(tracker.run_id, "adapter")}
    assert listed == {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"}
    assert {f.path for f in client.list_artifacts(tracker.run_id, "plots")} == {"plots/reward_curve.png"}
    table = json.loads(Path(client.download_artifacts(tracker.run_id, "eval/samples.json", str(tmp_path))).read_text())
    assert table["columns"] == ["id", "score", "extra"] and len(table["data"]) == 2

    registry = Registry(store, "qerl-test-adapter")
    assert registry.champion() is None
    registry.promote(version)
    champion = registry.champion()
    assert str(champion.version) == version and champion.run_id == tracker.run_id
    assert champion.tags["eval.accuracy"] == "0.5"
    downloaded = registry.download(champion, tmp_path / "dl")
    assert (downloaded / "adapter_config.json").is_file()


def test_a_resumed_run_with_changed_settings_keeps_its_params_and_tags_the_new_values(store, caplog):
    """`qerl train --resume` may continue with changed settings (a longer train.steps; a base re-quantized by a newer
    qerl); MLflow refuses to change a logged param, which used to fail the resumed run."""
    from mlflow import MlflowClient

    with MlflowTracker(store, "qerl-test") as tracker:
        tracker.log_params({"train.steps": 10, "quant.quantized_path": "runs/q/a", "lora.rank": 8})
    with caplog.at_level("WARNING"), MlflowTracker(store, "qerl-test", run_id=tracker.run_id) as resumed:
        resumed.log_params({"train.steps": 20, "quant.quantized_path": "runs/q/b", "lora.rank": 8, "new.key": 1})
    run = MlflowClient(store).get_run(tracker.run_id)
    assert run.data.params == {"train.steps": "10", "quant.quantized_path": "runs/q/a", "lora.rank": "8",
                               "new.key": "1"}
    assert run.data.tags["resumed.train.steps"] == "20" and run.data.tags["resumed.quant.quantized_path"] == "runs/q/b"
    assert "resumed.lora.rank" not in run.data.tags
    assert "train.steps '10' -> '20'" in caplog.text


def test_failed_body_marks_run_failed(store):
    from mlflow import MlflowClient

    with pytest.raises(RuntimeError):
        with MlflowTracker(store, "qerl-test") as tracker:
            raise RuntimeError("boom")
    assert MlflowClient(store).get_run(tracker.run_id).info.status == "FAILED"


def test_an_existing_experiment_gets_the_runs_view_unless_its_kind_was_chosen(store):
    from mlflow import MlflowClient

    client = MlflowClient(store)
    untagged = client.create_experiment("made-before-the-tag")
    chosen = client.create_experiment("kind-chosen-in-the-ui", tags={"mlflow.experimentKind": "genai_development"})
    for name in ("made-before-the-tag", "kind-chosen-in-the-ui"):
        with MlflowTracker(store, name):
            pass
    assert client.get_experiment(untagged).tags["mlflow.experimentKind"] == "custom_model_development"
    assert client.get_experiment(chosen).tags["mlflow.experimentKind"] == "genai_development"


def test_unreachable_server_is_a_fast_one_line_error():
    uri = f"http://127.0.0.1:{closed_port()}"
    start = time.perf_counter()
    with pytest.raises(TrackingUnavailable) as info:
        probe(uri)
    assert time.perf_counter() - start < 5
    message = str(info.value)
    assert "\n" not in message and uri in message and "unreachable" in message
    with pytest.raises(TrackingUnavailable, match="not writable|missing"):
        probe("sqlite:////nonexistent-dir/mlflow.db")


def test_train_cli_stops_before_training_when_the_server_is_down(tmp_path, main_here, monkeypatch):
    """`python -m qerl.flows.train` (its main, here) with a dead tracking server: exit 2 (the README's code for what
    the user can fix), one line on stderr, no run
    folder, no model."""
    from qerl.flows.train import main

    out = tmp_path / "run"
    uri = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # never reached: the probe comes first
    code, stdout, err = main_here(main, "--params", "params/tiny.yaml", "--out", out,
                                  "-S", f"tracking.tracking_uri={uri}")
    assert code == 2, err
    assert stdout == ""
    lines = err.strip().splitlines()
    assert lines == [f"python -m qerl.flows.train: error: MLflow tracking server {uri} is unreachable "
                     f"{lines[0].split('unreachable ', 1)[1]}"]
    assert not out.exists()


def test_train_flow_checks_the_server_before_loading_anything(tmp_path):
    """The flow itself (what a deployment runs) raises the same error before it creates the run folder."""
    from qerl.flows.train import train

    out = tmp_path / "run"
    with pytest.raises(TrackingUnavailable, match="unreachable"):
        train.fn(params=str(ROOT / "params/tiny.yaml"), out_dir=str(out),
                 overrides=[f"tracking.tracking_uri=http://127.0.0.1:{closed_port()}"])
    assert not out.exists()


SET_UP_AT = """
import sys, time
from qerl.flows.tracking import mlflow_client
start = float(sys.argv[2])
while time.time() < start:
    time.sleep(0.001)
mlflow_client(sys.argv[1]).get_experiment_by_name("qerl")
"""


def test_two_processes_setting_up_a_fresh_sqlite_store_at_once_both_succeed(tmp_path):
    """Without the set-up lock one of them died in MLflow's table creation ('duplicate column name') every time."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    start = time.time() + 8  # both past their imports, then at the same moment
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", SET_UP_AT, uri, str(start)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]


def _ui_bundle() -> str:
    """The installed MLflow UI's main script (its routes and URL parameters)."""
    import mlflow

    scripts = list((Path(mlflow.__file__).parent / "server/js/build/static/js").glob("main.*.js"))
    assert len(scripts) == 1, scripts
    return scripts[0].read_text(errors="replace")


def test_the_experiment_link_names_a_route_and_view_of_the_installed_ui():
    """MLflow 3.17's UI opens an experiment in the view its URL's `workflowType` names, else the browser's stored
    choice (GenAI when fresh), whatever the experiment's kind tag: the link must name the runs route and the machine
    learning view, as the installed UI spells them (an MLflow upgrade that renames them fails here)."""
    from qerl.flows.tracking import experiment_url, run_url

    bundle = _ui_bundle()
    assert '"/experiments/:experimentId/runs"' in bundle and '"/experiments/:experimentId/runs/:runUuid"' in bundle
    assert 'get("workflowType")' in bundle and 'MACHINE_LEARNING="machine_learning"' in bundle
    assert experiment_url("http://127.0.0.1:5000/", "7") == (
        "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning")
    assert run_url("http://h:5000", "7", "abc") == (
        "http://h:5000/#/experiments/7/runs/abc?workflowType=machine_learning")


@pytest.fixture(scope="module")
def served_store(tmp_path_factory):
    """A real `mlflow server` on loopback (SQLite behind it), stopped when the module ends: its address."""
    import urllib.request

    from tests.prefect_server import free_port

    tmp = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(["mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                               "--backend-store-uri", f"sqlite:///{tmp}/mlflow.db",
                               "--default-artifact-root", str(tmp / "artifacts")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2):
                    break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "mlflow server did not come up"
                time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, 15)
        server.wait(30)


@pytest.fixture(scope="module")
def served_run(served_store):
    """One finished run on the server, and what the tracker printed when it ended."""
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), MlflowTracker(served_store, "qerl-links",
                                                            run_name="nvfp4-aqn tiny abc123") as tracker:
        pass
    return tracker, printed.getvalue()


@pytest.mark.slow
def test_a_run_on_a_tracking_server_prints_links_to_the_runs_table(served_store, served_run):
    """MLflow printed `#/experiments/<id>` (the GenAI overview in a fresh browser) when a run on a server ended; the
    tracker prints the runs table instead, once. ~20 s: a real `mlflow server` on loopback (shared by the module)."""
    tracker, printed = served_run
    base = f"{served_store}/#/experiments/{tracker.experiment_id}/runs"
    assert printed.splitlines() == [
        f"🏃 View run nvfp4-aqn tiny abc123 at: {base}/{tracker.run_id}?workflowType=machine_learning",
        f"🧪 View experiment at: {base}?workflowType=machine_learning"]


@pytest.mark.slow
def test_the_experiment_link_opens_the_runs_table_in_a_headless_browser(served_store, served_run, tmp_path):
    """What a user sees: the printed link in a fresh headless Chromium shows the runs table with the run; MLflow's
    own form of the link shows the GenAI overview (why the flows print theirs). Skipped without Chromium (Debian:
    apt-get install chromium). ~30 s: two page loads."""
    import shutil

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no Chromium to load the page in (apt-get install chromium)")
    tracker, printed = served_run
    link = printed.splitlines()[1].split(": ", 1)[1]

    def rendered(url: str, profile: str) -> str:  # a fresh profile: no view chosen earlier in this browser
        return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000",
                               f"--user-data-dir={tmp_path / profile}", "--dump-dom", url], capture_output=True,
                              text=True, timeout=patience(120)).stdout

    ours = rendered(link, "ours")
    assert ">Runs<" in ours and "nvfp4-aqn tiny abc123" in ours and ">Overview<" not in ours
    mlflows = rendered(f"{served_store}/#/experiments/{tracker.experiment_id}", "mlflows")
    assert ">Overview<" in mlflows and "nvfp4-aqn tiny abc123" not in mlflows


def test_retrain_without_a_champion_is_one_line_before_prefect_starts(store, tmp_path, main_here, monkeypatch):
    """It used to start Prefect's temporary server and run the flow, whose failure Prefect logs with a traceback,
    before the same line."""
    from qerl.flows.retrain import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    out = tmp_path / "run"
    code, stdout, err = main_here(main, "--params", "params/tiny.yaml", "--out", out)
    assert (code, stdout) == (2, "")
    lines = [line for line in err.splitlines() if "INFO mlflow" not in line]  # a fresh store's set-up
    # the module's store holds what its other tests registered (whichever ran first): the line names those
    others = ", ".join(map(repr, Registry(store, "qerl-smoke").other_models()))
    assert lines == [f"python -m qerl.flows.retrain: error: {no_champion('qerl-smoke', 'params/tiny.yaml', others)}"]
    assert not out.exists()


def no_champion(model: str, params: str, others: str = "") -> str:
    return (f"registered model {model!r} has no 'champion' version yet: run the train flow on these params first "
            f"(python -m qerl.flows.train --params {params} -S tracking.backend=mlflow, or the train-embedded "
            "deployment); its first registered adapter becomes the champion"
            + (f". Not {others}: each params file registers under its own tracking.registered_model, and smoke runs "
               "(params/tiny.yaml) register as 'qerl-smoke'" if others else ""))


def test_the_retrain_flow_after_only_a_smoke_run_fails_cleanly_naming_the_smoke_registry(tmp_path, capsys,
                                                                                        monkeypatch):
    """The README's smoke run registers as qerl-smoke; the nightly (default.yaml: qerl-adapter) then found no
    champion, and the flow raised: two Prefect tracebacks in the worker's log for an expected refusal, and a line
    that told a user who had just trained to train first. Now the flow ends Failed with the line as its message
    (no traceback), naming the command and the smoke registry. ~20 s: Prefect's temporary server."""
    from mlflow import MlflowClient
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from qerl.flows.retrain import retrain

    store = f"sqlite:///{tmp_path}/mlflow.db"
    MlflowClient(store).create_registered_model("qerl-smoke")  # what the smoke run leaves (its versions aside)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(updates={PREFECT_HOME: str(tmp_path / "prefect-home"), PREFECT_API_URL: None}):
        state = retrain(params=str(ROOT / "params/default.yaml"), data_dir=str(tmp_path / "incoming"),
                        out_dir=str(tmp_path / "run"), return_state=True)
    assert state.is_failed()
    assert state.message == no_champion("qerl-adapter", str(ROOT / "params/default.yaml"), "'qerl-smoke'")
    assert "Traceback" not in capsys.readouterr().err


def test_evaluate_of_an_alias_that_is_not_there_is_one_line_before_prefect_starts(store, main_here, monkeypatch):
    """It was MLflow's "Registered Model with name=... not found" after Prefect's traceback, called unexpected."""
    from qerl.flows.evaluate import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    code, stdout, err = main_here(main, "--params", "params/default.yaml", "--alias", "champion")
    assert (code, stdout) == (2, "")
    assert [line for line in err.splitlines() if "INFO mlflow" not in line] == [
        "python -m qerl.flows.evaluate: error: registered model 'qerl-adapter' has no 'champion' version: train one first "
        "(python -m qerl.flows.train ... -S tracking.backend=mlflow; its first becomes the champion), or pass --adapter DIR"]


@pytest.mark.parametrize("module", ["qerl.flows.train", "qerl.flows.evaluate"])
def test_a_flow_whose_backend_package_is_missing_is_one_line_before_any_server_starts(main_here, monkeypatch, tmp_path,
                                                                                       module):
    """As `qerl train` / `qerl eval`: rollout.backend: vllm without vLLM is a missing extra, known from the params."""
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # as where vLLM is not installed (whether or not it is here)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9")  # nothing listens: a server probe would fail first
    main = importlib.import_module(module).main
    code, stdout, err = main_here(main, "--params", "params/tiny.yaml", "-S", "rollout.backend=vllm",
                                  "--out", str(tmp_path / "run"))
    assert (code, stdout) == (2, "")
    assert err.splitlines() == [f"python -m {module}: error: rollout.backend 'vllm' needs vllm, which is not "
                                'installed: pip install "qerl[vllm]" (vllm 0.26, for torch 2.11)']
    assert not (tmp_path / "run").exists()
