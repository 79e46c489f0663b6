"""The tracker interface the core logs through. The core ships only local implementations; the MLflow one lives in
the pipeline shell (flows/), so the core runs where MLflow is not installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class Tracker(Protocol):
    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...


def log_step(tracker: Tracker, metrics: dict[str, Any]) -> None:
    """One metrics.jsonl record as a tracker takes it: its `step` is the x axis, not a metric."""
    tracker.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=int(metrics["step"]))


class NullTracker:
    """Logs nothing (the run folder still keeps metrics.jsonl: `qerl.run.metrics`)."""

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass
