"""Every killed or stopped run resumes: killed (`kill -9`, a real process) before its first checkpoint or during the
final adapter export, stopped by --max-steps, continued with changed settings, with a torn last metrics line, or
stopped by a full disk (a real process filling a real filesystem). Each resumed run ends with the adapter of an
uninterrupted one.

The kills and the full disk happen in processes of their own; the runs that only start, resume or stop run in this
process (conftest's `finish_here`): they read and write nothing but the run folder, so a child would only add an
interpreter's start-up (torch, the grader's worker: most of a tiny run's time) to each."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.patience import patience
from tests.processes import kill_9
from tests.test_checkpoints import adapter, finished  # noqa: F401 - finished: the uninterrupted run, a fixture
from tests.test_determinism import threads_restored  # noqa: F401 - a fixture
from tests.test_run_folder import REPO, steps, tiny_process, wait_for


def assert_same_adapter(a: Path, b: Path) -> None:
    ta, tb = adapter(a), adapter(b)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def kill_at(marker: Path, *args) -> subprocess.Popen:
    proc = tiny_process(*args, "--marker", marker)
    wait_for(marker, proc)
    assert not kill_9(proc, patience(30)), "outlived the killed trainer"  # its grader's worker exits with it
    return proc


def test_kill_9_during_the_first_checkpoint_write_then_resume_starts_over(finished, tmp_path, finish_here):
    run = tmp_path / "run"
    proc = kill_at(tmp_path / "writing", run, "--stall-at-checkpoint", 2)
    assert steps(run) == [1, 2] and [p.name for p in (run / "checkpoints").iterdir()] == [
        f".tmp-step-000002-{proc.pid}"]

    err = finish_here(run, "--resume")
    assert (f"no checkpoint in {run} yet (the run stopped before its first): resuming from step 0; metrics.jsonl's "
            "rows are rewritten from step 1") in err
    assert steps(run) == [1, 2, 3, 4]  # the killed run's rows were rewritten, not kept twice
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert_same_adapter(finished, run)


def test_max_steps_stops_with_a_checkpoint_and_resume_finishes_the_run(finished, tmp_path, finish_here):
    run = tmp_path / "run"
    finish_here(run, "--max-steps", 3, "-S", "train.save_every=4")  # no regular save before step 4
    assert steps(run) == [1, 2, 3]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000003"]
    err = finish_here(run, "--resume", "--max-steps", 5, "-S", "train.save_every=4")  # 5 more: capped at train.steps
    assert "step-000003 (step 3)" in err and "settings changed" not in err
    assert steps(run) == [1, 2, 3, 4]
    assert_same_adapter(finished, run)


def test_the_help_of_max_steps_says_what_it_means_with_resume(capsys):
    from qerl.cli import main

    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ("--max-steps N train N steps, then stop with a checkpoint (never past train.steps); with --resume, N more "
            "steps past the checkpoint it resumes from") in text


def test_settings_changed_on_resume_are_named_in_one_line(finished, tmp_path, here, finish_here):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    err = finish_here(run, "--resume", "-S", "train.steps=5", "-S", "optim.lr=0.01")
    warned = [line for line in err.splitlines() if "settings changed" in line]
    assert warned == [f"WARNING qerl.run.folder: --resume: settings changed since "
                      f"{run / 'checkpoints' / 'step-000004'} "
                      "(optim.lr 0.03 -> 0.01, train.steps 4 -> 5): the run continues with the new values"], err
    assert steps(run) == [1, 2, 3, 4, 5]

    code, err = here(run, "--resume", "-S", "train.steps=5", "-S", "optim.lr=0.01", "-S", "lora.rank=8")
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        f"tiny-trainer: error: --resume: {run / 'checkpoints' / 'step-000005'} was trained with other lora.rank "
        "(lora.rank 4 -> 8); its adapter and optimizer state belong to those: resume with the run's own params.yaml, "
        "or pass --overwrite to start over")
    assert steps(run) == [1, 2, 3, 4, 5]  # refused before anything was written


def test_a_torn_last_metrics_line_is_dropped_with_a_warning_naming_the_file(finished, tmp_path, finish_here):
    """Killed (or out of space) while appending step 3's row, after the checkpoint of step 2."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    shutil.rmtree(run / "checkpoints" / "step-000004")
    rows = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(rows[:2]) + "\n" + rows[2][:32])
    err = finish_here(run, "--resume")
    warned = [line for line in err.splitlines() if "cut short" in line]
    assert len(warned) == 1 and warned[0].startswith(f"WARNING qerl.run.metrics: {run / 'metrics.jsonl'}: dropped its "
                                                     "last line, cut short by a write that was killed or ran out of "
                                                     "disk space ("), err
    assert steps(run) == [1, 2, 3, 4]
    assert_same_adapter(finished, run)


