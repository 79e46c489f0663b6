"""Run a Python module (`python -m qerl.flows.orphan_guard PARENT_PID -m uvicorn ARGS...`) that exits when the
process that started it (PARENT_PID) is gone, however it went (`kill -9` included).

Prefect's temporary server is a child process (uvicorn, ~230 MB, a loopback port) that its parent stops from an
atexit hook: a flow killed with SIGKILL, or by the OOM killer, never runs it, and the server stayed up for good.
A thread here polls the parent's pid; once the process is reparented (the parent died), it sends this process
SIGTERM, uvicorn's own graceful stop, and exits outright if that has not ended it within a few seconds.

Why not PR_SET_PDEATHSIG: Linux sends it when the *thread* that forked the child ends, not the process, and
Prefect's client may start the server from a worker thread that ends long before the flow does; it is Linux-only
too. Polling getppid() is neither.
"""

from qerl.flows import startup  # noqa: F401 (first of all: the process's settings, before Prefect, MLflow, torch)

import os
import runpy
import signal
import sys
import threading
import time

POLL_S = 0.5  # how soon after the parent's death the server goes; a getppid() per poll costs nothing
GRACE_S = 5.0  # for uvicorn to stop on SIGTERM before the guard ends the process itself


def watch(parent: int, poll_s: float = POLL_S, grace_s: float = GRACE_S) -> None:
    """Block until `parent` is no longer this process's parent, then stop this process."""
    while os.getppid() == parent:
        time.sleep(poll_s)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os._exit(1)


def main(argv: list[str]) -> None:
    if len(argv) < 3 or not argv[0].isdigit() or argv[1] != "-m":
        sys.exit("usage: python -m qerl.flows.orphan_guard PARENT_PID -m MODULE [ARGS...]")
    # The parent's pid comes from the parent: one that died before this process could read getppid() would
    # otherwise be taken for init (or a subreaper), and the guard would wait forever.
    parent, module = int(argv[0]), argv[2]
    threading.Thread(target=watch, args=(parent,), name="orphan-guard", daemon=True).start()
    sys.argv = [module, *argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
