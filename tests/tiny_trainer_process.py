"""A real training process on the tests' tiny model (seconds, no download), for tests that race or kill trainers.

    python -m tests.tiny_trainer_process OUT [--resume] [--hold-until FILE] [--stall-at-checkpoint STEP --marker FILE]

--hold-until: after training, keep the run folder (and its lock) until FILE exists, as a longer run would.
--stall-at-checkpoint: in the middle of writing that step's checkpoint (adapter and state written, manifest not yet),
touch --marker and stall, so the test can `kill -9` the process there.
Errors end in one line, as in the `qerl` command (exit 2 for bad input).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--hold-until", default=None)
    parser.add_argument("--stall-at-checkpoint", type=int, default=None)
    parser.add_argument("--marker", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    import qerl.trainer
    from qerl.errors import report
    from tests.test_trainer import make_trainer, tiny_settings

    if args.stall_at_checkpoint is not None:
        write_manifest = qerl.trainer.write_manifest

        def stalling(folder: Path):
            if Path(folder).name.startswith(f".tmp-step-{args.stall_at_checkpoint:06d}-"):
                Path(args.marker).write_text("writing")
                time.sleep(600)
            return write_manifest(folder)

        qerl.trainer.write_manifest = stalling
    try:
        with make_trainer(tiny_settings(None), args.out, resume=args.resume) as trainer:
            trainer.train()
            while args.hold_until and not Path(args.hold_until).exists():
                time.sleep(0.05)
    except Exception as exc:  # noqa: BLE001 - reported as the CLI reports it
        return report("tiny-trainer", exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
