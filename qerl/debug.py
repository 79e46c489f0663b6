"""The environment variables qerl reads, for debugging and measurement only: one place, read when asked.

A run's behaviour is its params file; these only turn a kernel off for an A/B measurement, or move a cache where a
test or a benchmark wants it, without touching that file. Each is read here and nowhere else; `qerl.execution` folds
them into the model's execution plan, which is what the kernels receive.

QERL_PDL=0           launch the decode kernels without programmatic dependent launch (kernels/pdl.py).
QERL_VOCAB_KERNEL=0  compute the update's LM-head log-probs in PyTorch, not in kernels/vocab_softmax.py.
QERL_GEMM_CACHE      the GEMM dispatch's cache file (default ~/.cache/qerl/gemm_dispatch.json; kernels/dispatch.py).
QERL_CACHE           where converted models live (the embedded SmolLM2, GGUF conversions; default ~/.cache/qerl).
"""
from __future__ import annotations

import os

VARIABLES = ("QERL_PDL", "QERL_VOCAB_KERNEL", "QERL_GEMM_CACHE", "QERL_CACHE")


def pdl() -> bool:
    """Whether the decode kernels may launch with programmatic dependent launch (QERL_PDL not 0)."""
    return os.environ.get("QERL_PDL", "1") != "0"


def vocab_kernel() -> bool:
    """Whether the update's LM head may run kernels/vocab_softmax.py (QERL_VOCAB_KERNEL not 0)."""
    return os.environ.get("QERL_VOCAB_KERNEL", "1") != "0"


def gemm_cache() -> str | None:
    """QERL_GEMM_CACHE: where the GEMM dispatch keeps its measurements (None: its default)."""
    return os.environ.get("QERL_GEMM_CACHE") or None


def cache_dir() -> str | None:
    """QERL_CACHE: where converted models live (None: ~/.cache/qerl)."""
    return os.environ.get("QERL_CACHE") or None
