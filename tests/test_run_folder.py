"""One run per folder: a second trainer on it fails at once naming the holder, a lock dies with its process, and a
previous run is never overwritten without --resume or --overwrite."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qerl.run.checkpoints import NoIntactCheckpoint
from qerl.run.folder import RunFolder
from qerl.run.lock import FolderLocked, run_folder_lock
from tests.patience import patience
from tests.processes import kill_9
from tests.test_trainer import make_trainer, tiny_settings

REPO = Path(__file__).resolve().parent.parent


def tiny_process(*args):
    return subprocess.Popen([sys.executable, "-m", "tests.tiny_trainer_process", *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = patience(120)) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_trainers_racing_on_one_folder_one_wins_the_other_fails_at_once_naming_it(tmp_path):
    run, release = tmp_path / "run", tmp_path / "release"
    a, b = tiny_process(run, "--hold-until", release), tiny_process(run, "--hold-until", release)
    loser = None
    deadline = time.monotonic() + 120
    while loser is None:  # the loser exits on its own while the winner still holds the folder
        loser = next((p for p in (a, b) if p.poll() is not None), None)
        assert time.monotonic() < deadline, "neither trainer gave up"
        time.sleep(0.05)
    winner = b if loser is a else a
    _, err = loser.communicate()
    assert loser.returncode == 2, err
    assert err.splitlines() == [f"tiny-trainer: error: run folder {run} is in use by PID {winner.pid} on host "
                                f"{socket.gethostname()} (lock file {run / '.qerl.lock'}); wait for it to finish or "
                                "stop it, or choose another folder"]
    release.touch()
    assert winner.wait(patience(120)) == 0, winner.communicate()
    assert steps(run) == [1, 2, 3, 4]  # one run's steps, not two runs interleaved
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert not (run / ".qerl.lock").exists()  # released and removed at the end


def test_a_lock_dies_with_its_process(tmp_path):
    run, release = tmp_path / "run", tmp_path / "release"
    holder = tiny_process(run, "--hold-until", release)
    wait_for(run / "metrics.jsonl", holder)
    with pytest.raises(FolderLocked, match=f"PID {holder.pid} on host"):
        run_folder_lock(run).acquire()
    assert not kill_9(holder, patience(30)), "outlived the killed trainer"
    assert (run / ".qerl.lock").exists()  # left behind by the killed holder, and no obstacle
    run_folder_lock(run).acquire().release()


def test_qerl_train_on_a_folder_in_use_is_one_line_naming_the_holder(tmp_path, qerl_here):
    """The holder is a `qerl train` child; the second `qerl train` runs here (conftest's `qerl_here`)."""
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "qerl.cli", "train", "--params", "params/tiny.yaml", "--out",
                              str(run)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(run / ".qerl.lock", first)
        code, _, err = qerl_here("train", "--params", "params/tiny.yaml", "--out", run)
    finally:
        left = kill_9(first, patience(30))
    assert not left, "outlived the killed trainer"
    assert code == 2
    assert err.splitlines() == [
        f"qerl: error: run folder {run} is in use by PID {first.pid} on host {socket.gethostname()} "
        f"(lock file {run / '.qerl.lock'}); wait for it to finish or stop it, or choose another folder"]


@pytest.fixture
def finished_run(tmp_path):
    """A finished 4-step run whose checkpoints were deleted afterwards (to save space, say)."""
    run = tmp_path / "run"
    with make_trainer(tiny_settings(tmp_path), run) as trainer:
        trainer.train()
    for ckpt in (run / "checkpoints").iterdir():
        for f in sorted(ckpt.rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
        ckpt.rmdir()
    (run / "checkpoints").rmdir()
    return run


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}


def test_a_finished_run_without_checkpoints_is_not_overwritten_without_a_flag(finished_run, tmp_path):
    before = snapshot(finished_run)
    with pytest.raises(FileExistsError) as info:
        make_trainer(tiny_settings(tmp_path), finished_run)
    assert str(info.value) == (f"{finished_run} already holds a run (metrics.jsonl, adapter/): pass --resume to "
                               "continue it, --overwrite to replace it (its outputs are deleted), or choose another "
                               "--out")
    with pytest.raises(FileExistsError, match="nothing to resume in .* holds metrics.jsonl, adapter/ but no "
                                              "checkpoint; pass --overwrite"):
        make_trainer(tiny_settings(tmp_path), finished_run, resume=True)
    assert snapshot(finished_run) == before  # nothing lost, not even the metrics
    run_folder_lock(finished_run).acquire().release()  # and the refused trainers let go of the folder


def test_overwrite_replaces_the_previous_run(finished_run, tmp_path):
    (finished_run / "metrics.jsonl").write_text('{"step": 1, "old": true}\n' * 9)
    old_adapter = (finished_run / "adapter" / "adapter_model.safetensors").read_bytes()
    notes = finished_run / "notes.txt"
    notes.write_text("mine")
    settings = tiny_settings(tmp_path, train={"steps": 2})
    with pytest.raises(ValueError, match="--resume and --overwrite exclude each other"):
        make_trainer(settings, finished_run, resume=True, overwrite=True)
    with make_trainer(settings, finished_run, overwrite=True) as trainer:
        trainer.train()
    assert steps(finished_run) == [1, 2] and "old" not in (finished_run / "metrics.jsonl").read_text()
    assert (finished_run / "adapter" / "adapter_model.safetensors").read_bytes() != old_adapter
    assert notes.read_text() == "mine"  # only the run's own outputs go


@pytest.mark.parametrize("flag", ["--overwrite", "--resume"])
@pytest.mark.parametrize("linked", ["adapter", "checkpoints"])
def test_a_run_folder_whose_outputs_are_links_is_refused_before_anything_is_deleted(tmp_path, qerl_here, linked, flag):
    """--overwrite deleted metrics.jsonl, then failed on the link (rmtree refuses them) with exit 1: a half-deleted
    run. The files stand for a run's (the refusal comes before anything reads them)."""
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere" / linked
    (run / "adapter").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run / "adapter" / "adapter_config.json").write_text("{}")
    (elsewhere / "step-000002").mkdir(parents=True)
    (elsewhere / "step-000002" / "notes.txt").write_text("someone else's")
    if linked == "adapter":
        shutil.rmtree(run / "adapter")
    (run / linked).symlink_to(elsewhere, target_is_directory=True)
    before, theirs = snapshot(run), snapshot(elsewhere)
    code, _, err = qerl_here("train", "--params", "params/tiny.yaml", "--out", run, flag)
    assert code == 2, err
    assert err.splitlines() == [
        f"qerl: error: {run / linked} is a symbolic link (to {elsewhere}): a run folder's outputs must be its own, so "
        "qerl neither writes nor deletes through it; replace it with the files themselves, or choose another --out "
        "(nothing was changed)"]
    assert snapshot(run) == before and snapshot(elsewhere) == theirs  # the metrics too
    assert (run / linked).is_symlink()


