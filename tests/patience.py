"""How long a test waits for a subprocess, a server or a worker before calling it hung.

These are guards against hangs, not speed checks, and the suite must pass on 2 cores that other work shares: at load
average 10, a Triton-interpreter subprocess that takes a minute on idle cores ran past its 300 s limit. Every wait
is the idle figure times QERL_TEST_PATIENCE (default 5).
"""

from __future__ import annotations

import os

SCALE = float(os.environ.get("QERL_TEST_PATIENCE", "5"))


def patience(idle_seconds: float) -> float:
    """The time to wait for something that takes well under `idle_seconds` on idle cores."""
    return idle_seconds * SCALE
