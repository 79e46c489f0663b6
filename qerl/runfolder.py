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

log = logging.getLogger(__name__)

TRACES = ("metrics.jsonl", "adapter", "checkpoints")  # what marks a folder as holding a run
OUTPUTS = TRACES + ("params.yaml", "reward_curve.png", "training_curves.png")  # what a run writes (and --overwrite removes)


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