def test_qerl_eval_refuses_an_out_in_a_live_run_folder_or_a_run_folder_itself(tmp_path, qerl_here):
    """As `train` refuses them: an evaluation's files would land among a running run's, or beside a run's own."""
    run = tmp_path / "run"
    run.mkdir()
    lock = run_folder_lock(run).acquire()  # a live run (flock: another open file, so held against this process too)
    try:
        for out, inside in ((run / "eval", "inside "), (run, "")):
            code, _, err = qerl_here("eval", "--params", "params/tiny.yaml", "--out", out)
            assert code == 2, err
            assert err.splitlines() == [f"qerl: error: --out {out} is {inside}run folder {run}, in use by PID "
                                        f"{os.getpid()} on host {socket.gethostname()}: wait for the run to finish, "
                                        "or choose another --out"]
    finally:
        lock.release()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # a finished run: its own folder still is not for evaluations
    code, _, err = qerl_here("eval", "--params", "params/tiny.yaml", "--out", run)
    assert code == 2, err
    assert err.splitlines() == [f"qerl: error: --out {run} holds a training run (metrics.jsonl): write the "
                                f"evaluation elsewhere, e.g. --out {run / 'eval'}"]
    assert sorted(p.name for p in run.rglob("*")) == ["metrics.jsonl"]  # nothing written, no lock file left