def test_kill_9_during_the_final_adapter_export_leaves_nothing_after_the_next_start(finished, tmp_path, finish_here):
    run = tmp_path / "run"
    kill_at(tmp_path / "exporting", run, "--stall-at-export")
    left = [p.name for p in run.iterdir() if p.name.startswith(".adapter.tmp-")]
    assert len(left) == 1 and (run / left[0] / "adapter_model.safetensors").is_file()
    (run / ".metrics.jsonl.tmp-999").write_text("a metrics rewrite killed before its rename")

    err = finish_here(run, "--resume")  # the last checkpoint is step 4: nothing to train, the adapter is exported again
    assert f"removed {run / left[0]} (left by a write that was killed)" in err
    assert not [p.name for p in run.iterdir() if ".tmp-" in p.name]
    assert steps(run) == [1, 2, 3, 4]
    assert_same_adapter(finished, run)


def test_a_metrics_file_with_a_bad_line_before_the_last_names_file_and_line(finished, tmp_path, here):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    rows = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([rows[0], "{not json", *rows[1:]]) + "\n")
    code, err = here(run, "--resume")
    assert code == 2
    assert err.strip().splitlines()[-1].startswith(f"tiny-trainer: error: {run / 'metrics.jsonl'}:2: not a JSON "
                                                   "record (")
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[2])["step"] == 2  # left as it was


