"""A real training process on the tests' tiny model (seconds, no download), for tests that race or kill trainers.

    python -m tests.tiny_trainer_process OUT [--resume] [--max-steps N] [-S SECTION.KEY=VALUE ...]
        [--hold-until FILE] [--stall-at-checkpoint STEP | --stall-at-export | --fill-disk-at-checkpoint STEP FILE]
        [--marker FILE]

--hold-until: after training, keep the run folder (and its lock) until FILE exists, as a longer run would.
--stall-at-checkpoint: in the middle of writing that step's checkpoint (adapter and state written, manifest not yet),
touch --marker and stall, so the test can `kill -9` the process there. --stall-at-export: the same in the middle of
the final adapter export (its weights written into the temp folder, not yet renamed).
--fill-disk-at-checkpoint: just before writing that step's checkpoint, fill the filesystem by writing FILE until no
space is left (as another process might), so the write runs out of space.
Errors end in one line, as in the `qerl` command (exit 2 for bad input).

`main(argv)` also runs in the test's own process (tests/test_stopped_runs.py `finish_here`), for the runs that need no
process of their own: a resume or a stop reads everything from the run folder, and a second interpreter's start-up
(torch, the grader's worker) cost more than the tiny run.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--hold-until", default=None)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("-S", dest="overrides", action="append", default=[])
    parser.add_argument("--stall-at-checkpoint", type=int, default=None)
    parser.add_argument("--stall-at-export", action="store_true")
    parser.add_argument("--fill-disk-at-checkpoint", nargs=2, default=None, metavar=("STEP", "FILE"))
    parser.add_argument("--marker", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    import yaml

    import qerl.model.lora
    import qerl.rl.trainer
    import qerl.run.folder
    from qerl.errors import report
    from tests.test_trainer import make_trainer, tiny_settings

    if args.stall_at_checkpoint is not None:
        write_manifest = qerl.run.folder.write_manifest

        def stalling(folder: Path):
            if Path(folder).name.startswith(f".tmp-step-{args.stall_at_checkpoint:06d}-"):
                Path(args.marker).write_text("writing")
                time.sleep(600)
            return write_manifest(folder)

        qerl.run.folder.write_manifest = stalling
    if args.stall_at_export:
        save_file = qerl.model.lora.save_file

        def stalling_export(tensors, path, **kwargs):
            save_file(tensors, path, **kwargs)
            folder = Path(path).parent  # the run's final adapter, not a checkpoint's
            if folder.name.startswith(".adapter.tmp-") and folder.parent.resolve() == Path(args.out).resolve():
                Path(args.marker).write_text("exporting")
                time.sleep(600)

        qerl.model.lora.save_file = stalling_export
    if args.fill_disk_at_checkpoint:
        fill_step, filler = int(args.fill_disk_at_checkpoint[0]), Path(args.fill_disk_at_checkpoint[1])
        save_checkpoint = qerl.rl.trainer.Trainer.save_checkpoint

        def filling(self, *a, **kw):
            if self.step == fill_step:
                fill(filler)
            return save_checkpoint(self, *a, **kw)

        qerl.rl.trainer.Trainer.save_checkpoint = filling
    sections: dict = {}
    for item in args.overrides:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        sections.setdefault(section, {})[name] = yaml.safe_load(value)
    try:
        with make_trainer(tiny_settings(None, **sections), args.out, resume=args.resume) as trainer:
            trainer.train(max_steps=args.max_steps)
            while args.hold_until and not Path(args.hold_until).exists():
                time.sleep(0.05)
    except Exception as exc:  # noqa: BLE001 - reported as the CLI reports it
        return report("tiny-trainer", exc)
    return 0


def fill(path: Path) -> None:
    """Write `path` until its filesystem has no space left (unbuffered: every byte that fits lands)."""
    with path.open("wb", buffering=0) as f:
        for size in (1 << 16, 1):  # big blocks, then the last partial one byte by byte
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main())
