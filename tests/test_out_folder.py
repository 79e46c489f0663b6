"""`--out` of every command: a file, or a folder nothing can be written in, is one line naming it before any work;
a failed `train` leaves no empty run folder; `export` of a missing adapter says it does not exist."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from qerl.cli import main

REPO = Path(__file__).resolve().parent.parent
MISSING_MODEL = "model.path=/nonexistent/model"  # any work (a model load) would fail on this, naming the model


def error(capsys, *args) -> str:
    assert main([str(a) for a in args]) == 2  # bad input
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def unwritable_folder(tmp_path: Path) -> Path:
    """A folder this process cannot create files in: read-only by mode, or (as root, whom modes do not stop) /sys."""
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
        return folder
    try:
        os.close(tempfile.mkstemp(dir="/sys")[0])
    except OSError:
        return Path("/sys")
    pytest.skip("running as root on a machine whose /sys is writable: no unwritable folder to try")


COMMANDS = {  # each names a model that does not exist: the --out error must come first
    "train": ["train", "--params", REPO / "params/tiny.yaml", "-S", MISSING_MODEL],
    "eval": ["eval", "--params", REPO / "params/tiny.yaml", "-S", MISSING_MODEL],
    "quantize": ["quantize", "--model", "/nonexistent/model"],
    "export": ["export", "--adapter", "/nonexistent/adapter"],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_out_that_is_a_file_is_one_line_before_any_work(command, tmp_path, capsys):
    taken = tmp_path / "results"
    taken.write_text("keep me")
    message = error(capsys, *COMMANDS[command], "--out", taken)
    assert message == f"qerl: error: --out {taken} is a file, not a folder; choose another --out"
    assert taken.read_text() == "keep me"
    inside = taken / "run"
    assert error(capsys, *COMMANDS[command], "--out", inside) == (
        f"qerl: error: --out {inside} cannot be created: {taken} is a file, not a folder; choose another --out")


@pytest.mark.parametrize("command", COMMANDS)
def test_out_where_nothing_can_be_written_is_one_line_before_any_work(command, tmp_path, capsys):
    folder = unwritable_folder(tmp_path)
    out = folder / "run"
    message = error(capsys, *COMMANDS[command], "--out", out)
    assert message.startswith(f"qerl: error: --out {out} cannot be created in {folder} (")
    assert message.endswith("); choose another --out") and not out.exists()


def test_the_default_out_is_named_by_its_setting(tmp_path, capsys):
    taken = tmp_path / "eval"
    taken.write_text("")
    assert error(capsys, "eval", "--params", REPO / "params/tiny.yaml", "-S", f"eval.out_dir={taken}") == (
        f"qerl: error: eval.out_dir {taken} is a file, not a folder; choose another eval.out_dir")


def test_a_train_that_fails_to_start_leaves_no_empty_run_folder(tmp_path, capsys):
    out = tmp_path / "runs" / "new"
    message = error(capsys, "train", "--params", REPO / "params/tiny.yaml", "-S", "data.name=/nonexistent/data.jsonl",
                    "--out", out)
    assert "/nonexistent/data.jsonl" in message
    assert not (tmp_path / "runs").exists()  # neither the run folder nor the parent it created

    kept = tmp_path / "kept"  # a folder that was there before stays, even empty
    kept.mkdir()
    error(capsys, "train", "--params", REPO / "params/tiny.yaml", "-S", "data.name=/nonexistent/data.jsonl",
          "--out", kept)
    assert kept.is_dir() and not any(kept.iterdir())


def test_export_of_a_missing_adapter_says_it_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "runs" / "default" / "adapter"
    assert error(capsys, "export", "--adapter", missing, "--out", tmp_path / "exports") == (
        f"qerl: error: --adapter {missing} does not exist: give a PEFT adapter folder (e.g. runs/default/adapter)")
    assert not (tmp_path / "exports").exists()
