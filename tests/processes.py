"""Processes a test session started, found and stopped when it ends, whatever became of the tests.

Every process the suite starts inherits a mark in its environment (`QERL_TEST_SESSION`, set once per session), so
the processes are found even when their parent is gone: a Prefect server whose starter timed out, a worker whose
`subprocess.run` was killed on its timeout. Their process groups are stopped (never the session's own group), first
with SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import os
import signal
import uuid

MARK = "QERL_TEST_SESSION"


def mark_session() -> str:
    """Marks this process (and so everything it starts from now on) as the session's; returns the mark."""
    os.environ[MARK] = f"{os.getpid()}-{uuid.uuid4().hex}"
    return os.environ[MARK]


def started_by(mark: str) -> list:
    """The live processes carrying `mark`, other than this one (empty where psutil cannot read environments)."""
    try:
        import psutil  # comes with peft and dvc; without it there is nothing to sweep with
    except ImportError:
        return []
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if (proc.environ().get(MARK) == mark and proc.status() != psutil.STATUS_ZOMBIE
                    and not _exits_with_us(proc)):
                found.append(proc)
        except (psutil.Error, OSError):  # gone meanwhile, or not ours to read
            continue
    return found


def _exits_with_us(proc) -> bool:
    """multiprocessing's resource tracker (started by torch.multiprocessing's spawn) lives as long as this process
    and then exits by itself: not something a test left running. Nor are the grader's math-verify workers of this
    process (qerl.grading: one per grader, kept for the process's life; its atexit hook kills them, and they exit when
    their stdin, a pipe from this process, closes). A worker whose parent is gone is still reported."""
    command = " ".join(proc.cmdline())
    if "multiprocessing.resource_tracker" in command:
        return True
    return "qerl.grading.mathverify_worker" in command and proc.ppid() == os.getpid()


def _signal(procs: list, sig: int) -> None:
    own_group = os.getpgrp()
    for proc in procs:
        try:
            group = os.getpgid(proc.pid)
            if group != own_group:
                os.killpg(group, sig)  # the process and whatever it started in its group
            else:
                os.kill(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            continue


def stop_started_by(mark: str, grace_s: float = 10.0) -> list[str]:
    """Stops every process carrying `mark` with its group; returns what was found, as 'PID command' lines."""
    procs = started_by(mark)
    if not procs:
        return []
    import psutil

    described = []
    for proc in procs:
        try:
            described.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
        except psutil.Error:
            described.append(str(proc.pid))
    _signal(procs, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    _signal(alive, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=grace_s)
    return described


def kill_9(proc, timeout: float) -> list[str]:
    """`kill -9` one process (not its group) and wait for it; then give what it had started (the grader's worker)
    `timeout` seconds to exit by itself, as it must once its parent is gone. Returns those still alive afterwards, as
    'PID command' lines (an empty list: nothing outlived the killed process)."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        children = []
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout)
    _, alive = psutil.wait_procs(children, timeout=timeout)
    described = []
    for child in alive:
        try:
            described.append(f"{child.pid} {' '.join(child.cmdline())[:160]}")
        except psutil.Error:
            continue
    return described
