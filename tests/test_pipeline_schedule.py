"""The cron deployment really gets scheduled: a real Prefect server with its scheduler service on, `prefect deploy`
of `retrain-nightly` from prefect.yaml, and the scheduler's own flow runs read back through the API.

This catches what a deploy-only test cannot: a server that accepts the deployment but whose scheduler fails on every
loop (Prefect 3.8.8 with SQLAlchemy 2.1: "Can't evaluate bulk DML statement"), leaving the nightly retrain never run.
No worker and no flow run: nothing here loads a model.
"""

from __future__ import annotations

import re
import time
from datetime import timezone

import pytest

from tests.prefect_server import prefect_cli, start_server, tail

pytest.importorskip("prefect")

pytestmark = pytest.mark.slow  # starts a Prefect server (~30 s on 2 cores)

DEPLOYMENT = "qerl-retrain/retrain-nightly"
# A server-log line that means something went wrong (Prefect logs service failures at ERROR with a traceback).
FAILURE = re.compile(r"Traceback|\bERROR\b|Exception|InvalidRequestError")


def _scheduled_runs(api_url: str, deployment_name: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterName, FlowRunFilter,
                                                FlowRunFilterState, FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        return client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment_name])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                any_=[StateType.SCHEDULED]))))


def test_retrain_nightly_gets_scheduled_runs(tmp_path, request):
    api_url, env = start_server(tmp_path, request, PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2")
    for args in (("work-pool", "create", "qerl-process", "--type", "process"),
                 ("deploy", "--name", "retrain-nightly")):
        done = prefect_cli(env, *args)
        assert done.returncode == 0, done.stdout + done.stderr
    assert DEPLOYMENT in done.stdout

    deadline, runs = time.monotonic() + 90, []
    while not runs and time.monotonic() < deadline:
        time.sleep(2)
        runs = _scheduled_runs(api_url, "retrain-nightly")
    log = tail(tmp_path / "server.log", 200)
    assert runs, f"the scheduler created no run of {DEPLOYMENT} in 90 s; server log:\n{log}"
    assert {r.state.name for r in runs} == {"Scheduled"} and all(r.auto_scheduled for r in runs)
    starts = sorted(r.expected_start_time.astimezone(timezone.utc) for r in runs)
    assert all((t.hour, t.minute) == (3, 0) for t in starts)  # prefect.yaml's cron: 0 3 * * * UTC
    assert not FAILURE.search(log), f"errors in the server log:\n{log}"
