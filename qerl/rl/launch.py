"""`qerl` over N processes from Python: `torchrun --nproc-per-node N -m qerl.cli ...` as a child process, its output
handed over line by line (an orchestrator's log shows the run as it goes), a failure raised with the ranks' last lines.
"""

from __future__ import annotations

import collections
import re
import shlex
import subprocess
import sys
import tempfile
from typing import Callable

LAST_LINES = 20  # of the ranks' output, in the error: enough for a rank's traceback, short enough for a log line
# With --tee, torchrun prefixes each line a rank writes with its role and local rank: "[default0]:...". What follows
# a failure unprefixed is torchrun's own report (its traceback and a summary), which would push the ranks' error out.
RANK_LINE = re.compile(r"^\[default\d+\]:")


class LaunchFailed(RuntimeError):
    """The torchrun job exited non-zero; the message ends with the ranks' last lines of output."""


def torchrun_command(nproc: int, qerl_args: list[str], log_dir: str) -> list[str]:
    """The command line of `qerl <qerl_args>` over `nproc` processes on this machine, through this interpreter's
    `torch.distributed.run` (what `torchrun` runs), so the job uses this environment's packages. `--standalone` picks
    a free rendezvous port (two jobs on one machine do not collide on the default one); `--tee 3` marks each rank's
    lines, and torchrun keeps copies of them in `log_dir`."""
    if nproc < 1:
        raise ValueError(f"nproc={nproc}: must be >= 1")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--tee", "3", "--log-dir", log_dir, "-m", "qerl.cli", *qerl_args]


def run_qerl(nproc: int, qerl_args: list[str], on_line: Callable[[str], None]) -> None:
    """Run `qerl <qerl_args>` over `nproc` processes (stderr merged into stdout), pass each output line to `on_line`;
    raise `LaunchFailed` naming the command, its exit status and the ranks' last lines if it exits non-zero."""
    with tempfile.TemporaryDirectory(prefix="qerl-torchrun-") as log_dir:
        command = torchrun_command(nproc, qerl_args, log_dir)
        on_line(f"starting {shlex.join(command)}")
        everything: collections.deque[str] = collections.deque(maxlen=LAST_LINES)
        ranks: collections.deque[str] = collections.deque(maxlen=LAST_LINES)
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                              bufsize=1) as proc:
            for line in proc.stdout:
                line = line.rstrip("\n")
                everything.append(line)
                if RANK_LINE.match(line):
                    ranks.append(line)
                on_line(line)
    if proc.returncode != 0:
        tail = "\n".join(ranks or everything)  # torchrun's own lines when no rank got to write any (bad arguments)
        raise LaunchFailed(f"{shlex.join(command)} exited with status {proc.returncode}; its last lines:\n{tail}")
