"""How command-line entry points (`qerl`, `python -m qerl.flows.*`) end on an error: one line on stderr, never a
traceback unless asked for (`--debug` or QERL_DEBUG=1), like DVC's `ERROR: ...` and its `-v`.

Exit codes: 2 for what the user can fix (parameters, data files, paths, a run folder in use or holding another run,
damaged checkpoints, a full disk), 1 for anything else (a bug, out of memory), 130 for Ctrl-C; a training stopped by
a signal after its checkpoint (`Stopped`) exits 128 + the signal's number (143 for SIGTERM), as a shell reports a
process that signal ended, so a scheduler sees a preempted job, not a finished or a failed one.
"""

from __future__ import annotations

import errno
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from qerl.debug import DEBUG

BAD_INPUT_EXIT = 2
FAILURE_EXIT = 1


class BadInput(Exception):
    """Base of qerl's own errors that the user can cause or fix (exit 2), where no built-in type says so: a folder in
    use (`qerl.run.lock.FolderLocked`). Defined here so that this module imports no part of qerl above it."""


class MissingExtra(ImportError):
    """A setting needs an optional dependency that is not installed; the message says which extra to install."""


class BrokenExtra(BadInput):
    """An optional dependency is installed but fails to import (a build for another torch, CUDA or Python): the
    message names the package and what its import raised."""


class Stopped(KeyboardInterrupt):
    """A command stopped on a signal (SIGTERM: a preempted job, a scheduler's cancel; SIGINT: Ctrl-C) once its state
    was saved. A KeyboardInterrupt, so that whatever lets Ctrl-C through (no `except Exception` swallows it; Prefect
    marks the flow run crashed) lets this through too. `resume_command` is filled in by the entry point, which knows
    its own arguments; the message then says how to continue."""

    def __init__(self, what: str, signum: int):
        super().__init__(what)
        self.what, self.signum = what, signum
        self.resume_command: str | None = None

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return self.what + (f"; resume with: {self.resume_command}" if self.resume_command else "")


class DiskFull(RuntimeError):
    """The disk filled while writing: 'No space left on device: <path>', the path being what was written."""


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC, however the writing library reports it (safetensors wraps it in its own error, as text)."""
    return (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "No space left on device" in str(exc) \
        or "os error 28" in str(exc)


@contextmanager
def naming_a_full_disk(path: str | os.PathLike, hint: str = "") -> Iterator[None]:
    """Within the block, a full disk becomes `DiskFull` naming `path` (what the user knows: a checkpoint, the
    metrics), not the temp file a library was writing nor the library's own words. Nested, the outermost names it:
    a checkpoint, not the adapter inside it."""
    try:
        yield
    except Exception as e:
        if is_disk_full(e):
            raise DiskFull(f"No space left on device: {Path(path)}{f' ({hint})' if hint else ''}") from e
        raise


# ValueError covers ConfigError, the checkpoint and data errors, JSON and UTF-8 decode errors.
# ConnectionError: a hub dataset neither cached nor reachable (qerl.data.tables says how to fetch it).
BAD_INPUT = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError,
             ConnectionError, BadInput, MissingExtra, BrokenExtra, DiskFull)


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (library messages often span several), never empty."""
    text = " ".join(str(exc).split())
    if isinstance(exc, KeyError) and len(exc.args) == 1:
        text = f"missing key {exc.args[0]!r}"
    if len(text) > 2000:
        text = text[:2000] + " ..."
    return text or type(exc).__name__


def report(prog: str, exc: BaseException, debug: bool = False) -> int:
    """Print `exc` for the user and return the exit code; with `debug`, the traceback comes first."""
    if isinstance(exc, Stopped):  # asked for, not an error: its line says where the state is and how to resume
        print(f"{prog}: {exc}", file=sys.stderr)
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    if debug:
        traceback.print_exception(exc)
    if is_disk_full(exc) and not isinstance(exc, DiskFull):  # a write no caller named: the file, where known
        where = getattr(exc, "filename", None)
        exc = DiskFull(f"No space left on device: {where}" if where else "No space left on device")
    if isinstance(exc, BAD_INPUT):
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return BAD_INPUT_EXIT
    hint = "" if debug else f" (unexpected; rerun with --debug or {DEBUG}=1 for the traceback)"
    print(f"{prog}: error: {type(exc).__name__}: {one_line(exc)}{hint}", file=sys.stderr)
    return FAILURE_EXIT
