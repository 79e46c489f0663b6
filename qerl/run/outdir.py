"""An output folder named on the command line (`--out`), checked before any work and not left behind empty.

A file in its place, or a place where nothing can be written, used to surface only when the first output was saved:
after a whole evaluation, as a bare "[Errno 17] File exists". Checked up front, it is one line naming the folder.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator


def check_writable(folder: str | os.PathLike, name: str = "--out") -> Path:
    """`folder` is a folder we can write in, or can be created; else a one-line error naming it (`name`: the
    flag or setting it came from). Creates nothing: the probe file goes into the nearest existing folder and is
    removed at once."""
    folder = Path(folder)
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p == Path(p.anchor or "."))
    if not existing.is_dir():
        where = "is a file" if existing == folder else f"cannot be created: {existing} is a file"
        raise NotADirectoryError(f"{name} {folder} {where}, not a folder; choose another {name}")
    try:  # a real write, not os.access: root passes access checks that a read-only file system still refuses
        fd, probe = tempfile.mkstemp(prefix=".qerl-write-probe-", dir=existing)
    except OSError as e:
        what = "cannot be written in" if existing == folder else f"cannot be created in {existing}"
        raise PermissionError(f"{name} {folder} {what} ({e.strerror}); choose another {name}") from None
    os.close(fd)
    os.unlink(probe)
    return folder


@contextlib.contextmanager
def removed_if_empty_on_failure(folder: str | os.PathLike) -> Iterator[Path]:
    """Runs the body; if it fails, removes `folder` and the parents it had to create, as long as they are empty (a
    failed start leaves no empty run folder behind; a folder that was there before, or holds anything, stays)."""
    folder = Path(folder)
    created = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
    try:
        yield folder
    except BaseException:
        for path in created:
            try:
                path.rmdir()
            except FileNotFoundError:  # already removed (the run folder's lock removes a folder it made)
                continue
            except OSError:  # not empty: keep it and everything above it
                break
        raise
