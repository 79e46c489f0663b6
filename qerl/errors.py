"""How command-line entry points (`qerl`, `python -m flows.*`) end on an error: one line on stderr, never a traceback
unless asked for (`--debug` or QERL_DEBUG=1), like DVC's `ERROR: ...` and its `-v`.

Exit codes: 2 for what the user can fix (parameters, data files, paths, a run folder in use or holding another run,
damaged checkpoints, a full disk), 1 for anything else (a bug, out of memory), 130 for Ctrl-C.
"""

from __future__ import annotations

import errno
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

DEBUG_ENV = "QERL_DEBUG"
BAD_INPUT_EXIT = 2
FAILURE_EXIT = 1


class BadInput(Exception):
    """Base of qerl's own errors that the user can cause or fix (exit 2), where no built-in type says so: a folder in
    use (`qerl.run.lock.FolderLocked`). Defined here so that this module imports nothing of qerl."""


class MissingExtra(ImportError):
    """A setting needs an optional dependency that is not installed; the message says which extra to install."""


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
             ConnectionError, BadInput, MissingExtra, DiskFull)


def debug_requested(flag: bool = False) -> bool:
    return flag or os.environ.get(DEBUG_ENV, "") not in ("", "0")


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
    hint = "" if debug else f" (unexpected; rerun with --debug or {DEBUG_ENV}=1 for the traceback)"
    print(f"{prog}: error: {type(exc).__name__}: {one_line(exc)}{hint}", file=sys.stderr)
    return FAILURE_EXIT
