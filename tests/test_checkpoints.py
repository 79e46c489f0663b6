"""Checkpoints survive damage: every corruption of the newest is named in one line and the run resumes from the newest
intact one, bit for bit; a `kill -9` in the middle of a checkpoint write leaves nothing behind after --resume."""

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qerl.run.checkpoints import PICKLED_STATE as PICKLED
from qerl.run.checkpoints import NoIntactCheckpoint, read_pickled_state
from qerl.run.manifest import MANIFEST, ManifestMismatch, verify_manifest, write_manifest
from tests.patience import patience
from tests.processes import kill_9
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


STATE, TENSORS, WEIGHTS = "trainer_state.json", "trainer_state.safetensors", "adapter/adapter_model.safetensors"
CORRUPTIONS = {
    "state truncated": (STATE, truncate), "state zero bytes": (STATE, zero), "state garbage": (STATE, garbage),
    "state tensors truncated": (TENSORS, truncate), "state tensors garbage": (TENSORS, garbage),
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


def edit_state(folder: Path, edit) -> None:
    """Change a checkpoint's trainer state and write its manifest again, as a tool (or an attacker) would: its bytes
    then match, and only its content can tell."""
    from qerl.run import safestate

    state = safestate.load(folder / STATE, folder / TENSORS)
    edit(state)
    safestate.save(state, folder / STATE, folder / TENSORS)
    write_manifest(folder)


def first_moment_resized(state):
    moments = state["optimizer"]["state"][0]
    moments["exp_avg"] = torch.zeros(moments["exp_avg"].shape[0] + 1, *moments["exp_avg"].shape[1:])


def adapter_rank_changed(folder: Path) -> None:
    config = folder / "adapter" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "r": 8}))
    write_manifest(folder)


def adapter_rank_removed(folder: Path) -> None:  # a KeyError, exit 1, before: no fallback
    config = folder / "adapter" / "adapter_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "r"}))
    write_manifest(folder)


def adapter_made_nan(folder: Path) -> None:
    from safetensors.torch import save_file

    weights = load_file(str(folder / WEIGHTS))
    next(iter(weights.values())).fill_(float("nan"))
    save_file(weights, str(folder / WEIGHTS))
    write_manifest(folder)


