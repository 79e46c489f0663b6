"""Worker processes for experiments of many runs: where each worker runs (a GPU slot or a share of the CPU cores),
which run it takes next (a claim lock per run folder), and a supervisor that replaces a worker that crashed.

Prefect-free on purpose: `qerl.flows.compare --jobs` uses it under Prefect, and the bare GPU driver
(`benchmarks/aqn_seeds.py`) uses it where only the qerl core is installed.

- **Slots.** `slot_environments(jobs, per_gpu=...)`: worker i sees GPU i mod G (several workers per GPU when
  `per_gpu` > 1, or `"auto"`: as many as the GPU's free memory holds at `worker_gib` each), and every worker gets an
  equal share of the CPU cores as torch threads (16 workers on a 16-core machine must not start 16 threads each).
- **Claims.** `claimed_runs(folders, done)`: the unfinished folders, in order, each one held (an OS file lock,
  released however the worker ends, `kill -9` included) while the caller trains it. A folder taken `max_attempts`
  times without finishing (its worker crashed each time) is skipped: a run that kills its worker must not take
  every replacement with it.
- **Supervisor.** `supervise(command, envs, restarts=...)`: one process per environment; a worker that exits with
  an error is started again in its slot (up to `restarts` times per slot), and takes the next run nobody holds,
  which is the crashed one if nothing else took it (the run then resumes from its last checkpoint). A deadline
  stops every worker (SIGTERM, then SIGKILL after `grace_s`).
"""

from __future__ import annotations

from qerl.flows import startup  # noqa: F401 (first of all: the process's settings, before Prefect, MLflow, torch)

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qerl.config import ConfigError
from qerl.debug import variable
from qerl.run.lock import FolderLock, FolderLocked

CLAIM = ".compare-claim.lock"  # held by the worker training a run (the trainer's own lock is .qerl.lock)
ATTEMPTS = ".attempts"  # how many times a worker took this run (a finished run stops counting)


# ---------------------------------------------------------------------------------------------- slots


