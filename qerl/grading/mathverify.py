"""math-verify, asked in a worker process under a CPU-time budget: the grader's slow path, which cannot hang its caller.

math-verify (HuggingFace's reference grader, the one TRL and open-r1 use) parses LaTeX into sympy and compares with
sympy, which can take any time on a short input (`2^{2^{2^{2^{2}}}}`); its own timeouts use signal alarms, which only
work on the main thread. So math-verify runs in a child process (`python -m qerl.grading.mathverify_worker`).

A request's budget is the worker's own CPU time for that comparison (qerl.grading.mathverify_worker enforces it and
stays alive), never wall time: a verdict must not depend on the machine's load, on a worker still loading, or on the
answers graded before it (a wall-clock deadline made correct answers time out while a killed worker's replacement
imported sympy: the "timeout cascade" of issue #47). Waiting is not charged: for a worker to load (up to
STARTUP_TIMEOUT_S), for another request to finish. Only a worker that stops answering altogether (WALL_BACKSTOP_S, far
beyond any budget) or dies (the kernel's CPU limit on a C call that Python cannot interrupt, memory) is killed; its
standby, started as soon as the first worker was ready, takes over, and the next request waits for it if it is still
loading.

Everything here is thread-safe (requests are serialized); `equal()` never raises.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import importlib.util
import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 60.0  # a worker's import of math-verify and sympy and its warm-up (~2 s of CPU)
# A worker that has not answered one request after this long is stuck (blocked, or starved far beyond any load a run
# survives: a 2 s CPU budget at 1/30 of a core); it is killed. Not a deadline: scores must not depend on load.
WALL_BACKSTOP_S = 60.0
CACHE_SIZE = 4096  # the trainer grades each completion twice (reward mix, then accuracy): the second is free


def installed_version() -> str | None:
    """math-verify's version if it is installed, without importing it (None: not installed)."""
    if importlib.util.find_spec("math_verify") is None:
        return None
    try:
        return importlib.metadata.version("math-verify")
    except importlib.metadata.PackageNotFoundError:
        return None


WORKER_MODULE = "qerl.grading.mathverify_worker"  # what a worker runs (`python -m`); tests swap in a hanging one


