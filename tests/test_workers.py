"""qerl.flows.workers: worker slots on GPUs and cores, run claims, and the supervisor that replaces a crashed worker.

The supervisor tests start real processes (a few lines of Python each, no model): several workers share a plan of
run folders through the claim locks, one kills itself with SIGKILL in the middle of a run, and the test checks what
every folder ends up holding.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

from qerl.flows.workers import attempts, claimed_runs, slot_environments, supervise
from qerl.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent

# A worker: takes runs in order through claimed_runs; "training" a run appends its pid to the run's log, sleeps a
# little, then writes result.json. A run named in CRASH_ONCE kills its worker (SIGKILL, mid-run) the first time;
# one named in CRASH_ALWAYS every time.
WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    from pathlib import Path
    from qerl.flows.workers import claimed_runs
    root = Path(sys.argv[1]); crash_once = set(sys.argv[2].split(",")); crash_always = set(sys.argv[3].split(","))
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    for folder in claimed_runs(folders, done=lambda d: (d / "result.json").is_file(), max_attempts=2):
        with open(folder / "log", "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(0.05)
        crashed_before = (folder / "crashed").exists()
        if folder.name in crash_always or (folder.name in crash_once and not crashed_before):
            (folder / "crashed").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        (folder / "result.json").write_text(json.dumps({"pid": os.getpid()}))
""")


def _plan(tmp_path: Path, n: int) -> Path:
    root = tmp_path / "runs"
    for i in range(n):
        (root / f"run-{i:02d}").mkdir(parents=True)
    return root


def _worker_command(root: Path, crash_once: str = "-", crash_always: str = "-") -> list[str]:
    return [sys.executable, "-c", WORKER, str(root), crash_once, crash_always]


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_three_workers_share_the_plan_and_a_killed_worker_is_replaced_and_its_run_retried(tmp_path):
    root = _plan(tmp_path, 12)
    messages = []
    slots = supervise(_worker_command(root, crash_once="run-04"), [_env()] * 3, restarts=1, log=messages.append)

    for folder in sorted(root.iterdir()):
        assert (folder / "result.json").is_file(), folder  # every run finished
    # run-04's first worker died mid-run (SIGKILL: the OS released its claim); a replacement took it again.
    log4 = (root / "run-04" / "log").read_text().split()
    assert len(log4) == 2 and log4[0] != log4[1]
    assert attempts(root / "run-04") == 2
    # No other run was trained twice: the claims kept the workers apart.
    for folder in sorted(root.iterdir()):
        if folder.name != "run-04":
            assert len((folder / "log").read_text().split()) == 1, folder
            assert attempts(folder) == 1
    codes = sorted(code for s in slots for code in s.codes)
    assert codes == [-9, 0, 0, 0]  # one SIGKILL, then three clean exits (the replacement's among them)
    assert any("starting a replacement" in m for m in messages)


def test_a_run_that_always_kills_its_worker_is_given_up_after_max_attempts_and_the_rest_finish(tmp_path):
    root = _plan(tmp_path, 6)
    slots = supervise(_worker_command(root, crash_always="run-02"), [_env()] * 2, restarts=3, log=lambda m: None)

    assert not (root / "run-02" / "result.json").exists()
    assert attempts(root / "run-02") == 2  # max_attempts=2: the third worker to see it skipped it
    assert all((root / f"run-{i:02d}" / "result.json").is_file() for i in (0, 1, 3, 4, 5))
    assert sorted(code for s in slots for code in s.codes) == [-9, -9, 0, 0]


def test_without_restarts_a_killed_workers_run_is_left_for_the_next_invocation(tmp_path):
    root = _plan(tmp_path, 3)
    slots = supervise(_worker_command(root, crash_once="run-00"), [_env()], restarts=0, log=lambda m: None)
    assert slots[0].codes == [-9]
    assert not any((f / "result.json").exists() for f in root.iterdir())
    # The next invocation resumes: run-00 is retried (second attempt), the rest are trained once.
    slots = supervise(_worker_command(root, crash_once="run-00"), [_env()], restarts=0, log=lambda m: None)
    assert slots[0].codes == [0]
    assert all((f / "result.json").is_file() for f in root.iterdir())
    assert attempts(root / "run-00") == 2


