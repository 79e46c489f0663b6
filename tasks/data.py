"""`find_newest_data`: the freshest training file a retrain should learn from."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE


@task(name="find-newest-data", cache_policy=NO_CACHE)
def find_newest_data(folder: str, pattern: str = "*.jsonl") -> str | None:
    """The most recently modified file matching `pattern` in `folder` (None if there is none)."""
    files = [p for p in Path(folder).glob(pattern) if p.is_file()] if Path(folder).is_dir() else []
    return str(max(files, key=lambda p: p.stat().st_mtime_ns)) if files else None