INCONSISTENT = {  # what is wrong -> (how, the file named, what the line says of it)
    "step not a number": (lambda f: edit_state(f, lambda s: s.update(step="three")), STATE, "step = 'three'"),
    "optimizer a number": (lambda f: edit_state(f, lambda s: s.update(optimizer=42)), STATE, "optimizer = 42"),
    "optimizer moment of another shape": (lambda f: edit_state(f, first_moment_resized), STATE,
                                          "optimizer.state[0].exp_avg has shape (5, 32), its parameter (4, 32)"),
    "optimizer for other parameters": (lambda f: edit_state(f, lambda s: s["optimizer"]["param_groups"][0]
                                                            ["params"].pop()), STATE, "optimizer.param_groups[0]"),
    "scheduler a string": (lambda f: edit_state(f, lambda s: s.update(scheduler="x")), STATE, "scheduler = 'x'"),
    "sampler without position": (lambda f: edit_state(f, lambda s: s["sampler"].pop("position")), STATE,
                                 "sampler"),
    "rng of another generator": (lambda f: edit_state(f, lambda s: s["rng"].update(torch=torch.zeros(3))), STATE,
                                 "rng.torch"),
    "adapter rank changed in its config": (adapter_rank_changed, "adapter/adapter_config.json", "rank"),
    "adapter config without its rank": (adapter_rank_removed, "adapter/adapter_config.json", "no 'r'"),
    # resumed, every rollout after it was NaN logits
    "adapter weights not finite": (adapter_made_nan, WEIGHTS, "holds values that are not finite"),
    # A step that is not its folder's: resumed, 99 trained nothing and exported step 4's adapter as the run's final
    # one; 3 overwrote step-000004 with what was really step 5's state.
    "step past its folder's": (lambda f: edit_state(f, lambda s: s.update(step=99)), STATE,
                               "step = 99, but its folder is step-000004"),
    "step behind its folder's": (lambda f: edit_state(f, lambda s: s.update(step=3)), STATE,
                                 "step = 3, but its folder is step-000004"),
    "step past its own run's steps": (lambda f: edit_state(f, lambda s: s["settings"]["train"].update(steps=3)),
                                      STATE, "step = 4, past its run's train.steps = 3"),
    # 0-dim tensors in place of the moments loaded without a word and failed at the first optimizer step
    "optimizer moment a 0-dim tensor": (lambda f: edit_state(f, lambda s: s["optimizer"]["state"][0].update(
        exp_avg=torch.tensor(0.0))), STATE, "optimizer.state[0].exp_avg has shape (), its parameter (4, 32)"),
    "optimizer step count not a scalar": (lambda f: edit_state(f, lambda s: s["optimizer"]["state"][0].update(
        step=torch.zeros(4, 32))), STATE, "optimizer.state[0].step has shape (4, 32), a scalar in AdamW"),
    "optimizer moment missing": (lambda f: edit_state(f, lambda s: s["optimizer"]["state"][0].pop("exp_avg_sq")),
                                 STATE, "optimizer.state[0] lacks exp_avg_sq"),
    "sampler position out of range": (lambda f: edit_state(f, lambda s: s["sampler"].update(position=10**30)),
                                      STATE, f"sampler state position {10**30} out of range"),
    # Values of the right shape that the optimizer cannot take: a NaN moment loaded without a word and made every
    # trained weight NaN; a negative step count failed in the first update ("ComplexFloat can't be cast"), a string
    # learning rate there too (TypeError): exit 1, no file named, no fallback.
    "optimizer moment not finite": (lambda f: edit_state(f, lambda s: s["optimizer"]["state"][0]["exp_avg"].fill_(
        float("nan"))), STATE, "optimizer.state[0].exp_avg holds values that are not finite"),
    "optimizer second moment negative": (lambda f: edit_state(f, lambda s: s["optimizer"]["state"][0][
        "exp_avg_sq"].fill_(-1.0)), STATE, "optimizer.state[0].exp_avg_sq holds negative values"),
    "optimizer step count negative": (lambda f: edit_state(f, lambda s: s["optimizer"]["state"][0].update(
        step=torch.tensor(-5.0))), STATE, "optimizer.state[0].step = -5.0: not a count of steps"),
    "optimizer learning rate a string": (lambda f: edit_state(f, lambda s: s["optimizer"]["param_groups"][0].update(
        lr="x")), STATE, "optimizer.param_groups[0].lr = 'x': not a number, as in AdamW"),
    "optimizer betas not numbers": (lambda f: edit_state(f, lambda s: s["optimizer"]["param_groups"][0].update(
        betas=(0.9, None))), STATE, "optimizer.param_groups[0].betas = tuple: not a pair of numbers, as in AdamW"),
    "aqn sigma not finite": (lambda f: edit_state(f, lambda s: s.update(aqn={"sigma": float("inf")})), STATE,
                             "aqn.sigma = inf: not a finite number"),
    # The schedule's count of updates past the checkpoint's step set the learning rate of another point of the run
    "scheduler past its step": (lambda f: edit_state(f, lambda s: s["scheduler"].update(last_epoch=10**30)), STATE,
                                "scheduler.last_epoch = 1000000000000000000000000000000: updates counted past the "
                                "checkpoint's step 4"),
}


@pytest.mark.parametrize("what", INCONSISTENT)
def test_a_checkpoint_whose_content_is_inconsistent_is_named_set_aside_and_the_run_falls_back(run, what, caplog):
    """Its manifest matches, but its state does not fit the run: checked before anything is applied, named by file in
    one line, set aside like a damaged one; the run resumes from the previous checkpoint."""
    damage, name, said = INCONSISTENT[what]
    damage(run / "checkpoints" / "step-000004")
    with caplog.at_level(logging.WARNING), make_trainer(tiny_settings(None), run, resume=True) as trainer:
        assert trainer.step == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    named = [m for m in warnings if m.startswith(f"checkpoint step-000004 is damaged: "
                                                 f"{run / 'checkpoints' / 'step-000004' / name}: ")]
    assert len(named) == 1 and said in named[0] and "\n" not in named[0], warnings
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["corrupt-step-000004", "step-000002"]
    assert steps(run) == [1, 2]


