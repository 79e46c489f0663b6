"""The training process's memory: what a step's peak was, what the update may keep, and how freed memory goes back.

`StepPeaks` measures each step's peak over its phases (the rollouts with their KV cache mapped, then scoring and the
update), `held_weights_budget` says how many bytes of dequantized base weights the update may keep, and
`return_large_frees_to_the_os` sets how the C library hands large frees back on the CPU.
"""
from __future__ import annotations

import ctypes
import platform
import resource
import sys

import torch

from qerl.execution import ExecutionPlan
from qerl.model import recompute
from qerl.rollout import releasable


def peak_memory_gb(device: torch.device) -> float:
    """The peak since the last `reset_peak_memory`: on CUDA, PyTorch's allocations plus the rollout engine's KV
    cache where it lives outside PyTorch's allocator, less what a sleeping vLLM has given back under tensors
    PyTorch still counts (each mapped, or released, for the whole phase measured, or not at all); on the CPU the
    process's peak resident set."""
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated(device) + releasable.mapped_bytes(device)
                - releasable.released_bytes(device)) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class StepPeaks:
    """A step's peak memory (GiB) over its phases. Each rollout's peak is taken while its KV cache is mapped
    (`rollout_done`, before the cache sleeps); `step_peak` adds the peak since then (scoring and the update) and
    starts the next step."""

    def __init__(self, device: torch.device):
        self.device = device
        self._rollouts: list[float] = []

    def start_phase(self) -> None:
        reset_peak_memory(self.device)

    def rollout_done(self) -> None:
        self._rollouts.append(peak_memory_gb(self.device))

    def step_peak(self) -> float:
        peak = max([*self._rollouts, peak_memory_gb(self.device)])
        self._rollouts.clear()
        return peak


def held_weights_budget(plan: ExecutionPlan, memory: recompute.MemoryPlan) -> int:
    """Bytes of dequantized base weights the update may keep (the execution plan's keep_dequantized, from
    model.keep_dequantized). auto spends the memory plan's spare memory on speed, except where the run asked for
    memory first (every block recomputed): there it holds nothing, so that run's peak stays the lowest qerl has."""
    if plan.keep_dequantized is True:
        return 2**62
    if plan.keep_dequantized is False or plan.gradient_checkpointing is True:
        return 0
    return memory.spare_bytes


def return_large_frees_to_the_os() -> None:
    """Have glibc serve every allocation of 1 MiB or more from its own mmap, unmapped again when freed.

    By default glibc raises that threshold (up to 32 MiB) each time a large block is freed, so a training step's
    activations (MiBs per layer on the CPU) soon come from the heap, which keeps their pages after the step and
    fragments within it: the embedded default's update peaked at 4.3-4.5 GiB resident with a 4 MiB or a 64 MiB
    threshold (a `malloc_trim` at the step's end included) for 2.7 GiB of live tensors. A fixed threshold also
    turns the adjustment off. The value trades memory for the kernel's page zeroing (BENCHMARKS.md "Beside TRL on
    the CPU", the embedded default's step, prompts shared in the update): 1 MiB ~28 CPU-s an update at 2.9 GiB
    peak, 4 MiB ~24 s at 4.4 GiB, 64 MiB ~22 s at 4.5 GiB. No-op where the C library is not glibc.
    """
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return
    m_mmap_threshold = -3  # from glibc's malloc.h
    ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 1 << 20)
