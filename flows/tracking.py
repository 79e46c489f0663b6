"""MLflow behind the core's `Tracker` protocol, plus the model-registry moves the flows make (register, champion alias).

Everything goes through an explicit `MlflowClient` and run id rather than MLflow's fluent API: the fluent "active run"
is thread-local, and Prefect may run a task on another thread than its flow.
"""

from __future__ import annotations

from qerl.flows import startup  # first of all: the process's settings, before Prefect, MLflow, torch

import fcntl
import json
import logging
import math
import os
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from qerl.config import Settings
from qerl.debug import variable
from qerl.rl.tracking import NullTracker

log = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
# In a training flow's run folder: the MLflow run it logs to (and the store), written when the run opens, so that a
# resumed flow (`--resume`, after a kill or a stop) continues that run instead of opening a second one.
RUN_RECORD = "mlflow_run.json"
CHAMPION = "champion"  # the registry alias the retrain flow continues from and promotes to
_MAX_PARAM_CHARS = 6000  # MLflow's limit on a parameter value
_BAD_KEY_CHARS = re.compile(r"[^0-9A-Za-z_\-. /:]")  # MLflow rejects e.g. "@" in metric names ("pass@4")
# The experiment's kind as MLflow 3's UI kind selector sets it ("Machine learning"): read by MLflow's older UIs and
# its search filters. The UI of MLflow 3.17 no longer opens an experiment by this tag, though: see RUNS_VIEW.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
# MLflow 3.17's UI takes an experiment page's view from its URL's `workflowType` parameter, else from the browser's
# stored choice (the sidebar's GenAI / Model training switch), GenAI in a fresh browser: MLflow's own "View
# experiment" link (#/experiments/<id>) opened ours on the empty GenAI overview. These links name the runs table and
# the machine-learning view (routes `/experiments/:experimentId/runs` and `?workflowType=machine_learning` in the
# UI's bundle; tests/test_pipeline_tracking.py checks the installed bundle still has them).
RUNS_VIEW = "workflowType=machine_learning"


def experiment_url(host: str, experiment_id: str) -> str:
    """The experiment's runs table in the MLflow UI at `host` (a tracking server's address)."""
    return f"{host.rstrip('/')}/#/experiments/{experiment_id}/runs?{RUNS_VIEW}"


def run_url(host: str, experiment_id: str, run_id: str) -> str:
    return f"{host.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{RUNS_VIEW}"


class TrackingUnavailable(RuntimeError):
    """The tracking store cannot be reached: a one-line message naming the URI and what to do."""