def test_when_every_checkpoint_is_inconsistent_resume_is_one_line_exit_2(run, here):
    for folder in (run / "checkpoints").iterdir():
        edit_state(folder, lambda s: s.update(optimizer=42))
    code, err = here(run, "--resume")
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"tiny-trainer: error: no intact checkpoint in {run / 'checkpoints'}: ")
    assert all(f"{run / 'checkpoints' / step / STATE}: optimizer = 42" in last
               for step in ("step-000004", "step-000002")), last
    assert steps(run) == [1, 2, 3, 4]


def test_a_checkpoint_past_a_lowered_train_steps_is_refused_in_one_line_and_kept(run, here):
    """Resumed, it trained nothing and exported step 4's adapter as the final one of a 3-step run: the settings are
    wrong, not the checkpoint, so nothing is set aside."""
    before = adapter(run)
    code, err = here(run, "--resume", "-S", "train.steps=3")
    assert code == 2, err
    assert err.strip().splitlines()[-1] == (
        f"tiny-trainer: error: --resume: {run / 'checkpoints' / 'step-000004'} is at step 4, past train.steps = 3: "
        "set train.steps to 4 or more to continue the run, or pass --overwrite to start over")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert steps(run) == [1, 2, 3, 4]
    after = adapter(run)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_checkpoint_whose_manifest_was_deleted_is_damaged(run, caplog):
    """qerl writes a manifest with every checkpoint: one without was tampered with, so it is not loaded unverified."""
    (run / "checkpoints" / "step-000004" / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING), make_trainer(tiny_settings(None), run, resume=True) as trainer:
        assert trainer.step == 2
    assert any(f"{run / 'checkpoints' / 'step-000004' / MANIFEST}: missing (every checkpoint is written with one)"
               in r.getMessage() for r in caplog.records)


def as_pickled_checkpoint(folder: Path, manifest: bool) -> None:
    """Rewrite a checkpoint as older qerl wrote it: the trainer state pickled by torch.save (and, in the oldest
    versions, no manifest)."""
    from qerl.run import safestate

    state = safestate.load(folder / STATE, folder / TENSORS)
    (folder / STATE).unlink()
    (folder / TENSORS).unlink()
    (folder / MANIFEST).unlink()
    torch.save(state, folder / PICKLED)
    if manifest:
        write_manifest(folder)


