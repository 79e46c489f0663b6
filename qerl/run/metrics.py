"""A run's metrics log, `metrics.jsonl`: one JSON record per step, appended as the step ends, read back whole.

A kill or a full disk can cut the last line short; reading drops it with a warning naming the file. A resumed run
rewrites the steps after its checkpoint (`truncate_after`), atomically.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from qerl.errors import naming_a_full_disk
from qerl.run import atomic

log = logging.getLogger(__name__)

_JSON_TYPES = {list: "array", int: "number", float: "number", str: "string", bool: "boolean", type(None): "null"}


class MetricsLog:
    """Appends one JSON object per line and flushes, so a killed run keeps every finished step."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        with naming_a_full_disk(self.path), self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict[str, Any]]:
        """The records; a last line cut short (a write killed, or out of disk space) is dropped with a warning."""
        if not self.path.exists():
            return []
        lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        records = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                if number == len(lines):
                    log.warning("%s: dropped its last line, cut short by a write that was killed or ran out of disk "
                                "space (%r)", self.path, line[:60])
                    break
                raise ValueError(f"{self.path}:{number}: not a JSON record ({e})") from None
            # Whole JSON that is no step's record (`[1, 2]`, `3`, a step that is no number) was written by someone
            # else: not a torn write, so it is named rather than dropped.
            step = record.get("step") if isinstance(record, dict) else None
            if not isinstance(step, int) or isinstance(step, bool):
                what = f"a JSON {_JSON_TYPES.get(type(record), type(record).__name__)}" if not isinstance(
                    record, dict) else f"an object whose step is {step!r}"
                raise ValueError(f"{self.path}:{number}: not a metrics record ({what}; each line is an object with "
                                 "an integer \"step\"): restore the file, or delete the line") from None
            records.append(record)
        return records

    def truncate_after(self, step: int) -> None:
        """Drop records past `step` (a resumed run rewrites the steps after its checkpoint)."""
        text = "".join(json.dumps(r) + "\n" for r in self.read() if r["step"] <= step)
        if text == (self.path.read_text(encoding="utf-8", errors="replace") if self.path.exists() else ""):
            return  # nothing to drop: a fresh start writes no empty file (nor needs any space)
        with naming_a_full_disk(self.path):
            atomic.write_text(self.path, text)
