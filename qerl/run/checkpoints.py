"""The checkpoints of a run folder on disk: which exist, which are intact, what a killed write left behind.

Layout under `<run>/checkpoints/`: `step-NNNNNN/` (finished, with a manifest written last), `.tmp-step-NNNNNN-PID/`
(a write in progress, or the remains of a killed one), `corrupt-step-NNNNNN/` (set aside by a resume that found it
damaged and fell back to an older one; kept for inspection, never read again). What a checkpoint holds and how it
is applied is the trainer's business: this module takes a `read` function. It knows one thing about the contents:
checkpoints of older qerl versions held a pickled `trainer_state.pt` (and the oldest of them no manifest), which
`read_pickled_state` reads without running anything.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any, Callable, TypeVar

from qerl.run.manifest import MANIFEST, ManifestMismatch, has_manifest, verify_manifest

log = logging.getLogger(__name__)

PREFIX = "step-"
TEMP_PREFIX = ".tmp-step-"
CORRUPT_PREFIX = "corrupt-"
PICKLED_STATE = "trainer_state.pt"  # the trainer state as older qerl wrote it (torch.save); now JSON + safetensors

T = TypeVar("T")


class CheckpointCorrupt(ValueError):
    """A checkpoint file that cannot be used; the message names the file in one line."""


class NoIntactCheckpoint(ValueError):
    """Every checkpoint of the run is damaged; the message lists them."""


def finished(root: Path) -> list[Path]:
    """The finished checkpoint folders, oldest first (names sort by step)."""
    return sorted(p for p in root.glob(PREFIX + "*") if p.is_dir()) if root.is_dir() else []


def step_of(folder: Path) -> int | None:
    """The step a finished checkpoint's folder is named by (`step-000004`: 4); None for a name that gives none."""
    digits = folder.name[len(PREFIX):]
    return int(digits) if folder.name.startswith(PREFIX) and digits.isascii() and digits.isdigit() else None


def temp_folder(root: Path, step: int, pid: int) -> Path:
    return root / f"{TEMP_PREFIX}{step:06d}-{pid}"


def remove_killed_writes(root: Path) -> list[Path]:
    """Delete the temp folders of checkpoint writes that never finished. Call only while holding the run's lock:
    then no live process is writing one."""
    stale = sorted(root.glob(TEMP_PREFIX + "*")) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed %s (a checkpoint write that was killed)", path)
    return stale


def read_pickled_state(file: Path) -> Any:
    """An older qerl's `torch.save`d trainer state, unpickled by torch's restricted loader (`weights_only`): tensors,
    numbers, strings, containers and the numpy arrays of a numpy RNG state, nothing else. A pickle that names any
    other function (code it would run) is refused with `CheckpointCorrupt` naming the file and the function."""
    import numpy as np
    import torch

    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed it
    numpy_array = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), core.multiarray._reconstruct]
    try:
        with torch.serialization.safe_globals(numpy_array):
            return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle's and torch's own error types
        found = re.search(r"GLOBAL ([\w.]+)", str(e))  # torch names the function the pickle asked for
        if found is None:
            raise
        raise CheckpointCorrupt(f"{file}: refused: its pickle calls {found.group(1)}, which a trainer state never "
                                "holds (nothing was run; a checkpoint may only hold tensors, numbers and arrays)") \
            from None


def newest_intact(root: Path, read: Callable[[Path], T]) -> tuple[Path, T] | None:
    """The newest checkpoint whose files match its manifest and that `read` accepts (it raises `CheckpointCorrupt`
    otherwise), with what `read` returned; None if there is no checkpoint at all.

    Damaged newer ones are reported in one line each and renamed `corrupt-step-*` once an intact one is found, so the
    next save of that step does not collide with them and the next resume does not trip on them again. If none is
    intact, nothing is renamed and `NoIntactCheckpoint` says what is wrong with each.
    """
    damaged: list[tuple[Path, Exception]] = []
    for folder in reversed(finished(root)):
        try:
            if has_manifest(folder):
                verify_manifest(folder)
            elif (folder / PICKLED_STATE).is_file():
                log.warning("%s has no manifest (written by an older qerl): loading it unverified", folder)
            else:  # every checkpoint of this format is written with one: it was deleted since
                raise ManifestMismatch(folder / MANIFEST, "missing (every checkpoint is written with one)")
            result = read(folder)
        except (ManifestMismatch, CheckpointCorrupt) as e:
            log.warning("checkpoint %s is damaged: %s", folder.name, e)
            damaged.append((folder, e))
            continue
        for bad, _ in damaged:
            aside = bad.with_name(CORRUPT_PREFIX + bad.name)
            shutil.rmtree(aside, ignore_errors=True)
            bad.rename(aside)
            log.warning("moved the damaged %s aside to %s (delete it once inspected)", bad.name, aside.name)
        if damaged:
            log.warning("falling back to the newest intact checkpoint: %s", folder)
        return folder, result
    if damaged:
        raise NoIntactCheckpoint(f"no intact checkpoint in {root}: " + "; ".join(str(e) for _, e in damaged)
                                 + " (pass --overwrite to start the run over)")
    return None
