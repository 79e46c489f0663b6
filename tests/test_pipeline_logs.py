"""What a user sees when running a flow directly (`python -m qerl.flows.*` without PREFECT_API_URL): Prefect's temporary
local server must stay quiet; before, its telemetry heartbeat printed a ~120-line traceback on successful runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.patience import patience
from tests.prefect_server import ROOT

pytest.importorskip("prefect")

pytestmark = pytest.mark.slow  # starts Prefect's temporary server (~20 s on 2 cores)

# A flow as the flows run one: `qerl.flows.startup` imported first (as every module of flows/ does), then Prefect.
SCRIPT = """
from qerl.flows import startup
from prefect import flow

@flow
def hello():
    return 42

assert hello() == 42
print("flow done")
"""


def test_a_flow_on_the_temporary_server_prints_no_telemetry_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "PREFECT_SERVER_ANALYTICS_ENABLED", "DO_NOT_TRACK")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=patience(300))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "flow done" in proc.stdout, out
    assert "telemetry" not in out.lower() and "Traceback" not in out, out
