"""A training run's folder as one object, `RunFolder`: what a run may do with it and how its state is kept there.

It holds the folder's lock for the run's whole life (`qerl.run.lock`), sweeps up what killed writes left, and applies
the start rules: start fresh, continue (`--resume`) or replace (`--overwrite`) a previous run, never replace one
silently. As in TRL (`overwrite_output_dir`) and DVC (`--force`), replacing work is an explicit choice. A folder holds
a previous run when any of its outputs is there: metrics, the adapter, checkpoints (even damaged ones; a finished run
whose checkpoints were deleted to save space still counts).

The trainer asks it for the state to resume (`checkpoint_to_resume`: the newest intact checkpoint, verified against
its manifest, its settings compared with the run's, the metrics log cut back to its step) and hands it states to
save (`save_checkpoint`: written into a temp folder, manifest last, renamed into place). What a state holds is the
trainer's business; here it is a tree of tensors and plain values (`qerl.run.safestate`: nothing executable) plus
whatever files the trainer writes beside it (the adapter).

Layout: `params.yaml`, `metrics.jsonl` (`qerl.run.metrics`), `checkpoints/step-NNNNNN/` (`qerl.run.checkpoints`),
`adapter/` and the curves (written by the trainer's export), `.qerl.lock` while a run holds the folder.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qerl.errors import BadInput, naming_a_full_disk
from qerl.run import atomic, checkpoints, safestate
from qerl.run.lock import FolderLock, FolderLocked, run_folder_lock
from qerl.run.manifest import write_manifest
from qerl.run.metrics import MetricsLog

log = logging.getLogger(__name__)

METRICS, PARAMS, CHECKPOINTS = "metrics.jsonl", "params.yaml", "checkpoints"
TRACES = (METRICS, "adapter", CHECKPOINTS)  # what marks a folder as holding a run
OUTPUTS = TRACES + (PARAMS, "reward_curve.png", "training_curves.png")  # what a run writes (and --overwrite removes)
STATE_FILE = "trainer_state.json"  # a checkpoint's state: its structure and plain values (qerl.run.safestate)
STATE_TENSORS = "trainer_state.safetensors"  # its tensors

# What a checkpoint's adapter and optimizer state belong to: resuming it under other values would be another run.
FIXED_ON_RESUME = ("model.path", "quant.scheme", "quant.layer_schemes", "quant.error_correction_rank", "lora.rank",
                   "lora.alpha", "lora.target_modules", "lora.use_rslora", "lora.train_norms")


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint read back: its folder (with the files the trainer wrote into it) and its state."""

    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])