def resolve_tracking_uri(settings: Settings) -> str:
    """`tracking.tracking_uri`, else $MLFLOW_TRACKING_URI, else a SQLite file in the working directory."""
    return settings.tracking.tracking_uri or variable("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def probe(uri: str, timeout: float = 3.0) -> None:
    """Fail fast, before any model is loaded: the MLflow client itself retries an unreachable server for minutes."""
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        health = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(health, timeout=timeout) as response:
                if response.status != 200:
                    raise OSError(f"HTTP {response.status}")
        except (OSError, urllib.error.URLError, socket.timeout) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise TrackingUnavailable(
                f"MLflow tracking server {uri} is unreachable ({reason}); start it (mlflow server) or point "
                f"tracking.tracking_uri / MLFLOW_TRACKING_URI elsewhere") from None
    elif parsed.scheme == "sqlite":
        db = Path(uri.removeprefix("sqlite:///"))
        if not db.parent.is_dir() or not os.access(db.parent, os.W_OK):
            raise TrackingUnavailable(f"MLflow tracking store {uri}: folder {db.parent.resolve()} is missing or "
                                      f"not writable")


def mlflow_client(uri: str):
    """An `MlflowClient` on `uri` whose store is set up. MLflow creates a SQLite store's tables on first use, and two
    processes doing that at once fail (`sqlite3.OperationalError: duplicate column name`): e.g. two flows started in a
    fresh directory. The first use is serialized by a lock on the database's folder (no file of its own to leave)."""
    from mlflow import MlflowClient

    if not uri.startswith("sqlite:///"):
        return MlflowClient(uri)
    folder = os.open(Path(uri.removeprefix("sqlite:///")).parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)  # waits: the other process's set-up takes a second or two
        client = MlflowClient(uri)
        client.search_experiments(max_results=1)  # the store (its tables created or upgraded) exists from here on
    finally:
        os.close(folder)  # releases the lock
    return client


def _local_artifact_root(uri: str) -> str | None:
    """Artifacts of a SQLite store live next to the database (MLflow would use ./mlruns of whichever folder the first
    run started in); servers keep their own default."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()


def _clean_key(key: str) -> str:
    return _BAD_KEY_CHARS.sub("_", key.replace("@", "_at_"))


def _finite_floats(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue  # NaN/inf break MLflow's charts; non-numbers are not metrics
        out[_clean_key(key)] = float(value)
    return out


class MlflowTracker:
    """One MLflow run: implements `qerl.rl.tracking.Tracker` and adds tables, tags and adapter registration.

    Use as a context manager so the run ends FINISHED, or FAILED when the body raises.
    """

    def __init__(self, tracking_uri: str, experiment: str, run_name: str | None = None,
                 tags: dict[str, str] | None = None, parent_run_id: str | None = None, run_id: str | None = None):
        """A new run of `experiment`, nested under `parent_run_id` if given; or, with `run_id`, that existing run
        reopened (a resumed training run continues the same MLflow run)."""
        probe(tracking_uri)
        self.tracking_uri = tracking_uri
        self.client = mlflow_client(tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        if found is None:
            self.experiment_id = self.client.create_experiment(
                experiment, artifact_location=_local_artifact_root(tracking_uri),
                tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        else:
            self.experiment_id = found.experiment_id
            if EXPERIMENT_KIND_TAG not in found.tags:  # made before this tag (or by MLflow itself): a kind the user
                self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)  # chose stays
        tags = dict(tags or {})
        if parent_run_id is not None:
            tags["mlflow.parentRunId"] = parent_run_id  # what the MLflow UI nests runs by
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            run = self.client.get_run(run_id)
            for key, value in tags.items():
                self.client.set_tag(run_id, key, value)
        else:
            run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        self.run_id = run.info.run_id
        self.artifact_uri = run.info.artifact_uri
        self.run_name = run.info.run_name

    @classmethod
    def from_settings(cls, settings: Settings, run_name: str | None = None, tags: dict[str, str] | None = None,
                      parent_run_id: str | None = None, run_id: str | None = None) -> "MlflowTracker":
        t = settings.tracking
        return cls(resolve_tracking_uri(settings), t.experiment, run_name or t.run_name, tags, parent_run_id, run_id)

    # -- the core's Tracker protocol

    def log_params(self, params: dict[str, Any]) -> None:
        """Log `params`. MLflow never changes a logged param; a resumed run may continue with changed settings (a
        longer `train.steps`, a re-quantized base: `qerl.run.folder.check_resumed_settings`), so a value that
        differs from the one logged when the run started goes to the tag `resumed.<key>` instead, said once."""
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        values = {k: str(v)[:_MAX_PARAM_CHARS] for k, v in params.items()}
        changed = {k: v for k, v in values.items() if k in logged and logged[k] != v}
        items = [Param(k, v) for k, v in values.items() if k not in logged]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])
        for key, value in changed.items():
            self.client.set_tag(self.run_id, f"resumed.{key}", value)
        if changed:
            log.warning("MLflow run %s keeps the params it started with; the resumed values are tagged resumed.* (%s)",
                        self.run_id, ", ".join(f"{k} {logged[k]!r} -> {v!r}" for k, v in changed.items()))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, int(step)) for k, v in _finite_floats(metrics).items()]
        if items:
            self.client.log_batch(self.run_id, metrics=items)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path or path.name)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    # -- extras the flows use

    def set_tags(self, tags: dict[str, Any]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, str(value))

    def log_table(self, records: list[dict[str, Any]], artifact_file: str) -> None:
        """Rows of dicts as an MLflow table (shown, filterable, in the run's Evaluation/Artifacts view)."""
        if not records:
            return
        columns = list(dict.fromkeys(k for r in records for k in r))
        self.client.log_table(self.run_id, {c: [r.get(c) for r in records] for c in columns}, artifact_file)

    def register_adapter(self, name: str, artifact_path: str = "adapter",
                         tags: dict[str, Any] | None = None) -> str:
        """A new version of registered model `name` from this run's adapter folder; returns the version number."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(name, description="LoRA adapters (PEFT format) trained by qerl")
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        version = self.client.create_model_version(
            name, source=f"{self.artifact_uri}/{artifact_path}", run_id=self.run_id,
            tags={k: str(v) for k, v in (tags or {}).items()})
        return str(version.version)

    def end(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status)  # MLflow's own links are off: flows/startup.py
        if urlparse(self.tracking_uri).scheme in ("http", "https") and startup.PRINT_MLFLOW_LINKS:
            print(f"🏃 View run {self.run_name} at: {run_url(self.tracking_uri, self.experiment_id, self.run_id)}")
            print(f"🧪 View experiment at: {experiment_url(self.tracking_uri, self.experiment_id)}")

    def __enter__(self) -> "MlflowTracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # KILLED: Ctrl-C, or a stop on SIGTERM (qerl.errors.Stopped, a KeyboardInterrupt), the run resumable
        status = "FINISHED" if exc_type is None else ("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")
        self.end(status)


class LocalOnly(NullTracker):
    """`tracking.backend: none`: the flows' extra calls become no-ops (the run folder still has everything)."""

    run_id = None

    def set_tags(self, tags: dict[str, Any]) -> None:
        pass

    def log_table(self, records: list[dict[str, Any]], artifact_file: str) -> None:
        pass

    def register_adapter(self, name: str, artifact_path: str = "adapter", tags: dict | None = None) -> None:
        return None

    def __enter__(self) -> "LocalOnly":
        return self

    def __exit__(self, *exc) -> None:
        pass


def open_tracker(settings: Settings, run_name: str | None = None, tags: dict[str, str] | None = None,
                 folder: str | Path | None = None, resume: bool = False) -> MlflowTracker | LocalOnly:
    """The tracker `tracking.backend` names; an MLflow store is probed here, before anything heavy starts.

    `folder`: a training run's folder, where the MLflow run is recorded (RUN_RECORD); with `resume`, the run recorded
    there is reopened, so the resumed steps' metrics land in the run that holds the first ones."""
    if settings.tracking.backend != "mlflow":
        return LocalOnly()
    uri = resolve_tracking_uri(settings)
    earlier = recorded_run(Path(folder), uri) if folder is not None and resume else None
    tracker = MlflowTracker.from_settings(settings, run_name, tags, run_id=earlier)
    if folder is not None:
        record_run(Path(folder), tracker)
    if earlier:
        log.info("resuming MLflow run %s (recorded in %s)", earlier, Path(folder) / RUN_RECORD)
    return tracker


def recorded_run(folder: Path, uri: str) -> str | None:
    """The id of the MLflow run `folder` records for the store `uri`, if that run is still there; else None, said in
    a warning where a record was found (a resumed run then opens a new MLflow run, as before)."""
    path = folder / RUN_RECORD
    try:
        record = json.loads(path.read_text())
        run_id, recorded_uri = record["run_id"], record["tracking_uri"]
    except FileNotFoundError:
        log.warning("no MLflow run recorded in %s (a run folder from before %s was kept): a new MLflow run", folder,
                    RUN_RECORD)
        return None
    except (ValueError, KeyError, TypeError):
        log.warning("%s is not a record of an MLflow run: a new MLflow run", path)
        return None
    if recorded_uri != uri:
        log.warning("%s records MLflow run %s in %s, not in %s: a new MLflow run", path, run_id, recorded_uri, uri)
        return None
    from mlflow.exceptions import MlflowException

    try:
        run = mlflow_client(uri).get_run(run_id)
    except MlflowException:
        run = None
    if run is None or run.info.lifecycle_stage != "active":
        log.warning("MLflow run %s recorded in %s is gone from %s: a new MLflow run", run_id, path, uri)
        return None
    return run_id


def record_run(folder: Path, tracker: MlflowTracker) -> None:
    """Write RUN_RECORD (small: written whole, replaced atomically, so a kill leaves the old record or the new)."""
    folder.mkdir(parents=True, exist_ok=True)
    temp = folder / f".{RUN_RECORD}.tmp"
    temp.write_text(json.dumps({"run_id": tracker.run_id, "tracking_uri": tracker.tracking_uri,
                                "experiment_id": tracker.experiment_id}) + "\n")
    os.replace(temp, folder / RUN_RECORD)


class Registry:
    """The champion/candidate moves on one registered model."""

    def __init__(self, tracking_uri: str, name: str):
        probe(tracking_uri)
        self.tracking_uri, self.name = tracking_uri, name
        self.client = mlflow_client(tracking_uri)

    @classmethod
    def from_settings(cls, settings: Settings) -> "Registry":
        return cls(resolve_tracking_uri(settings), settings.tracking.registered_model)

    def other_models(self) -> list[str]:
        """The names of the store's other registered models (e.g. the smoke runs' `qerl-smoke`)."""
        return sorted(m.name for m in self.client.search_registered_models() if m.name != self.name)

    def champion(self):
        """The ModelVersion behind the `champion` alias, or None (no model or no alias yet)."""
        return self.version(CHAMPION)

    def version(self, alias: str):
        """The ModelVersion behind `alias`, or None (no model or no such alias yet)."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_model_version_by_alias(self.name, alias)
        except MlflowException as exc:
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None
            raise

    def recorded_settings(self, version) -> dict[str, str]:
        """The flat settings (`lora.rank`, ...) the run behind a ModelVersion logged as its parameters; empty for a
        version without a run."""
        return dict(self.client.get_run(version.run_id).data.params) if version.run_id else {}

    def promote(self, version: str) -> None:
        self.client.set_registered_model_alias(self.name, CHAMPION, version)

    def download(self, version, dst: str | Path) -> Path:
        """The adapter folder of a ModelVersion, copied to `dst` (a local folder)."""
        import mlflow.artifacts

        Path(dst).mkdir(parents=True, exist_ok=True)
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=str(dst),
                                                        tracking_uri=self.tracking_uri))