def visible_gpus() -> list[str]:
    """The GPU ids this process may hand to workers: CUDA_VISIBLE_DEVICES's entries if set, else 0..n-1."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = variable("CUDA_VISIBLE_DEVICES")
    if listed is not None and listed.strip():
        return [d.strip() for d in listed.split(",") if d.strip()][:count]
    return [str(i) for i in range(count)]


def free_gpu_memory_gib(gpus: Sequence[str]) -> list[float]:
    """Free memory of each GPU, from nvidia-smi (this process creates no CUDA context), else torch."""
    smi = shutil.which("nvidia-smi")
    if smi and all(g.isdigit() for g in gpus):
        try:
            out = subprocess.run([smi, "--query-gpu=index,memory.free", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout
            free = {int(i): float(mib) / 1024 for i, mib in (line.split(",") for line in out.strip().splitlines())}
            return [free[int(g)] for g in gpus]
        except (OSError, subprocess.SubprocessError, ValueError, KeyError):
            pass
    import torch

    return [torch.cuda.mem_get_info(i)[0] / 2**30 for i in range(len(gpus))]


def workers_per_gpu(per_gpu: int | str, free_gib: Sequence[float], worker_gib: float) -> int:
    """Workers one GPU takes: `per_gpu`, or for "auto" as many as the least free GPU holds (90% of its free memory
    at `worker_gib` each, at least one)."""
    if per_gpu == "auto":
        if worker_gib <= 0:
            raise ConfigError(f"--worker-gib {worker_gib}: must be > 0")
        return max(1, int(0.9 * min(free_gib) // worker_gib))
    if not isinstance(per_gpu, int) or per_gpu < 1:
        raise ConfigError(f"--per-gpu {per_gpu}: must be an int >= 1 or 'auto'")
    return per_gpu


def slot_environments(jobs: int, per_gpu: int | str = 1, worker_gib: float = 4.0, *, gpus: Sequence[str] | None = None,
                      free_gib: Sequence[float] | None = None, cores: int | None = None,
                      base: dict[str, str] | None = None) -> list[dict[str, str]]:
    """The environment of each of `jobs` workers. With GPUs: worker i on GPU i mod G, at most `per_gpu` per GPU
    (an int, or "auto" from the free memory at `worker_gib` per worker); more workers than that is an error naming
    the numbers. Every worker gets cores / jobs torch threads (at least one)."""
    if jobs < 1:
        raise ConfigError(f"--jobs {jobs}: must be >= 1")
    gpus = visible_gpus() if gpus is None else list(gpus)
    cores = cores or len(os.sched_getaffinity(0))
    threads = str(max(1, cores // jobs))
    fits = None
    if gpus:
        if per_gpu == "auto" and free_gib is None:
            free_gib = free_gpu_memory_gib(gpus)
        fits = workers_per_gpu(per_gpu, free_gib or [0.0], worker_gib)
        if jobs > fits * len(gpus):
            why = (f"{min(free_gib or [0]):.1f} GiB free on the fullest GPU holds {fits} worker(s) of "
                   f"{worker_gib:g} GiB" if per_gpu == "auto" else f"--per-gpu {per_gpu}")
            raise ConfigError(f"--jobs {jobs}: {len(gpus)} GPU(s) x {fits} worker(s) each at most ({why})")
    envs = []
    for i in range(jobs):
        env = dict(os.environ if base is None else base)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        envs.append(env)
    return envs


# ---------------------------------------------------------------------------------------------- claims


def attempts(folder: Path) -> int:
    try:
        return int((folder / ATTEMPTS).read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def claimed_runs(folders: Iterable[Path], done: Callable[[Path], bool], max_attempts: int | None = None,
                 describe: Callable[[Path], str] = str, stop: Callable[[], bool] | None = None) -> Iterator[Path]:
    """Each unfinished folder of `folders` that no other worker holds, in order, held while the caller works on it
    (the claim is released when the caller asks for the next one, or closes the generator). Every claim counts as an
    attempt; with `max_attempts`, a folder taken that often without finishing is skipped. `stop()`, asked before
    each claim, ends the iteration (e.g. too little time left for another run)."""
    for folder in folders:
        if stop is not None and stop():
            return
        if done(folder):
            continue
        claim = FolderLock(folder / CLAIM, what=describe(folder))
        try:
            claim.acquire()
        except FolderLocked:  # another worker is on it
            continue
        try:
            if done(folder):  # finished between our check and our claim
                continue
            tried = attempts(folder)
            if max_attempts is not None and tried >= max_attempts:
                continue
            (folder / ATTEMPTS).write_text(f"{tried + 1}\n")
            yield folder
        finally:
            claim.release()


# ---------------------------------------------------------------------------------------------- supervisor


@dataclass
class Slot:
    """One worker slot: its environment, the exit codes of the processes it ran so far."""
    env: dict[str, str]
    codes: list[int] = field(default_factory=list)
    process: subprocess.Popen | None = None


def _stop(slots: list[Slot], grace_s: float) -> None:
    live = [s for s in slots if s.process is not None and s.process.poll() is None]
    for s in live:
        s.process.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace_s
    for s in live:
        try:
            s.process.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            s.process.kill()
            s.process.wait()
    for s in live:
        s.codes.append(s.process.returncode)
        s.process = None


def supervise(command: Sequence[str], envs: Sequence[dict[str, str]], restarts: int = 2,
              deadline: float | None = None, grace_s: float = 10.0, poll_s: float = 0.2,
              log: Callable[[str], None] = print, cwd: str | None = None,
              progress: Callable[[], str] | None = None, progress_every_s: float = 60.0) -> list[Slot]:
    """Run `command` once per environment and wait for all. A worker that exits with an error is replaced (the same
    command, same slot) up to `restarts` times per slot. At `deadline` (time.time()), the workers still running are
    stopped. `progress()`, if given, is logged every `progress_every_s`. Returns the slots with every exit code; the
    caller decides what a failure means (the runs say what is finished)."""
    slots = [Slot(dict(env)) for env in envs]
    next_progress = time.monotonic() + progress_every_s

    def start(i: int, slot: Slot) -> None:
        slot.process = subprocess.Popen(list(command), env=slot.env, cwd=cwd)

    for i, slot in enumerate(slots):
        start(i, slot)
    while any(s.process is not None for s in slots):
        if deadline is not None and time.time() >= deadline:
            log(f"deadline reached: stopping {sum(s.process is not None for s in slots)} worker(s)")
            _stop(slots, grace_s)
            break
        for i, slot in enumerate(slots):
            if slot.process is None or (code := slot.process.poll()) is None:
                continue
            slot.codes.append(code)
            slot.process = None
            if code != 0 and len(slot.codes) <= restarts:
                log(f"worker {i} exited with code {code}: starting a replacement "
                    f"({len(slot.codes)} of {restarts} restart(s) of this slot)")
                start(i, slot)
            elif code != 0:
                log(f"worker {i} exited with code {code}: no restarts left in this slot")
        if progress is not None and time.monotonic() >= next_progress:
            log(progress())
            next_progress = time.monotonic() + progress_every_s
        time.sleep(poll_s)
    return slots


def write_json(path: Path, value: dict) -> None:
    """Atomically (a temp file, then a rename): a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
