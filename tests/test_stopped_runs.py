"""Every killed or stopped run resumes: killed (`kill -9`, a real process) before its first checkpoint or during the
final adapter export, stopped by --max-steps, continued with changed settings, with a torn last metrics line, or
stopped by a full disk (a real process filling a real filesystem). Each resumed run ends with the adapter of an
uninterrupted one.

The kills and the full disk happen in processes of their own; the runs that only start, resume or stop run in this
process (conftest's `finish_here`): they read and write nothing but the run folder, so a child would only add an
interpreter's start-up (torch, the grader's worker: most of a tiny run's time) to each."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.patience import patience
from tests.processes import kill_9
from tests.test_checkpoints import adapter, finished  # noqa: F401 - finished: the uninterrupted run, a fixture
from tests.test_run_folder import steps, tiny_process, wait_for


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
