"""The Prefect API a flow command runs against, made sure of before its flow starts (`python -m qerl.flows.<name>`).

- PREFECT_API_URL set (in the environment, or in the profile by `prefect config set`): the server must answer. A
  stopped server used to fail the command with Prefect's "Failed to reach API", though a user who had followed the
  README's server recipe and stopped the server expected the temporary server; the error now says how to get it.
- unset: Prefect starts a temporary local server for the run, on the SQLite database in PREFECT_HOME. Two flows that
  started at once on a fresh PREFECT_HOME both created and migrated that database at the same time: each server's
  start-up then outlasted Prefect's limit (20 s: "Timed out while attempting to connect to ephemeral Prefect API
  server"; also reported: a migration's `NoSuchTableError: block`), and both commands failed. The start-ups are
  serialized by a lock in PREFECT_HOME, so the second server starts on a database that is set up (its migrations and
  its block registration are then no-ops). Prefect takes the server started here for the flow (one per process).
  The server runs under `qerl.flows.orphan_guard`, so it ends with this process however this one ends: Prefect stops
  it from an atexit hook, which a `kill -9` of the flow never ran, and the server (~230 MB, a port) stayed up.
"""

from __future__ import annotations

from qerl.flows import startup  # noqa: F401 (first of all: the process's settings, before Prefect, MLflow, torch)

import os
import subprocess
import sys
import types
from pathlib import Path

from qerl.debug import variable
from qerl.run.lock import FolderLock

PROBE_TIMEOUT_S = 3.0
# Prefect gives its temporary server 20 s to start by default; a fresh one took 22 s on 2 cores at load 6, and the
# command failed with no run at all. A longer limit configured by the user is kept.
MIN_STARTUP_S = 120
START_LOCK = ".qerl-server-start.lock"  # in PREFECT_HOME, beside the database it guards


class PrefectUnavailable(RuntimeError):
    """No Prefect API to run on (PREFECT_API_URL's server does not answer, or the temporary one did not start in
    time): a one-line message saying what to do."""


def connect() -> None:
    """Check the configured Prefect server, or start the temporary one (serialized with other flow commands)."""
    from prefect.settings import PREFECT_HOME, PREFECT_SERVER_EPHEMERAL_ENABLED

    if not check() and PREFECT_SERVER_EPHEMERAL_ENABLED.value():  # else Prefect says it needs PREFECT_API_URL
        start_temporary_server(Path(PREFECT_HOME.value()))


def check() -> bool:
    """Whether PREFECT_API_URL is set; if it is, its server must answer. For commands that check more before they
    start anything (a stale URL still fails first)."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if url:
        probe(url)
    return bool(url)


def probe(url: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """GET /health through Prefect's own client (its auth and TLS settings), within `timeout`."""
    from prefect.client.orchestration import get_client

    failure = get_client(sync_client=True, httpx_settings={"timeout": timeout}).api_healthcheck()
    if failure is None:
        return
    reason = getattr(getattr(failure, "response", None), "status_code", None)
    reason = f"HTTP {reason}" if reason else (str(failure) or type(failure).__name__)
    where = ("unset PREFECT_API_URL in the environment" if variable("PREFECT_API_URL") is not None
             else "prefect config unset PREFECT_API_URL")
    raise PrefectUnavailable(f"Prefect API {url} is unreachable ({reason}); start that server (prefect server start), "
                             f"or run on a temporary local server: {where}")


def start_temporary_server(home: Path) -> None:
    """Start this process's temporary Prefect server now, one start-up at a time per PREFECT_HOME. The time spent
    waiting for another command's start-up does not count against Prefect's start-up limit."""
    from prefect.logging import get_logger
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    server = SubprocessASGIServer()  # the instance Prefect's client takes when no API URL is set
    if server.running:
        return
    guard_against_orphaning(server)
    log = get_logger()  # Prefect's, which says "Starting temporary server" (the root logger shows warnings only)
    lock = FolderLock(home / START_LOCK, what=f"Prefect home {home}",
                      on_wait=lambda holder: log.info("waiting for %s to start its temporary Prefect server on %s",
                                                      holder, home))
    limit = max(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value(), MIN_STARTUP_S)
    with lock:
        try:
            server.start(timeout=limit)
        except RuntimeError as exc:
            if "Timed out" not in str(exc):
                raise
            raise PrefectUnavailable(
                f"Prefect's temporary server did not start within {limit} s (a busy machine?): set "
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS higher, or start a server (prefect server start) and "
                "prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api") from None


def guard_against_orphaning(server) -> None:
    """Make `server` (Prefect's SubprocessASGIServer, not yet started) run its uvicorn under
    `qerl.flows.orphan_guard`, which stops it once this process is gone. Prefect builds the command in
    `_run_uvicorn_command` (also when it retries on another port); this instance's method is wrapped so that the
    Popen it calls, looked up in Prefect's server module, prefixes the guard: the command and its environment stay
    Prefect's own, and no other module's `subprocess` is touched. Once per server (a second connect() after a failed
    start finds it wrapped)."""
    import prefect.server.api.server as prefect_server

    if getattr(server, "_qerl_orphan_guard", False):
        return
    build = server._run_uvicorn_command

    def popen(args, **kwargs) -> subprocess.Popen:
        if args[:3] != [sys.executable, "-m", "uvicorn"]:  # not the command this was written for: leave it be
            return subprocess.Popen(args, **kwargs)
        return subprocess.Popen([sys.executable, "-m", "qerl.flows.orphan_guard", str(os.getpid()), *args[1:]],
                                **kwargs)

    def guarded() -> subprocess.Popen:
        prefect_server.subprocess = types.SimpleNamespace(Popen=popen)
        try:
            return build()
        finally:
            prefect_server.subprocess = subprocess

    server._run_uvicorn_command = guarded
    server._qerl_orphan_guard = True