def test_the_deadline_stops_a_worker_that_does_not_end(tmp_path):
    start = time.monotonic()
    slots = supervise([sys.executable, "-c", "import time; time.sleep(60)"], [_env()], deadline=time.time() + 1.0,
                      grace_s=2.0, log=lambda m: None)
    assert time.monotonic() - start < 15
    assert slots[0].codes == [-15]  # SIGTERM ended it within the grace period


def test_claims_skip_finished_and_held_runs(tmp_path):
    from qerl.run.lock import FolderLock

    root = _plan(tmp_path, 3)
    (root / "run-00" / "result.json").write_text("{}")
    held = FolderLock(root / "run-01" / ".compare-claim.lock", what="run-01").acquire()
    try:
        got = [f.name for f in claimed_runs(sorted(root.iterdir()), done=lambda d: (d / "result.json").exists())]
    finally:
        held.release()
    assert got == ["run-02"]


@pytest.mark.parametrize("jobs, per_gpu, free, expect", [
    (4, 1, None, "4 ... 2 GPU(s) x 1"),            # one per GPU, as before: 4 jobs on 2 GPUs is refused
    (4, 2, None, ["0", "1", "0", "1"]),            # two per GPU, round robin
    (8, "auto", [20.0, 40.0], ["0", "1"] * 4),     # 0.9 * 20 GiB at 4 GiB each: 4 per GPU, the fuller GPU decides
    (9, "auto", [20.0, 40.0], "9 ... 2 GPU(s) x 4"),
])
def test_slots_spread_workers_over_gpus_as_memory_allows(jobs, per_gpu, free, expect):
    if isinstance(expect, str):
        with pytest.raises(ConfigError) as e:
            slot_environments(jobs, per_gpu, 4.0, gpus=["0", "1"], free_gib=free, cores=16, base={})
        first, _, rest = expect.partition(" ... ")
        assert str(e.value).startswith(f"--jobs {first}:") and rest in str(e.value)
        return
    envs = slot_environments(jobs, per_gpu, 4.0, gpus=["0", "1"], free_gib=free, cores=16, base={})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == expect
    assert {e["OMP_NUM_THREADS"] for e in envs} == {str(16 // jobs)}


def test_slots_keep_the_visible_device_ids_and_share_cores_on_the_cpu():
    envs = slot_environments(3, 2, gpus=["4", "7"], cores=16, base={})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4", "7", "4"]
    cpu = slot_environments(3, gpus=[], cores=2, base={"X": "1"})
    assert all("CUDA_VISIBLE_DEVICES" not in e and e["OMP_NUM_THREADS"] == "1" and e["X"] == "1" for e in cpu)
    with pytest.raises(ConfigError, match="--jobs 0"):
        slot_environments(0, gpus=[], cores=2)


def test_the_state_files_are_json(tmp_path):
    from qerl.flows.workers import read_json, write_json

    write_json(tmp_path / "a.json", {"x": 1})
    assert read_json(tmp_path / "a.json") == {"x": 1} and read_json(tmp_path / "b.json") is None
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1}


def test_stop_ends_the_claims_before_the_next_one(tmp_path):
    root = _plan(tmp_path, 4)
    got = []
    for folder in claimed_runs(sorted(root.iterdir()), done=lambda d: False, stop=lambda: len(got) >= 2):
        got.append(folder.name)
    assert got == ["run-00", "run-01"]
    assert [attempts(root / f"run-{i:02d}") for i in range(4)] == [1, 1, 0, 0]  # the unclaimed ones were not counted


def test_the_supervisor_logs_progress_while_workers_run(tmp_path):
    messages, calls = [], []

    def progress():
        calls.append(1)
        return f"tick {len(calls)}"

    supervise([sys.executable, "-c", "import time; time.sleep(1.5)"], [_env()], log=messages.append,
              progress=progress, progress_every_s=0.4)
    assert 2 <= len(calls) <= 5 and messages[:2] == ["tick 1", "tick 2"]