def test_resume_on_an_empty_folder_starts_at_step_zero(tmp_path):
    with make_trainer(tiny_settings(tmp_path), tmp_path / "new", resume=True) as trainer:
        assert trainer.step == 0


def test_qerl_train_refuses_a_previous_run_in_one_line_before_loading_anything(finished_run, qerl_here):
    start = time.perf_counter()
    code, _, err = qerl_here("train", "--params", "params/tiny.yaml", "--out", finished_run)
    assert code == 2
    assert err.splitlines() == [f"qerl: error: {finished_run} already holds a run (metrics.jsonl, adapter/): "
                                        "pass --resume to continue it, --overwrite to replace it (its outputs are "
                                        "deleted), or choose another --out"]
    assert time.perf_counter() - start < 60


# ---------------------------------------------------------------------------------------------------------------------
# The run folder on its own: what the trainer hands it and gets back, without a model.
# ---------------------------------------------------------------------------------------------------------------------

SETTINGS = {"model": {"path": "m"}, "optim": {"lr": 0.1}}


def state(step: int) -> dict:
    return {"step": step, "weights": torch.full((3,), float(step)), "rng": (1, 2.5, None)}


def beside(folder: Path) -> None:  # what a trainer writes into a checkpoint next to its state (an adapter)
    (folder / "adapter").mkdir()
    save_file({"w": torch.ones(2)}, str(folder / "adapter" / "w.safetensors"))


def test_the_run_folder_keeps_states_and_hands_back_the_newest(tmp_path):
    run = tmp_path / "run"
    with RunFolder(run) as folder:
        assert (run / ".qerl.lock").exists()
        assert folder.checkpoint_to_resume(SETTINGS) is None  # a fresh start
        for step in (1, 2, 3):
            folder.metrics.write({"step": step})
            folder.save_checkpoint({**state(step), "settings": SETTINGS}, beside)
        folder.metrics.write({"step": 4})  # a step past the last checkpoint, lost with a kill
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000003"]  # keep=2
    assert not (run / ".qerl.lock").exists()
    with pytest.raises(FileExistsError, match="already holds a run"):
        RunFolder(run)
    assert not (run / ".qerl.lock").exists()  # a refused start lets go of the folder
    with RunFolder(run, resume=True) as folder:
        resumed = folder.checkpoint_to_resume(SETTINGS, required=("weights",))
        assert resumed.step == 3 and resumed.path == run / "checkpoints" / "step-000003"
        assert torch.equal(resumed.state["weights"], torch.full((3,), 3.0)) and resumed.state["rng"] == (1, 2.5, None)
        assert (resumed.path / "adapter" / "w.safetensors").is_file()
        assert [r["step"] for r in folder.metrics.read()] == [1, 2, 3]  # cut back to the checkpoint


def test_the_run_folder_refuses_a_state_without_what_the_trainer_needs_and_other_fixed_settings(tmp_path):
    run = tmp_path / "run"
    with RunFolder(run) as folder:
        folder.save_checkpoint({**state(1), "settings": SETTINGS})
    with RunFolder(run, resume=True) as folder, pytest.raises(NoIntactCheckpoint, match="lacks optimizer"):
        folder.checkpoint_to_resume(SETTINGS, required=("optimizer",))
    other = {**SETTINGS, "model": {"path": "another"}}
    with RunFolder(run, resume=True) as folder, pytest.raises(ValueError, match="other model.path"):
        folder.checkpoint_to_resume(other)


def test_only_the_main_rank_locks_or_writes(tmp_path):
    run = tmp_path / "run"
    with RunFolder(run) as folder:
        folder.metrics.write({"step": 1})
        folder.save_checkpoint(state(1))
        folder.metrics.write({"step": 2})
        with RunFolder(run, resume=True, main=False) as other:  # another rank of the same job: no lock, no rules
            assert other.lock is None and other.checkpoint_to_resume(SETTINGS).step == 1
            other.write_params("x: 1\n")
        assert [r["step"] for r in folder.metrics.read()] == [1, 2] and not (run / "params.yaml").exists()
