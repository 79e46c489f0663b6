"""How one model's frozen GEMMs run: its settings and the phase its trainer is in, in one object the model owns.

A `GemmContext` is made from a model's execution plan (`qerl.execution`) and handed to each of its frozen layers:
the NVFP4 GEMMs (kernels/gemm.py), the FP8 base's (kernels/fp8_gemm.py) and the FP8 update of bf16 linears
(`qerl.quant.fp8`) read it on every call, so two models in one process never share a mode. It holds
* the settings: LoRA's update in the Gluon GEMM's epilogue (`lora_epilogue`), how the dispatch picks backends
  (`dispatcher`: measured, defaults only, or compile-only), our Triton GEMM's config autotuning (`autotune`),
  programmatic dependent launch (`pdl`);
* the phase: `update_precision(p)` (the update's GEMMs in bf16 or FP8; None outside it) and `held_weights(budget)`
  (dequantized copies kept through the update);
* the scratch buffer its layers dequantize into: at most one layer's bf16 (or FP8) weight exists at a time (each use
  is consumed by cuBLAS on the same stream before the next layer's dequantize overwrites it).
Importing it needs no Triton: CPU runs make one too (it then holds nothing but the phase).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch

from . import dispatch

PRECISIONS = ("bf16", "fp8")


class _Held:
    """The dequantized weight copies kept through one `held_weights` block, within a byte budget."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self.copies: dict[tuple[int, tuple], tuple[object, torch.Tensor]] = {}


class GemmContext:
    """One model's GEMM settings and phase (module docstring)."""

    def __init__(self, *, lora_epilogue: bool = False, tuning: str = "measure", cache: str | Path | None = None,
                 autotune: bool = False, pdl: bool = True, fp8_activations: bool = True):
        """`lora_epilogue`: add LoRA's update in the Gluon GEMM's epilogue instead of one addmm after it (measured
        slower: BENCHMARKS.md, "Rollouts: the Gluon default and LoRA in the epilogue"). `tuning` and `cache`: the
        dispatch's (`qerl.kernels.dispatch.Dispatcher`). `autotune`: time our Triton GEMM's candidate configs the first
        time each shape is seen instead of the tuned table. `pdl`: launch with programmatic dependent launch where
        the GPU has it (kernels/pdl.py). `fp8_activations`: outside the update a forward may round its activations
        to E4M3 (W8A8) where that measures faster; False keeps them in 16 bits there. A model's context takes it from
        its execution plan (quant.fp8_activations, default false); True here only for kernels used on their own."""
        self.lora_epilogue, self.autotune, self.pdl = lora_epilogue, autotune, pdl
        self.fp8_activations = fp8_activations
        self.dispatcher = dispatch.Dispatcher(tuning, cache)
        self.precision: str | None = None  # inside `update_precision(p)`: p; None outside the update
        self._held: _Held | None = None
        self._scratch: dict[tuple, torch.Tensor] = {}
        # Scratch buffers a larger one replaced, kept alive: a CUDA graph captured while one was current reads and
        # writes it at its address on every replay. Freed, its memory went to other tensors (the update's, the
        # optimizer's) and the next rollout's replays overwrote them and read garbage (suspected from the H200's
        # non-finite logits on the second NVFP4 step of ragged runs; tests/rollout/test_engine.py checks it on CUDA).
        # Growth is monotone, so the kept buffers total less than the current one.
        self._replaced: list[torch.Tensor] = []

    @contextlib.contextmanager
    def update_precision(self, precision: str):
        """Within the block, the frozen base's forward and dx GEMMs at training sizes run as `precision`: "bf16"
        (dequantize + cuBLAS bf16) or "fp8" (W in FP8 E4M3 with one scale per output row, activations and gradients
        scaled per row, `torch._scaled_mm`). Outside it (rollouts, evaluation) a layer with a resident FP8 copy may
        also run its forward in FP8, where that measures faster; inside it, the update's precision alone decides."""
        if precision not in PRECISIONS:
            raise ValueError(f"unknown update precision {precision!r}: expected bf16 or fp8")
        before, self.precision = self.precision, precision
        try:
            yield
        finally:
            self.precision = before

    @contextlib.contextmanager
    def held_weights(self, budget_bytes: int):
        """Within the block, frozen weights' dequantized (bf16 or FP8) copies are kept after their first use, as long
        as their bytes fit `budget_bytes`; later GEMMs of the same layer read the kept copy. Freed on exit. The
        weights must not change inside the block (the trainer's update: the base is frozen). Yields a function
        giving the bytes held so far."""
        before, self._held = self._held, _Held(max(0, int(budget_bytes)))
        held = self._held
        try:
            yield lambda: held.used
        finally:
            self._held = before
            held.copies.clear()

    @property
    def holding(self) -> bool:
        """Whether a `held_weights` block is open."""
        return self._held is not None

    def scratch(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of >= numel elements, shared by the model's layers (grown, never shrunk; sized before graph
        capture by the eager warm-up that precedes it)."""
        key = (str(device), dtype)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            old = self._scratch.pop(key, None)
            if old is not None and old.is_cuda:
                self._replaced.append(old)
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._scratch[key] = buf
        return buf[:numel]

    def release_scratch(self) -> None:
        """Drop the scratch buffers: only when no captured graph that used them will be replayed again."""
        self._scratch.clear()
        self._replaced.clear()

    def weight_copy(self, owner: object, key: tuple, numel: int, dtype: torch.dtype, device: torch.device,
                    write: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`owner`'s weight in the form `key` names: `write(flat)` fills a flat buffer of `numel` elements and returns
        the view the GEMM reads. The buffer is the scratch, or inside `held_weights` a kept copy of its own (made
        once, while the budget lasts)."""
        held = self._held
        if held is None:
            return write(self.scratch(numel, dtype, device))
        entry = held.copies.get((id(owner), key))
        if entry is not None:
            return entry[1]
        nbytes = numel * dtype.itemsize
        if held.used + nbytes > held.budget:
            return write(self.scratch(numel, dtype, device))
        view = write(torch.empty(numel, dtype=dtype, device=device))
        held.copies[(id(owner), key)] = (owner, view)  # the owner kept alive with it: its id is not reused meanwhile
        held.used += nbytes
        return view
