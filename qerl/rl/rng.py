"""The process's random number generators as one state: what a checkpoint keeps so a resumed CPU run draws what the
uninterrupted run would have (Python's, NumPy's, torch's CPU generator and every CUDA device's)."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """The generators' states, under the keys a checkpoint's "rng" entry has always had."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def restore_rng(state: dict[str, Any]) -> None:
    """Set the generators to `state` (from `rng_state`); CUDA's only where the state has it and CUDA is here."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
