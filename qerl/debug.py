"""Every environment variable qerl reads, with what each does (`VARIABLES`), and the one way to read them (`variable`).

A run's behaviour belongs in its params file (every key documented in qerl/config.py), where it is recorded,
overridden with -S and compared between runs; the environment is for debugging only. The other variables read here
are not switches of qerl's: where something lies on this machine, or what a launcher or another tool tells its
processes (torchrun, MLflow, Prefect, CUDA). No module of qerl reads os.environ but this one, qerl.config and
qerl.cli (tests/test_architecture.py, which also checks that every variable read is listed here). `qerl.execution`
folds the A/B switches and the GEMM cache into the model's execution plan, which is what the kernels receive.
Passing the environment on to a child process is no read. Imports nothing of qerl.
"""

from __future__ import annotations

import os

DEBUG = "QERL_DEBUG"

VARIABLES = {
    # Debugging
    DEBUG: "1: a command that fails prints the traceback as well as its one line, as --debug does (`qerl`, "
           "`python -m qerl.flows.*`)",
    # Where things lie on this machine
    "QERL_CACHE": "the folder of converted models (the embedded SmolLM2, GGUF conversions); default ~/.cache/qerl",
    "TRITON_CACHE_DIR": "Triton's kernel cache, which holds the precompile stamps (read only where Triton has no "
                        "`knobs`)",
    "QERL_GEMM_CACHE": "the file of measured GEMM backends per shape and GPU (kernels/dispatch.py); default "
                       "~/.cache/qerl/gemm_dispatch.json",
    # What a launcher or another tool tells its processes
    "WORLD_SIZE": "torchrun: the number of training processes; above 1, `qerl train` joins their process group",
    "LOCAL_RANK": "torchrun: this process's GPU on its machine",
    "CUDA_VISIBLE_DEVICES": "the GPUs the compare flow shares out among its workers (one each); default all",
    "MLFLOW_TRACKING_URI": "MLflow's tracking server where tracking.tracking_uri is unset",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true: the flows print no links to MLflow's UI either",
    "PREFECT_API_URL": "set: the flows run against that Prefect server, and its failure says to unset this",
    # A/B switches for measurements (a run's behaviour is its params file: qerl/config.py, `execution:`)
    "QERL_PDL": "0: the GPU kernels launch without programmatic dependent launch (Hopper and later)",
    "QERL_VOCAB_KERNEL": "0: the update's LM head runs in PyTorch, not kernels/vocab_softmax.py (A/B measurements)",
}


def variable(name: str) -> str | None:
    """The environment's value of a listed variable, None where unset."""
    if name not in VARIABLES:
        raise KeyError(f"{name}: not in qerl.debug.VARIABLES (list it there, with what it does, before reading it)")
    return os.environ.get(name)


def debug_requested(flag: bool = False) -> bool:
    """--debug (`flag`) or QERL_DEBUG set to anything but 0: a failing command shows its traceback."""
    return flag or (variable(DEBUG) or "0") != "0"


def pdl() -> bool:
    """Whether the decode kernels may launch with programmatic dependent launch (QERL_PDL not 0)."""
    return (variable("QERL_PDL") or "1") != "0"


def vocab_kernel() -> bool:
    """Whether the update's LM head may run kernels/vocab_softmax.py (QERL_VOCAB_KERNEL not 0)."""
    return (variable("QERL_VOCAB_KERNEL") or "1") != "0"


def gemm_cache() -> str | None:
    """QERL_GEMM_CACHE: where the GEMM dispatch keeps its measurements (None: its default)."""
    return variable("QERL_GEMM_CACHE") or None


def cache_dir() -> str | None:
    """QERL_CACHE: where converted models live (None: ~/.cache/qerl)."""
    return variable("QERL_CACHE") or None
