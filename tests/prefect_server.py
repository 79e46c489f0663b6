"""A real Prefect server for the pipeline tests: `prefect server start` on a free loopback port with a temporary
PREFECT_HOME (SQLite), child processes killed with their whole group when the test (or module) ends."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.patience import patience

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], env: dict, log: Path, request) -> subprocess.Popen:
    """A child in its own process group, killed (group and all) when the fixture's scope ends."""
    out = log.open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def stop() -> None:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        out.close()

    request.addfinalizer(stop)
    return proc


def tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


def start_server(tmp: Path, request, **settings: str) -> tuple[str, dict]:
    """Start a server, wait until /health answers; return (API URL, environment for its clients and children).

    `settings`: extra PREFECT_* variables (e.g. PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED="false"). The server log
    is `tmp / "server.log"`.
    """
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect-home"), "PREFECT_API_URL": api_url,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_UI_ENABLED": "false", "DO_NOT_TRACK": "1",
           "PWD": str(ROOT), **settings}  # PWD: prefect.yaml's working directory
    log = tmp / "server.log"
    server = start(["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, log, request)
    deadline = time.monotonic() + 600  # generous: on 2 shared cores under load start-up took minutes
    while True:
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
                if r.status == 200:
                    return api_url, env
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"Prefect server did not come up:\n{tail(log)}")
        time.sleep(1)


def prefect_cli(env: dict, *args: str, timeout: float = patience(120)) -> subprocess.CompletedProcess:
    """`prefect --no-prompt ARGS` from the repository root (where prefect.yaml lives)."""
    return subprocess.run(["prefect", "--no-prompt", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def stop_temporary_servers() -> None:
    """Stops Prefect's temporary local servers that flows started in this process, after draining the log and event
    workers that send to them (as prefect.testing's harness does): otherwise the workers' reconnect warnings, or the
    servers' own atexit "Stopping temporary server" line, are logged after pytest has closed its streams."""
    import sys

    if "prefect" not in sys.modules:  # no flow ran in this process
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer, subprocess_server_logger

    if not SubprocessASGIServer._instances:
        return
    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=patience(30))
    level = subprocess_server_logger.level
    subprocess_server_logger.setLevel("WARNING")  # its "Stopping temporary server" (stderr) would print after the
    try:                                          # result line (stdout) when both go to one pipe
        for server in list(SubprocessASGIServer._instances.values()):
            server.stop()
    finally:
        subprocess_server_logger.setLevel(level)
