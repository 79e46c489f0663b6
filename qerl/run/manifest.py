"""A folder's manifest: the size and SHA-256 of every file in it, written last, so a reader can tell an intact folder
from one that was truncated, zeroed or overwritten after the fact (disk trouble, a careless `cp`, a full disk).

The writer builds the folder in a temp location and renames it into place after `write_manifest`; a folder without
a manifest was therefore either written before manifests existed or never finished.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"
_FORMAT = 1


class ManifestMismatch(ValueError):
    """A file does not match the manifest (or the manifest itself is unreadable); `file` names it."""

    def __init__(self, file: Path, reason: str):
        super().__init__(f"{file}: {reason}")
        self.file = file
        self.reason = reason


def sha256(path: Path) -> str:
    """A file's SHA-256 (hex), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: str | Path) -> Path:
    """Record every file under `folder` (fsynced first, so the manifest never describes bytes still in flight)."""
    folder = Path(folder)
    files = {}
    for path in _files(folder):
        with path.open("rb") as f:
            os.fsync(f.fileno())
        files[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": sha256(path)}
    target = folder / MANIFEST
    with target.open("w") as f:
        json.dump({"format": _FORMAT, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    return target


def has_manifest(folder: str | Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def verify_manifest(folder: str | Path) -> None:
    """Raise `ManifestMismatch` naming the first file that is missing, of another size or another hash."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    try:
        files = json.loads(manifest.read_text())["files"]
        entries = [(folder / name, int(e["size"]), str(e["sha256"])) for name, e in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ManifestMismatch(manifest, f"unreadable manifest ({type(e).__name__})") from None
    for path, size, digest in entries:
        if not path.is_file():
            raise ManifestMismatch(path, "missing (listed in the manifest)")
        actual = path.stat().st_size
        if actual != size:
            raise ManifestMismatch(path, f"{actual} bytes, the manifest says {size}")
        if sha256(path) != digest:
            raise ManifestMismatch(path, "content differs from the manifest (SHA-256 mismatch)")