@pytest.mark.parametrize("manifest", [True, False])
def test_an_older_pickled_checkpoint_resumes_bit_for_bit(finished, tmp_path, manifest):
    """Read by torch's restricted unpickler (tensors, numbers, numpy arrays): nothing to run, and the same run."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    shutil.rmtree(run / "checkpoints" / "step-000004")
    as_pickled_checkpoint(run / "checkpoints" / "step-000002", manifest)
    (run / "adapter").rename(run / "adapter-before")
    with make_trainer(tiny_settings(None), run, resume=True) as trainer:
        assert trainer.step == 2
        trainer.train()
    a, b = adapter(finished), adapter(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("what", ["state garbage", "adapter truncated"])
def test_an_older_checkpoint_without_manifest_is_checked_by_loading_it(run, what, caplog):
    """Checkpoints written before manifests existed: a load error names the file and the run falls back too."""
    name, damage = CORRUPTIONS[what]
    for ckpt in (run / "checkpoints").iterdir():
        as_pickled_checkpoint(ckpt, manifest=False)
    damage(run / "checkpoints" / "step-000004" / (PICKLED if name == STATE else name))
    with caplog.at_level(logging.WARNING), make_trainer(tiny_settings(None), run, resume=True) as trainer:
        assert trainer.step == 2
    assert any(f"{run / 'checkpoints' / 'step-000004' / (PICKLED if name == STATE else name)}: unreadable ("
               in r.getMessage() for r in caplog.records)


class Payload:
    """Unpickling this runs `touch MARKER`: what an attacker plants in a checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_resume_never_runs_code_planted_in_a_checkpoint(finished, tmp_path):
    """A pickled trainer state carrying a payload, the manifest updated to match (as an attacker would): the real
    `--resume` process refuses the checkpoint, naming the function the pickle asked for, runs nothing, and continues
    from the older checkpoint."""
    run, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(finished, run)
    newest = run / "checkpoints" / "step-000004"
    as_pickled_checkpoint(newest, manifest=False)
    state = read_pickled_state(newest / PICKLED)
    state["aqn"] = Payload(marker)
    torch.save(state, newest / PICKLED)
    write_manifest(newest)
    # A planted pickle beside the JSON state is never read either.
    torch.save(Payload(marker), run / "checkpoints" / "step-000002" / PICKLED)
    write_manifest(run / "checkpoints" / "step-000002")

    proc = tiny_process(run, "--resume")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert not marker.exists()
    refused = [line for line in err.splitlines() if "checkpoint step-000004 is damaged" in line]
    assert len(refused) == 1 and f"{newest / PICKLED}: refused: its pickle calls " in refused[0], err
    assert "system" in refused[0] and "nothing was run" in refused[0]
    assert "resuming from" in err and "step-000002 (step 2)" in err
    assert steps(run) == [1, 2, 3, 4]
    a, b = adapter(finished), adapter(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


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


def test_kill_9_during_a_checkpoint_write_then_resume(finished, tmp_path, finish_here):
    run, marker = tmp_path / "run", tmp_path / "writing"
    proc = tiny_process(run, "--stall-at-checkpoint", 4, "--marker", marker)
    wait_for(marker, proc)
    assert not kill_9(proc, patience(30)), "outlived the killed trainer"  # its grader's worker exits with it
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == [f".tmp-step-000004-{proc.pid}", "step-000002"]  # the write was caught half-way
    assert not (run / "checkpoints" / ckpts[0] / MANIFEST).exists()

    err = finish_here(run, "--resume")  # in this process: only the kill needs a process of its own
    assert "resuming from" in err and "step-000002 (step 2)" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert steps(run) == [1, 2, 3, 4]
    a, b = adapter(finished), adapter(run)
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit for bit the uninterrupted run's


def test_qerl_train_resume_with_every_checkpoint_damaged_is_one_line(tmp_path, qerl_here):
    """The same through the `qerl` command on the embedded model: exit 2 and one line, no traceback."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "checkpoints" / "step-000002" / STATE).write_bytes(b"")
    write_manifest(run / "checkpoints" / "step-000002")
    (run / "checkpoints" / "step-000002" / STATE).write_bytes(b"garbage")
    code, _, err = qerl_here("train", "--params", "params/tiny.yaml", "--out", run, "--resume")
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last == (f"qerl: error: no intact checkpoint in {run / 'checkpoints'}: {run / 'checkpoints' / 'step-000002'}"
                    f"/{STATE}: 7 bytes, the manifest says 0 (pass --overwrite to start the run over)")
    assert "Traceback" not in err


def test_the_state_format_keeps_every_kind_of_value_a_trainer_state_holds(tmp_path):
    import math
    import random

    import numpy as np

    from qerl.run import safestate

    tree = {"python_rng": random.Random(1).getstate(), "numpy_rng": np.random.RandomState(2).get_state(),
            "by_index": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}}, "floats": [0.1, math.inf],
            "none": None, "flag": True, "text": "a", "__tensor__": "a key that looks like a marker"}
    safestate.save(tree, tmp_path / "s.json", tmp_path / "s.safetensors")
    back = safestate.load(tmp_path / "s.json", tmp_path / "s.safetensors")
    assert back["python_rng"] == tree["python_rng"]  # tuples stay tuples: random.setstate takes them
    assert all((a == b).all() if isinstance(a, np.ndarray) else a == b
               for a, b in zip(back["numpy_rng"], tree["numpy_rng"]))
    assert back["numpy_rng"][1].dtype == np.uint32
    assert list(back["by_index"]) == [0] and torch.equal(back["by_index"][0]["exp_avg"], tree["by_index"][0]["exp_avg"])
    assert back["floats"] == [0.1, math.inf] and back["none"] is None and back["flag"] is True
    assert back["__tensor__"] == "a key that looks like a marker"

    (tmp_path / "s.json").write_text('{"x": {"__tensor__": "t99"}}')  # names a tensor the file lacks
    with pytest.raises(safestate.StateFormatError, match=r"s\.json: KeyError: 't99'"):
        safestate.load(tmp_path / "s.json", tmp_path / "s.safetensors")
