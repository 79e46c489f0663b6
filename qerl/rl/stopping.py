"""A stop asked for by a signal while the loop trains: SIGTERM (a preempted cloud job, `kill`, a scheduler's cancel) or
SIGINT (Ctrl-C) lets the step in progress finish, then the trainer writes a checkpoint and raises
`qerl.errors.Stopped`, whose one line names the checkpoint and how to resume (exit 143 / 130). A second signal stops
at once, as the signal would have without us; the last checkpoint written stays.

Why finish the step rather than abandon it: the checkpoint after a whole step is the one `--max-steps` writes, and
`--resume` continues from it bit for bit (RNG states, data position, optimizer and AQN state all belong to a step
boundary). Abandoning would have to roll the step's half-drawn samples and, past its optimizer step, its update back
to the step's start, or lose the work since the last periodic checkpoint. A step takes seconds on a GPU (7B: ~12 s),
which fits the usual grace periods (Kubernetes 30 s, spot instances 30 s to 2 min); where it does not (the embedded
default's minute-long CPU step on a loaded machine), the second signal or the SIGKILL that follows ends the process
and the last periodic checkpoint holds, as before.
"""

from __future__ import annotations

import logging
import shlex
import signal
import threading
from types import FrameType

from qerl.errors import Stopped

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """`with StopSignals() as signals:` ... `signals.signum` (None until SIGTERM or SIGINT came).

    Handlers are Python's to install in the main thread only; elsewhere (a flow run on a worker thread) this does
    nothing and the signals act as they did. A signal the process ignores (SIGINT in a shell's background job) stays
    ignored. On leaving, the previous handlers (Python's, Prefect's SIGTERM bridge) are back."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                previous = signal.getsignal(signum)
                if previous is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for signum, previous in self._previous.items():
            # None: a handler not set from Python; the default is what it did
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:  # the second: what the signal does without us (SIGTERM ends the process)
            log.warning("%s again: stopping at once, without finishing the step", name)
            self._restore()
            signal.raise_signal(signum)
            return
        self.signum = signum
        log.warning("%s: finishing the step in progress, then a checkpoint and stop (%s again: stop at once)", name,
                    name)


class TrainingStopped(Stopped):
    """The loop stopped on `signum` after `step`, whose checkpoint is written; `steps_left` of the steps it was asked
    for (all of `train.steps`, or a `--max-steps`) remain."""

    def __init__(self, signum: int, step: int, total: int, checkpoint, steps_left: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step} of {total} (checkpoint "
                         f"{checkpoint})", signum)
        self.steps_left = steps_left

    def resume_with(self, command: list[str], params: str | None, overrides: list[str], out,
                    max_steps: int | None) -> None:
        """Say how to continue: `command` (`qerl train`) with the same params and overrides (others would be named
        as changed on --resume), the run folder, and, where the run was given a --max-steps, what is left of it."""
        argv = [*command, *(["--params", str(params)] if params else [])]
        for override in overrides:
            argv += ["-S", override]
        argv += ["--out", str(out), *(["--max-steps", str(self.steps_left)] if max_steps is not None else []),
                 "--resume"]
        self.resume_command = shlex.join(argv)