class RunFolder:
    """`with RunFolder(out, resume=..., overwrite=...) as run:` ... `run.save_checkpoint(state, write_files)`.

    Opening it takes the folder's lock (a second run on it fails at once, naming the holder), removes what killed
    writes left and applies the start rules; `close()` (or the end of the `with` block, or of the process) lets go.
    Under torchrun only the main rank (`main=True`) owns the folder: the others read the checkpoint it resolved and
    write nothing.
    """

    def __init__(self, path: str | Path, resume: bool = False, overwrite: bool = False, main: bool = True):
        self.path = Path(path)
        self.resume, self.main = resume, main
        # Locked before anything looks at the folder, so two racing runs cannot both find it free.
        self.lock: FolderLock | None = run_folder_lock(self.path).acquire() if main else None
        try:
            if main:  # we hold the lock: no live writer owns what killed writes left
                checkpoints.remove_killed_writes(self.path / CHECKPOINTS)
                remove_killed_writes(self.path)
                check_start(self.path, resume, overwrite, has_checkpoint=bool(checkpoints.finished(
                    self.path / CHECKPOINTS)))
            self.metrics = MetricsLog(self.path / METRICS)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the folder (idempotent)."""
        if self.lock is not None:
            self.lock.release()

    def __enter__(self) -> "RunFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def checkpoint_to_resume(self, settings: dict[str, Any], required: Iterable[str] = (),
                             check: Callable[[Checkpoint], None] | None = None) -> Checkpoint | None:
        """With `resume`, the newest intact checkpoint (damaged newer ones are named and moved aside) whose state holds
        `required` and passes `check` (which raises `CheckpointCorrupt` naming the file for a state the trainer
        cannot continue from, before any of it is applied); else, or if the run has none, None. A checkpoint trained
        with other `FIXED_ON_RESUME` settings (`settings`: a `to_dict()`) is refused, never set aside: the run's
        settings are wrong, not the checkpoint. The main rank also names the other settings that differ from the
        checkpoint's and cuts the metrics log back to the checkpoint's step (to nothing for a fresh start). Other
        ranks call it after the main one has (a barrier between)."""
        def read(path: Path) -> dict[str, Any]:
            state = read_checkpoint(path, required)
            check_resumed_settings(path, state.get("settings"), settings, name_changes=False)
            check_steps_left(path, state["step"], settings)
            if check is not None:
                check(Checkpoint(path, state))
            return state

        found = checkpoints.newest_intact(self.path / CHECKPOINTS, read) if self.resume else None
        resumed = Checkpoint(*found) if found is not None else None
        if self.main:
            if resumed is not None:
                check_resumed_settings(resumed.path, resumed.state.get("settings"), settings)
            self.metrics.truncate_after(resumed.step if resumed is not None else 0)
        if resumed is not None:
            log.info("resuming from %s (step %d)", resumed.path, resumed.step)
        return resumed

    def save_checkpoint(self, state: dict[str, Any], write_files: Callable[[Path], Any] | None = None,
                        keep: int = 2) -> Path:
        """`state` (its `step` names the checkpoint) and what `write_files(folder)` writes beside it (the adapter),
        written to a temp folder with a manifest (sizes and hashes, written last) and renamed into place (atomic).
        The `keep` newest are kept, so a damaged newest one has a predecessor to fall back to."""
        root = self.path / CHECKPOINTS
        step = int(state["step"])
        final = self.checkpoint_path(step)
        tmp = checkpoints.temp_folder(root, step, os.getpid())
        try:
            with naming_a_full_disk(final, "the older checkpoints are intact: free space, then --resume"):
                root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                if write_files is not None:
                    write_files(tmp)
                safestate.save(state, tmp / STATE_FILE, tmp / STATE_TENSORS)
                write_manifest(tmp)
                atomic.replace_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # the space it took, at once (a kill leaves it to the next start)
            raise
        for old in [p for p in checkpoints.finished(root) if p != final][:-max(keep - 1, 0) or None]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s", final)
        return final

    def checkpoint_path(self, step: int) -> Path:
        """Where the checkpoint of `step` is (or would be)."""
        return self.path / CHECKPOINTS / f"{checkpoints.PREFIX}{step:06d}"

    def write_params(self, text: str) -> None:
        """The run's resolved parameters, `params.yaml` (main rank only)."""
        if self.main:
            with naming_a_full_disk(self.path / PARAMS):
                atomic.write_text(self.path / PARAMS, text)


def read_checkpoint(path: Path, required: Iterable[str] = ()) -> dict[str, Any]:
    """A checkpoint's state, every safetensors file beside it checked readable; raises `CheckpointCorrupt` naming the
    file. Nothing is applied yet, so a damaged checkpoint leaves the trainer untouched. Nothing in the files is
    executed: JSON and safetensors (`qerl.run.safestate`), or an older qerl's pickle read by
    `checkpoints.read_pickled_state`, which refuses anything but tensors, numbers and arrays."""
    from safetensors import safe_open

    file = path / STATE_FILE
    try:
        if not file.exists() and (path / checkpoints.PICKLED_STATE).exists():
            file = path / checkpoints.PICKLED_STATE
            state = checkpoints.read_pickled_state(file)
        else:
            state = safestate.load(file, path / STATE_TENSORS)
        if not isinstance(state, dict):
            raise TypeError(f"holds a {type(state).__name__}, not a trainer state")
        missing = ({"step"} | set(required)) - set(state)
        if missing:
            raise KeyError(f"lacks {', '.join(sorted(missing))}")
        step, saved = state["step"], state.get("settings", {})
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise checkpoints.CheckpointCorrupt(f"{file}: step = {step!r}: not a step number")
        if not isinstance(saved, dict) or not all(isinstance(v, dict) for v in saved.values()):
            raise checkpoints.CheckpointCorrupt(f"{file}: settings: not the run's settings (sections of keys)")
        # Its step is what it resumes from and which folder the next save of that step replaces: one that is not
        # its folder's, or past the steps of the run that wrote it, is no state qerl saved.
        if step != checkpoints.step_of(path):
            raise checkpoints.CheckpointCorrupt(f"{file}: step = {step}, but its folder is {path.name} (a "
                                                "checkpoint is named by its step)")
        own_steps = saved.get("train", {}).get("steps")
        if isinstance(own_steps, int) and step > own_steps:
            raise checkpoints.CheckpointCorrupt(f"{file}: step = {step}, past its run's train.steps = {own_steps}")
        for file in sorted(p for p in path.rglob("*.safetensors") if p != path / STATE_TENSORS):
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    f.get_tensor(key)
    except checkpoints.CheckpointCorrupt:  # already names the file (an older pickle refused)
        raise
    except safestate.StateFormatError as e:
        raise checkpoints.CheckpointCorrupt(f"{e.file}: unreadable ({e.reason})") from None
    except Exception as e:  # noqa: BLE001 - safetensors and torch each raise their own types
        reason = str(e).strip().splitlines()[0] if str(e).strip() else "empty or truncated"
        raise checkpoints.CheckpointCorrupt(f"{file}: unreadable ({type(e).__name__}: {reason})") from None
    return state


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


