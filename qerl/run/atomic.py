"""Atomic writes: a file or folder appears under its name whole, or not at all.

Everything is written into a hidden sibling of the destination (same filesystem, so the last step is a rename, which
POSIX makes atomic) and renamed into place. A crash before the rename leaves the old content untouched and no partial
file under the destination's name; the temp sibling is removed on any exception.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger(__name__)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` atomically (an existing file is replaced only once the new one is complete)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # per process: two writers never share a temp file
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    """`write_bytes` of `text` as UTF-8."""
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> Path:
    """`write_text` of `obj` as JSON, with a final newline."""
    return write_text(path, json.dumps(obj, indent=indent) + "\n")


def replace_dir(finished: Path, path: str | os.PathLike) -> Path:
    """Rename the complete folder `finished` to `path`; an existing `path` is moved aside first, then removed.

    Moving the old folder aside (rather than deleting it first) means `path` is never a partial folder: it is the
    old one, the new one, or for an instant absent; if the second rename fails the old one is put back.
    """
    path = Path(path)
    if not path.exists():
        os.replace(finished, path)
        return path
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
    try:
        os.replace(path, aside / "old")
        try:
            os.replace(finished, path)
        except BaseException:
            os.replace(aside / "old", path)
            raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)
    return path


@contextmanager
def atomic_dir(path: str | os.PathLike, *, temp_prefix: str | None = None,
               keep_existing: bool = False) -> Iterator[Path]:
    """Yield an empty temp folder beside `path`; when the block finishes it becomes `path`, on an exception it vanishes.

    `temp_prefix` names the temp folder (default `.<name>.tmp-`), for a caller that sweeps up the remains of killed
    writes. An existing `path` is replaced, unless `keep_existing`: then a folder another process finished first is
    kept and ours is dropped (both hold the same thing).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix or f".{path.name}.tmp-", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would make the result private to this user
    try:
        yield tmp
        if not keep_existing:
            replace_dir(tmp, path)
        else:
            try:
                os.rename(tmp, path)  # onto an empty folder or nothing; a non-empty one refuses
            except OSError:
                if not path.is_dir() or not any(path.iterdir()):
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_killed_writes(path: str | os.PathLike) -> list[Path]:
    """Delete what killed writes of `path` left beside it: temp files and folders (`.<name>.tmp-*`, written by this
    module and by callers' `temp_prefix`) and old folders moved aside by `replace_dir` (`.<name>.old-*`).

    Call only while holding the lock that makes you `path`'s one writer: then no live process owns them."""
    path = Path(path)
    stale = sorted(p for pattern in (f".{path.name}.tmp-*", f".{path.name}.old-*") for p in path.parent.glob(pattern))
    for p in stale:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        log.info("removed %s (left by a write that was killed)", p)
    return stale