class _Worker:
    """One child process and the bytes it has written that no request has read yet."""

    def __init__(self) -> None:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # where `qerl` is importable from, installed or not
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env, close_fds=True)
        self.buffer = b""
        self.version: str | None = None
        self.unavailable: str | None = None

    def read_line(self, deadline: float) -> dict | None:
        """The next JSON line, or None if it does not come by `deadline` (or the worker died)."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None  # the worker exited
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return None

    def wait_ready(self, deadline: float) -> bool | None:
        """True once the worker has loaded math-verify, False if it cannot, None if it is still loading."""
        if self.version is None and self.unavailable is None:
            hello = self.read_line(deadline)
            if hello is None:
                if self.proc.poll() is None:
                    return None
                self.unavailable = f"the worker exited with code {self.proc.returncode}"
            elif "ready" in hello:
                self.version = hello["ready"]
            else:
                self.unavailable = hello.get("unavailable", "unknown reply")
        return self.version is not None

    def ask(self, gold: str, pred: str, cpu_budget_s: float) -> dict | None:
        """The worker's reply ({"equal": bool} or {"over_budget": true}), or None if it died or went past the
        wall-clock backstop (then it must be killed)."""
        try:
            self.proc.stdin.write(json.dumps({"gold": gold, "pred": pred, "cpu_s": cpu_budget_s}).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            return None
        return self.read_line(time.monotonic() + WALL_BACKSTOP_S)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class MathVerify:
    """The worker in use and a standby; `equal()` asks the first; if it dies or gets stuck, it is killed and the
    standby promoted. Counts the requests over their CPU budget (`timeouts`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: _Worker | None = None
        self._standby: _Worker | None = None
        self.unavailable: str | None = None if installed_version() else "math-verify is not installed"
        self._cache: OrderedDict[tuple[str, str], tuple[bool | None, float]] = OrderedDict()  # -> (verdict, budget)
        self.timeouts = 0
        self._ever_ready = False
        self._pid = os.getpid()
        self._closes = 0  # a replacement started before a close() must not start a standby after it
        atexit.register(self.close)

    def start(self, wait: bool = False) -> None:
        """Start the worker now (it imports in the background), so the first request does not wait; `wait`: until
        it is ready (then its standby starts) or has failed."""
        with self._lock:
            self._ensure_started()
            if wait and self._active is not None and self._active.wait_ready(
                    time.monotonic() + STARTUP_TIMEOUT_S):
                self._ever_ready = True
                self._ensure_started()  # the standby

    def _ensure_started(self) -> None:
        """An active worker, and once one has been ready, a standby (a process that never needs math-verify, e.g. a
        run on the arithmetic task, starts none: each costs an import of sympy, seconds of CPU on a busy machine)."""
        if self._pid != os.getpid():  # a forked child: the workers' pipes are its parent's, never to be shared
            self._pid, self._active, self._standby, self._ever_ready = os.getpid(), None, None, False
        if self.unavailable is None:
            if self._active is None:
                self._active, self._standby = self._standby or _Worker(), None
            if self._standby is None and self._ever_ready:
                self._standby = _Worker()

    def equal(self, gold: str, pred: str, cpu_budget_s: float) -> tuple[bool | None, bool]:
        """(verdict, over budget now): whether math-verify finds `pred` equal to `gold` (both as its `parse` takes
        them), None when it needed more than `cpu_budget_s` seconds of the worker's CPU time (or the worker died or
        got stuck), or is unavailable. A pair asked again gets the first verdict from a cache; an over-budget one too
        (counted once: "over budget now" is False), unless the new request has a larger budget."""
        key = (gold, pred)
        with self._lock:
            if key in self._cache:
                verdict, had = self._cache[key]
                if verdict is not None or cpu_budget_s <= had:
                    self._cache.move_to_end(key)
                    return verdict, False
        verdict, over_budget = self._ask(gold, pred, cpu_budget_s)
        with self._lock:
            if self.unavailable is None:
                self._cache[key] = (verdict, cpu_budget_s)
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return verdict, over_budget

    def _ask(self, gold: str, pred: str, cpu_budget_s: float) -> tuple[bool | None, bool]:
        with self._lock:
            self._ensure_started()
            if self.unavailable is not None:
                return None, False
            if self._active.proc.poll() is not None and self._active.version is not None:
                self._retire_active()  # died while idle (killed from outside): no answer's fault, the standby asks
                self._ensure_started()
            # Waiting for a worker to load is no part of any answer's budget: the process's first worker (a trainer
            # starts it before its first step), or a standby that a kill promoted before it had loaded. A wall-clock
            # deadline here made the answers after a kill time out while the replacement imported sympy.
            ready = self._active.wait_ready(time.monotonic() + STARTUP_TIMEOUT_S)
            if not ready:  # the worker could not load math-verify: grade without it
                if ready is None:
                    self._active.unavailable = f"the worker did not load within {STARTUP_TIMEOUT_S:.0f} s"
                self.unavailable = self._active.unavailable
                log.warning("math-verify unavailable (%s): grading with qerl's own equality only", self.unavailable)
                self.close_locked()
                return None, False
            if not self._ever_ready:
                self._ever_ready = True
                self._ensure_started()  # the standby
            reply = self._active.ask(gold, pred, cpu_budget_s)
            if reply is None:  # died (the kernel's CPU limit, memory) or stuck: the standby takes over
                self.timeouts += 1
                self._retire_active()
                return None, True
            if reply.get("over_budget"):  # interrupted in the worker, which stays ready for the next request
                self.timeouts += 1
                return None, True
            return bool(reply.get("equal")), False

    def _retire_active(self) -> None:
        """Promote the standby; kill the old worker and start a new standby on a thread (reaping a killed process
        takes tens of milliseconds on a loaded machine: no request waits for it)."""
        dead, self._active, self._standby = self._active, self._standby, None
        threading.Thread(target=self._replace, args=(dead, self._closes), daemon=True,
                         name="qerl-mathverify-replace").start()

    def _replace(self, dead: _Worker, closes: int) -> None:
        dead.kill()
        with self._lock:
            if self.unavailable is None and self._standby is None and self._closes == closes:
                self._standby = _Worker()

    def forget(self) -> None:
        """Drop the cached verdicts: the next request of a pair asks the worker again (a benchmark or a test grading
        the same answers twice)."""
        with self._lock:
            self._cache.clear()

    def close_locked(self) -> None:
        if self._pid != os.getpid():
            return  # a forked child's copies of its parent's workers: the parent closes them
        self._closes += 1
        for worker in (self._active, self._standby):
            if worker is not None:
                worker.kill()
        self._active = self._standby = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()

    @property
    def version(self) -> str | None:
        return None if self.unavailable else installed_version()


def pool_size() -> int:
    """Workers to keep: one per 4 cores, at most 4 (a 2-core machine keeps one; a GPU host's 16 cores keep 4)."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


class MathVerifyPool:
    """`size` MathVerify workers (each with its standby) asked in parallel by parallel callers (`qerl.grading
    .grade_all`): a step's math-verify requests are ~20 ms each, one after another on one worker. The same interface
    as MathVerify; verdicts are cached here, whichever worker gave them."""

    def __init__(self, size: int | None = None, members: list | None = None) -> None:
        self.members = members or [MathVerify() for _ in range(size or pool_size())]
        self._idle: queue.Queue[MathVerify] = queue.Queue()
        for m in self.members:
            self._idle.put(m)
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], bool] = OrderedDict()

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def unavailable(self) -> str | None:
        return self.members[0].unavailable

    @property
    def version(self) -> str | None:
        return self.members[0].version

    @property
    def timeouts(self) -> int:
        return sum(m.timeouts for m in self.members)

    def start(self, wait: bool = False) -> None:
        """Start every worker (in the background); `wait`: until the first is ready or has failed."""
        for m in self.members[1:]:
            m.start()
        self.members[0].start(wait)

    def equal(self, gold: str, pred: str, cpu_budget_s: float) -> tuple[bool | None, bool]:
        with self._lock:
            if (gold, pred) in self._cache:
                self._cache.move_to_end((gold, pred))
                return self._cache[(gold, pred)], False
        member = self._idle.get()  # the first idle worker: waiting for one is no part of the budget
        try:
            verdict, over_budget = member.equal(gold, pred, cpu_budget_s)
        finally:
            self._idle.put(member)
        if verdict is not None:
            with self._lock:
                self._cache[(gold, pred)] = verdict
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return verdict, over_budget

    def forget(self) -> None:
        with self._lock:
            self._cache.clear()
        for m in self.members:
            m.forget()

    def close(self) -> None:
        for m in self.members:
            m.close()