class LinkedOutput(BadInput):
    """One of a run folder's outputs is a symbolic link; the message names it."""


def refuse_run_folder(out: Path, name: str = "--out") -> None:
    """For a command that is not a training run (`qerl eval`): `out` must not be a run's folder, nor lie inside a
    folder a live run holds, where its files would land among the run's (and a `--overwrite` of it, or the run's
    end, would decide their fate). One line naming it, exit 2; a finished run's sub-folder (`runs/x/eval`) is fine."""
    for folder in (out.absolute(), *out.absolute().parents):
        holder = run_folder_lock(folder).holder()
        if holder is not None:
            inside = "inside " if folder != out.absolute() else ""
            raise FolderLocked(f"{name} {out} is {inside}run folder {folder}, in use by "
                               f"{holder}: wait for the run to finish, or choose another {name}")
    found = traces(out) if out.is_dir() else []
    if found:
        raise FileExistsError(f"{name} {out} holds a training run ({', '.join(found)}): write the evaluation "
                              f"elsewhere, e.g. {name} {out / 'eval'}")


def check_start(folder: Path, resume: bool, overwrite: bool, has_checkpoint: bool) -> None:
    """Refuse to start where it would lose a previous run's outputs; with `overwrite`, remove them first. Everything
    is checked before anything is deleted."""
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other: continue the run, or replace it")
    # A link would have the run write (and --overwrite delete) outside its folder, or fail half-way through a
    # deletion (rmtree refuses links) after the metrics were gone: a run folder's outputs are its own.
    for name in OUTPUTS:
        path = folder / name
        if path.is_symlink():
            raise LinkedOutput(f"{path} is a symbolic link (to {os.readlink(path)}): a run folder's outputs must be "
                               "its own, so qerl neither writes nor deletes through it; replace it with the files "
                               "themselves, or choose another --out (nothing was changed)")
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


def check_resumed_settings(checkpoint: Path, saved: dict[str, Any] | None, current: dict[str, Any],
                           name_changes: bool = True) -> None:
    """Name in one line the settings that differ from those the checkpoint was trained with: the run continues with
    the new values (a longer `train.steps`, a lower learning rate), except for `FIXED_ON_RESUME`, which are refused.
    Keys the checkpoint does not know (settings added to qerl since) are not differences. `name_changes=False`:
    only refuse."""
    old, new = _flat(saved or {}), _flat(current)
    changed = [key for key in new if key in old and _ordered(old[key]) != _ordered(new[key])]
    if not changed:
        return
    listed = ", ".join(f"{key} {old[key]!r} -> {new[key]!r}" for key in changed)
    fixed = [key for key in changed if key in FIXED_ON_RESUME]
    if fixed:
        raise ValueError(f"--resume: {checkpoint} was trained with other {', '.join(fixed)} ({listed}); its adapter "
                         "and optimizer state belong to those: resume with the run's own params.yaml, or pass "
                         "--overwrite to start over")
    if name_changes:
        log.warning("--resume: settings changed since %s (%s): the run continues with the new values", checkpoint,
                    listed)


def check_steps_left(checkpoint: Path, step: int, current: dict[str, Any]) -> None:
    """A checkpoint past the run's `train.steps` (lowered since) is refused, never set aside: resumed, it would train
    nothing and export its later adapter as the final one of a shorter run. The settings are wrong, not the
    checkpoint."""
    steps = current.get("train", {}).get("steps")
    if isinstance(steps, int) and step > steps:
        raise ValueError(f"--resume: {checkpoint} is at step {step}, past train.steps = {steps}: set train.steps to "
                         f"{step} or more to continue the run, or pass --overwrite to start over")


def _ordered(value: Any) -> Any:
    """A mapping as its ordered items (dicts compare equal in any order, and a setting's order can mean something:
    quant.layer_schemes' first matching glob wins; train.rewards is summed in its order)."""
    return list(value.items()) if isinstance(value, dict) else value


def _flat(settings: dict[str, Any]) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, values in settings.items() if isinstance(values, dict)
            for key, value in values.items()}
