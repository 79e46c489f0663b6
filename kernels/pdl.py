"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's kernels.

A decode step is ~14 small kernels per layer, each waiting for the one before it to finish and drain before its own
programs start. Launched with PDL, a kernel's programs may start while the previous kernel is still running: each
calls `griddepcontrol.wait` (Triton's `gdc_wait`) before it reads anything the previous kernel wrote, and
`griddepcontrol.launch_dependents` once it is running, so the next kernel is scheduled early. What a kernel does
before its wait overlaps the previous kernel's tail: the NVFP4 GEMM streams its first weight stages then (weights
do not depend on the previous kernel). CUDA graphs keep these edges, so the captured decode step gains too.

The contract, for every kernel launched with `launch(device)`'s options: it takes `PDL: tl.constexpr`, and with
PDL true it waits before its first read of another kernel's output and before its first write (a buffer the
previous kernel may still read, the shared split-K counters). Waiting is transitive: a kernel that has waited knows
every kernel before the previous one has finished too.

A caller may turn it off (`allowed=False`: the model's execution plan, `pdl`; the kernels then launch as before;
`PDL` false compiles the calls out, which the interpreter needs).
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401  Triton >= 3.4
    except Exception:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(device: torch.device, allowed: bool = True) -> bool:
    """Whether kernels on `device` launch with PDL: `allowed`, a CUDA GPU of compute capability >= 9 and a Triton
    with `gdc_wait`."""
    if device.type != "cuda" or not allowed:
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch(device: torch.device, allowed: bool = True) -> dict:
    """The keyword arguments a PDL-aware kernel's launch takes: its `PDL` constexpr and Triton's `launch_pdl`."""
    return {"PDL": True, "launch_pdl": True} if enabled(device, allowed) else {"PDL": False}
