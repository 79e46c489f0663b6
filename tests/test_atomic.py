"""qerl.run.atomic: a crash between writing and renaming leaves the old content and no partial file in sight."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qerl.run import atomic


def _crash_on_replace(monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(src, dst):
        raise OSError("killed between write and rename")

    monkeypatch.setattr(os, "replace", crash)
    monkeypatch.setattr(os, "rename", crash)


def test_file_writes_replace_the_old_content(tmp_path: Path) -> None:
    path = tmp_path / "metrics.json"
    atomic.write_text(path, "old")
    atomic.write_json(path, {"accuracy": 0.5})
    assert json.loads(path.read_text()) == {"accuracy": 0.5}
    assert path.read_text().endswith("\n")
    atomic.write_bytes(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_crash_before_the_rename_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "samples.jsonl"
    path.write_text("old\n")
    _crash_on_replace(monkeypatch)
    with pytest.raises(OSError, match="killed"):
        atomic.write_text(path, "new, and never seen half-written\n")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["samples.jsonl"]  # the temp file is gone too


def test_folder_replaces_the_old_one_when_complete(tmp_path: Path) -> None:
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "stale.bin").write_text("old")
    with atomic.atomic_dir(out) as tmp:
        assert not (tmp / "stale.bin").exists()
        (tmp / "weights.bin").write_text("new")
        assert not (out / "weights.bin").exists()  # nothing visible until the block ends
    assert sorted(p.name for p in out.iterdir()) == ["weights.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


@pytest.mark.parametrize("failure", ["crash in the block", "crash at the rename"])
def test_folder_crash_keeps_the_old_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str) -> None:
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "weights.bin").write_text("old")
    if failure == "crash at the rename":
        _crash_on_replace(monkeypatch)
    with pytest.raises((OSError, RuntimeError)):
        with atomic.atomic_dir(out) as tmp:
            (tmp / "weights.bin").write_text("new, half")
            if failure == "crash in the block":
                raise RuntimeError("killed while writing")
    assert (out / "weights.bin").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # the temp folder is removed


def test_folder_keep_existing_keeps_the_first_finished(tmp_path: Path) -> None:
    out = tmp_path / "converted"
    with atomic.atomic_dir(out, keep_existing=True) as tmp:
        (tmp / "model.safetensors").write_text("first")
    with atomic.atomic_dir(out, keep_existing=True) as tmp:  # a second process that finished later
        (tmp / "model.safetensors").write_text("second")
    assert (out / "model.safetensors").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converted"]