@pytest.mark.parametrize("line", ["[1, 2]", "3", '"x"', "null", '{"step": "two"}', '{"reward_mean": 0.5}'])
def test_a_metrics_line_that_is_no_step_record_names_file_and_line(finished, tmp_path, here, line):
    """Whole JSON that is not a step's record is no torn write: named, never dropped, and nothing is rewritten."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    rows = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([rows[0], line, *rows[1:]]) + "\n")
    before = (run / "metrics.jsonl").read_bytes()
    code, err = here(run, "--resume")
    assert code == 2, err
    assert err.strip().splitlines()[-1].startswith(f"tiny-trainer: error: {run / 'metrics.jsonl'}:2: not a metrics "
                                                   "record (")
    assert (run / "metrics.jsonl").read_bytes() == before


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs of its own, so a test can fill a disk without filling the machine's. Needs root (mount)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here: cannot make a small filesystem to fill")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.parametrize("free", [0, 4096])
def test_a_full_disk_at_the_start_is_one_line_and_leaves_no_trace(small_disk, here, free):
    """Out of space before the run has written anything: exit 2 naming what could not be written, and no empty lock
    file, metrics file or run folder left behind (nothing a run did not need)."""
    from tests.tiny_trainer_process import fill

    run, filler = small_disk / "run", small_disk / "filler"
    fill(filler)
    if free:
        with filler.open("r+b") as f:
            f.truncate(filler.stat().st_size - free)
    code, err = here(run)
    assert code == 2, err
    # the lock file with no space at all, the parameters with one page: a file of the run, by its name
    assert err.strip().splitlines()[-1].startswith(f"tiny-trainer: error: No space left on device: {run}/"), err
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_run_resumes_after_freeing_space(finished, small_disk,
                                                                                               finish_here):
    run, filler = small_disk / "run", small_disk / "filler"
    proc = tiny_process(run, "--fill-disk-at-checkpoint", 4, filler)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    assert err.strip().splitlines()[-1] == (
        f"tiny-trainer: error: No space left on device: {run / 'checkpoints' / 'step-000004'} (the older checkpoints "
        "are intact: free space, then --resume)")
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000002"]  # the failed write's temp is gone

    filler.unlink()
    err = finish_here(run, "--resume")
    assert "step-000002 (step 2)" in err and "damaged" not in err
    assert steps(run) == [1, 2, 3, 4]
    assert_same_adapter(finished, run)


@pytest.fixture
def six_steps(tmp_path, tiny_llama_dir) -> Path:
    """params/tiny.yaml on the tiny random Llama (bf16: nothing to quantize), 6 steps without a periodic checkpoint:
    under a second a step, long enough to still be training when the signal comes after step 1. Two threads in the
    child and here, whatever an earlier test left in this process (README "Determinism")."""
    raw = yaml.safe_load((REPO / "params" / "tiny.yaml").read_text())
    raw["model"].update(path=str(tiny_llama_dir), cpu_threads=2)
    raw["quant"]["scheme"] = "bf16"
    raw["train"].update(steps=6, save_every=100, eval_every=0)
    raw["tracking"]["backend"] = "none"
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


LEARNED = ("reward_mean", "accuracy", "entropy", "loss", "grad_norm", "lr", "response_length", "sigma")


def learned(run: Path) -> list[dict]:
    """What each step learned and measured, without its timings."""
    return [{k: row[k] for k in ("step", *LEARNED)} for row in map(json.loads, (run / "metrics.jsonl").open())]


def test_sigterm_finishes_the_step_writes_a_checkpoint_and_the_resumed_run_is_the_uninterrupted_one(
        six_steps, tmp_path, qerl_here, threads_restored):
    """A real `qerl train` child, preempted (SIGTERM) once its first step is logged; the resume and the uninterrupted
    reference run here. The step in progress when the signal lands (usually the second) is finished, then saved."""
    run = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-m", "qerl.cli", "train", "--params", str(six_steps), "--out", str(run)],
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + patience(120)
    while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text().endswith("\n"):
        assert child.poll() is None and time.monotonic() < deadline, child.communicate()
        time.sleep(0.02)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=patience(60))

    stopped = steps(run)[-1]
    assert child.returncode == 143, err  # 128 + SIGTERM, as a shell reports a process the signal ended
    assert 1 <= stopped < 6 and steps(run) == list(range(1, stopped + 1))
    checkpoint = run / "checkpoints" / f"step-{stopped:06d}"
    assert err.splitlines()[-1] == (f"qerl: stopped by SIGTERM after step {stopped} of 6 (checkpoint {checkpoint}); "
                                    f"resume with: qerl train --params {six_steps} --out {run} --resume")
    assert [p.name for p in (run / "checkpoints").iterdir()] == [checkpoint.name]  # the only one (save_every 100)
    assert not (run / "adapter").exists() and not (run / ".qerl.lock").exists()

    code, _, resumed = qerl_here("train", "--params", six_steps, "--out", run, "--resume")
    assert code == 0 and f"resuming from {checkpoint} (step {stopped})" in resumed
    code, _, _ = qerl_here("train", "--params", six_steps, "--out", tmp_path / "uninterrupted")
    assert code == 0
    assert learned(run) == learned(tmp_path / "uninterrupted")  # every step's numbers, bit for bit
    assert_same_adapter(run, tmp_path / "uninterrupted")


def test_a_second_signal_stops_at_once_as_the_signal_would_have():
    """In this process, with Python's own Ctrl-C handler behind: the first SIGINT is noted, the second is Python's
    KeyboardInterrupt; afterwards the handler is Python's again."""
    from qerl.rl.stopping import StopSignals

    # Python's handler, as at a terminal: pytest started in a shell's background job (a CI runner's, `cmd &`)
    # inherits SIGINT ignored, and StopSignals rightly leaves an ignored signal ignored
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), StopSignals() as signals:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100):  # Python runs the handler between bytecodes of the main thread
                if signals.signum:
                    break
                time.sleep(0.01)
            assert signals.signum == signal.SIGINT
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)


def test_the_resume_command_keeps_the_overrides_and_what_is_left_of_max_steps():
    from qerl.errors import report
    from qerl.rl.stopping import TrainingStopped

    stop = TrainingStopped(signal.SIGINT, 3, 15, Path("runs/x/checkpoints/step-000003"), steps_left=2)
    stop.resume_with(["qerl", "train"], "params/default.yaml", ["lora.rank=8", "data.name=my data.jsonl"], "runs/x",
                     max_steps=5)
    assert str(stop) == ("stopped by SIGINT after step 3 of 15 (checkpoint runs/x/checkpoints/step-000003); resume "
                         "with: qerl train --params params/default.yaml -S lora.rank=8 -S 'data.name=my data.jsonl' "
                         "--out runs/x --max-steps 2 --resume")
    assert report("qerl", stop) == 130  # 128 + SIGINT, as after Ctrl-C
