"""Checkpoints survive damage: every corruption of the newest is named in one line and the run resumes from the newest
intact one, bit for bit; a `kill -9` in the middle of a checkpoint write leaves nothing behind after --resume."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qerl.checkpoints import NoIntactCheckpoint
from qerl.manifest import MANIFEST, ManifestMismatch, verify_manifest, write_manifest
from tests.test_run_folder import steps, tiny_process, wait_for
from tests.test_trainer import make_trainer, tiny_settings


def adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step run (checkpoints at steps 2 and 4), to copy and damage."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    with make_trainer(tiny_settings(None), run) as trainer:
        trainer.train()
    return run


@pytest.fixture
def run(finished, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def zero(path: Path) -> None:
    path.write_bytes(b"")


def garbage(path: Path) -> None:  # same size: only the hash can tell
    path.write_bytes(os.urandom(path.stat().st_size))


STATE, WEIGHTS = "trainer_state.pt", "adapter/adapter_model.safetensors"
CORRUPTIONS = {
    "state truncated": (STATE, truncate), "state zero bytes": (STATE, zero), "state garbage": (STATE, garbage),
    "adapter truncated": (WEIGHTS, truncate), "adapter garbage": (WEIGHTS, garbage),
    "manifest garbage": (MANIFEST, garbage), "adapter config deleted": ("adapter/adapter_config.json", Path.unlink),
}


def test_manifest_lists_every_file_and_catches_any_change(tmp_path):
    folder = tmp_path / "f"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.bin").write_bytes(b"abc")
    (folder / "sub" / "b.txt").write_text("hello")
    write_manifest(folder)
    assert set(json.loads((folder / MANIFEST).read_text())["files"]) == {"a.bin", "sub/b.txt"}
    verify_manifest(folder)
    (folder / "a.bin").write_bytes(b"abd")
    with pytest.raises(ManifestMismatch, match=r"a\.bin: content differs from the manifest"):
        verify_manifest(folder)


@pytest.mark.parametrize("what", CORRUPTIONS)
def test_a_damaged_newest_checkpoint_is_named_and_the_run_falls_back_to_the_previous(run, what, caplog):
    name, damage = CORRUPTIONS[what]
    damage(run / "checkpoints" / "step-000004" / name)
    with caplog.at_level(logging.WARNING), make_trainer(tiny_settings(None), run, resume=True) as trainer:
        assert trainer.step == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("checkpoint step-000004 is damaged: ") and str(run / "checkpoints" / "step-000004" / name)
               in m and "\n" not in m for m in warnings), warnings
    assert any(m.endswith(str(run / "checkpoints" / "step-000002")) and "falling back" in m for m in warnings)
    # set aside, not deleted: the evidence stays and the next save of step 4 does not collide with it
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["corrupt-step-000004", "step-000002"]
    assert steps(run) == [1, 2]


@pytest.mark.parametrize("what", ["state garbage", "adapter truncated"])
def test_a_checkpoint_without_manifest_is_checked_by_loading_it(run, what, caplog):
    """Checkpoints written before manifests existed: a load error names the file and the run falls back too."""
    name, damage = CORRUPTIONS[what]
    for ckpt in (run / "checkpoints").iterdir():
        (ckpt / MANIFEST).unlink()
    damage(run / "checkpoints" / "step-000004" / name)
    with caplog.at_level(logging.WARNING), make_trainer(tiny_settings(None), run, resume=True) as trainer:
        assert trainer.step == 2
    assert any(f"{run / 'checkpoints' / 'step-000004' / name}: unreadable (" in r.getMessage()
               for r in caplog.records)


def test_after_a_fallback_the_run_continues_to_the_same_adapter_as_an_undamaged_one(finished, run):
    garbage(run / "checkpoints" / "step-000004" / STATE)
    (run / "adapter").rename(run / "adapter-before")
    with make_trainer(tiny_settings(None), run, resume=True) as trainer:
        trainer.train()
    a, b = adapter(finished), adapter(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert steps(run) == [1, 2, 3, 4]


def test_when_every_checkpoint_is_damaged_resume_says_so_and_changes_nothing(run):
    garbage(run / "checkpoints" / "step-000004" / STATE)
    zero(run / "checkpoints" / "step-000002" / WEIGHTS)
    with pytest.raises(NoIntactCheckpoint) as info:
        make_trainer(tiny_settings(None), run, resume=True)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"no intact checkpoint in {run / 'checkpoints'}: ")
    assert str(run / "checkpoints" / "step-000004" / STATE) in message
    assert str(run / "checkpoints" / "step-000002" / WEIGHTS) in message and "--overwrite" in message
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert steps(run) == [1, 2, 3, 4]


def test_kill_9_during_a_checkpoint_write_then_resume(finished, tmp_path):
    run, marker = tmp_path / "run", tmp_path / "writing"
    proc = tiny_process(run, "--stall-at-checkpoint", 4, "--marker", marker)
    wait_for(marker, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == [f".tmp-step-000004-{proc.pid}", "step-000002"]  # the write was caught half-way
    assert not (run / "checkpoints" / ckpts[0] / MANIFEST).exists()

    resumed = tiny_process(run, "--resume")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert "resuming from" in err and "step-000002 (step 2)" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert steps(run) == [1, 2, 3, 4]
    a, b = adapter(finished), adapter(run)
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit for bit the uninterrupted run's


def test_qerl_train_resume_with_every_checkpoint_damaged_is_one_line(tmp_path):
    """The same through the `qerl` command on the embedded model: exit 2 and one line, no traceback."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "checkpoints" / "step-000002" / STATE).write_bytes(b"")
    write_manifest(run / "checkpoints" / "step-000002")
    (run / "checkpoints" / "step-000002" / STATE).write_bytes(b"garbage")
    proc = subprocess.run([sys.executable, "-m", "qerl.cli", "train", "--params", "params/tiny.yaml", "--out", str(run),
                           "--resume"], cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"qerl: error: no intact checkpoint in {run / 'checkpoints'}: {run / 'checkpoints' / 'step-000002'}"
                    f"/{STATE}: 7 bytes, the manifest says 0 (pass --overwrite to start the run over)")
    assert "Traceback" not in proc.stderr
