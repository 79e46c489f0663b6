"""The Prefect API behind `python -m qerl.flows.<name>` (flows/prefect_api.py): a configured server that is gone fails in
one line that says how to get back to the temporary server; two flow commands starting at once on a fresh
PREFECT_HOME both run, their temporary servers started one after the other."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.patience import patience
from tests.prefect_server import ROOT

pytest.importorskip("prefect")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stale(url: str, where: str) -> str:
    return (f"Prefect API {url} is unreachable ([Errno 111] Connection refused); start that server (prefect server "
            f"start), or run on a temporary local server: {where}")


def test_a_stopped_server_left_in_the_profile_is_one_line_naming_prefect_config_unset(tmp_path):
    """The README's server recipe (`prefect config set PREFECT_API_URL=...`), then the server stopped: the command
    used to fail with Prefect's "Failed to reach API" and an "unexpected" hint. ~15 s: two interpreters."""
    url = f"http://127.0.0.1:{closed_port()}/api"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PYTHONPATH=str(ROOT))
    subprocess.run(["prefect", "config", "set", f"PREFECT_API_URL={url}"], env=env, check=True, capture_output=True,
                   timeout=patience(60))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "qerl.flows.train", "--params", "params/tiny.yaml", "--out", str(out),
                           "-S", "tracking.backend=none"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=patience(120))
    assert proc.returncode == 2, proc.stderr  # the user can fix it: the README's exit 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"python -m qerl.flows.train: error: {stale(url, 'prefect config unset PREFECT_API_URL')}"]
    assert not out.exists()


@pytest.mark.parametrize("module", ["train", "retrain", "evaluate"])
def test_every_flow_command_checks_the_prefect_api_first(module, tmp_path, main_here, monkeypatch):
    """The same check, with the URL in the environment, in each command that runs a flow on a model."""
    import importlib

    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = f"http://127.0.0.1:{closed_port()}/api"
    monkeypatch.setenv("PREFECT_API_URL", url)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")  # never opened: probed only
    main = importlib.import_module(f"qerl.flows.{module}").main
    with temporary_settings(updates={PREFECT_API_URL: url}):  # Prefect read the environment when it was imported
        code, out, err = main_here(main, "--params", "params/tiny.yaml", "--out", tmp_path / "out")
    assert (code, out) == (2, "")
    where = "unset PREFECT_API_URL in the environment"
    assert err.splitlines() == [f"python -m qerl.flows.{module}: error: {stale(url, where)}"]


# A flow as `python -m qerl.flows.<name>` runs one, without a model: `qerl.flows.startup` first (prefect_api imports
# it), the Prefect API made sure of, the flow.
# Both processes meet at a barrier after their imports (the server's too), so that their start-ups really coincide.
FLOW_AT_ONCE = """
import sys, time
from pathlib import Path
from qerl.flows import prefect_api
from prefect import flow
import prefect.server.api.server

@flow
def hello():
    return 42

barrier = Path(sys.argv[1])
(barrier / sys.argv[2]).touch()
while len(list(barrier.iterdir())) < 2:
    time.sleep(0.01)
prefect_api.connect()
assert hello() == 42
print("flow done")
"""


@pytest.mark.slow
def test_two_flows_starting_at_once_on_a_fresh_prefect_home_both_run(tmp_path):
    """Before, both temporary servers created and migrated the one SQLite database at once: each start-up then
    outlasted Prefect's limit (both commands failed) or took twice as long. Now the second waits for the first
    server to be up, says so, and starts on a database that is set up. ~40 s on 2 busy cores: two real servers."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PYTHONPATH=str(ROOT))
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", FLOW_AT_ONCE, str(barrier), name], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for name in ("a", "b")]
    try:
        results = [proc.communicate(timeout=patience(120)) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0 and "flow done" in out, err[-3000:]
    waited = [i for i, (_, err) in enumerate(results) if "to start its temporary Prefect server on" in err]
    assert len(waited) == 1, [err[-2000:] for _, err in results]  # the second start-up waited for the first
    first = procs[1 - waited[0]]  # which one went first is the scheduler's choice
    assert f"waiting for PID {first.pid} on host {socket.gethostname()} to start" in results[waited[0]][1]


TOO_SLOW = """
from qerl.flows import prefect_api
prefect_api.MIN_STARTUP_S = 0  # a machine too busy for even a generous limit, simulated by a tiny one
try:
    prefect_api.connect()
except prefect_api.PrefectUnavailable as exc:
    print(exc)
"""


def test_a_temporary_server_too_slow_to_start_is_one_line_saying_what_to_do(tmp_path):
    """Prefect's own limit (20 s) failed a lone command on 2 busy cores with "Timed out while attempting to connect
    to ephemeral Prefect API server" and an "unexpected" hint; the flows wait 120 s and then say what to do. ~10 s."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PYTHONPATH=str(ROOT),
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="1")
    proc = subprocess.run([sys.executable, "-c", TOO_SLOW], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=patience(60))
    assert proc.stdout.splitlines() == [
        "Prefect's temporary server did not start within 1 s (a busy machine?): set "
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS higher, or start a server (prefect server start) and prefect "
        "config set PREFECT_API_URL=http://127.0.0.1:4200/api"], proc.stderr[-2000:]
    from qerl.flows.prefect_api import MIN_STARTUP_S

    assert MIN_STARTUP_S >= 120


# A flow command's process as far as the temporary server: connected, then the flow waits to be killed.
KILLED_FLOW = """
import sys, time
from pathlib import Path
from prefect import flow
from prefect.server.api.server import SubprocessASGIServer
from qerl.flows import prefect_api

@flow
def wait_to_be_killed(ready: str):
    Path(ready).write_text(str(SubprocessASGIServer().server_process.pid))
    time.sleep(3600)

prefect_api.connect()
wait_to_be_killed(sys.argv[1])
"""


def test_a_flow_killed_with_sigkill_takes_its_temporary_server_with_it(tmp_path):
    """Prefect stops its temporary server from an atexit hook, which `kill -9` never runs: the server (uvicorn,
    ~230 MB, a loopback port) stayed up for good. It now runs under qerl.flows.orphan_guard and goes within a few
    seconds of its parent. ~15 s: one server."""
    import psutil

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PYTHONPATH=str(ROOT))
    ready = tmp_path / "server-pid"
    flow_proc = subprocess.Popen([sys.executable, "-c", KILLED_FLOW, str(ready)], cwd=ROOT, env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    server = None
    try:
        deadline = time.monotonic() + patience(60)
        while not ready.is_file() or not ready.read_text():
            assert flow_proc.poll() is None, flow_proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the flow never started"
            time.sleep(0.1)
        server = psutil.Process(int(ready.read_text()))
        assert server.ppid() == flow_proc.pid and "uvicorn" in server.cmdline()
        flow_proc.kill()  # SIGKILL: no atexit hook, no signal handler runs
        flow_proc.wait()
        # POLL_S 0.5 s, then uvicorn's stop on SIGTERM: a few seconds idle, more for a loaded machine
        gone, alive = psutil.wait_procs([server], timeout=patience(4))
        assert not alive, f"the temporary server {server.pid} outlived its killed flow: {server.cmdline()}"
    finally:
        if flow_proc.poll() is None:
            os.killpg(flow_proc.pid, 9)
            flow_proc.wait()
        if server is not None and server.is_running():
            server.kill()
        flow_proc.stderr.close()
