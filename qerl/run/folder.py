"""What a training run may do with its folder: start fresh, continue (`--resume`) or replace (`--overwrite`) a previous
run, and never replace one silently.

As in TRL (`overwrite_output_dir`) and DVC (`--force`), replacing work is an explicit choice. A folder holds a previous
run when any of its outputs is there: metrics, the adapter, checkpoints (even damaged ones; a finished run whose
checkpoints were deleted to save space still counts).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from qerl.run import atomic

log = logging.getLogger(__name__)

TRACES = ("metrics.jsonl", "adapter", "checkpoints")  # what marks a folder as holding a run
OUTPUTS = TRACES + ("params.yaml", "reward_curve.png", "training_curves.png")  # what a run writes (and --overwrite removes)


# What a checkpoint's adapter and optimizer state belong to: resuming it under other values would be another run.
FIXED_ON_RESUME = ("model.path", "quant.scheme", "lora.rank", "lora.alpha", "lora.target_modules", "lora.use_rslora",
                   "lora.train_norms")


def remove_killed_writes(folder: Path) -> None:
    """Delete the temp files and folders that killed writes of the run's outputs left (the final adapter export, the
    metrics rewrite, ...). Call only while holding the run's lock. Checkpoints sweep their own (`checkpoints`)."""
    for name in OUTPUTS:
        atomic.remove_killed_writes(folder / name)


def traces(folder: Path) -> list[str]:
    """The previous run's outputs present in `folder` (empty files and folders do not count)."""
    found = []
    for name in TRACES:
        path = folder / name
        if (path.is_file() and path.stat().st_size > 0) or (path.is_dir() and any(path.iterdir())):
            found.append(name + ("/" if path.is_dir() else ""))
    return found


def check_start(folder: Path, resume: bool, overwrite: bool, has_checkpoint: bool) -> None:
    """Refuse to start where it would lose a previous run's outputs; with `overwrite`, remove them first."""
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other: continue the run, or replace it")
    found = traces(folder)
    if not found:
        if resume:
            log.info("nothing to resume in %s: starting at step 0", folder)
        return
    listed = ", ".join(found)
    if resume and not has_checkpoint:
        if found == ["metrics.jsonl"]:  # killed before its first checkpoint: starting over is exactly resuming
            log.warning("no checkpoint in %s yet (the run stopped before its first): resuming from step 0; "
                        "metrics.jsonl's rows are rewritten from step 1", folder)
            return
        raise FileExistsError(f"nothing to resume in {folder}: it holds {listed} but no checkpoint; pass --overwrite "
                              "to start the run over (its outputs are deleted), or choose another --out")
    if not resume and not overwrite:
        raise FileExistsError(f"{folder} already holds a run ({listed}): pass --resume to continue it, --overwrite "
                              "to replace it (its outputs are deleted), or choose another --out")
    if overwrite:
        for name in OUTPUTS:
            path = folder / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        log.warning("--overwrite: deleted the previous run's outputs in %s (%s)", folder, listed)


def check_resumed_settings(checkpoint: Path, saved: dict[str, Any] | None, current: dict[str, Any]) -> None:
    """Name in one line the settings that differ from those the checkpoint was trained with: the run continues with
    the new values (a longer `train.steps`, a lower learning rate), except for `FIXED_ON_RESUME`, which are refused.
    Keys the checkpoint does not know (settings added to qerl since) are not differences."""
    old, new = _flat(saved or {}), _flat(current)
    changed = [key for key in new if key in old and old[key] != new[key]]
    if not changed:
        return
    listed = ", ".join(f"{key} {old[key]!r} -> {new[key]!r}" for key in changed)
    fixed = [key for key in changed if key in FIXED_ON_RESUME]
    if fixed:
        raise ValueError(f"--resume: {checkpoint} was trained with other {', '.join(fixed)} ({listed}); its adapter "
                         "and optimizer state belong to those: resume with the run's own params.yaml, or pass "
                         "--overwrite to start over")
    log.warning("--resume: settings changed since %s (%s): the run continues with the new values", checkpoint, listed)


def _flat(settings: dict[str, Any]) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, values in settings.items() if isinstance(values, dict)
            for key, value in values.items()}
