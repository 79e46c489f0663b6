"""How LoRA's update meets the base GEMM's output, fast: one GEMM epilogue in training (`add_low_rank`), one addmm in
the decode step (`fused_forward`), or left to the kernel that reads the output next (`deferred`, `DeferredLoRA`:
RoPE + KV write, SiLU·up, add + RMSNorm). Applied to a `qerl.model.lora.LoraLinear` (read, never imported: any
module with `base`, `lora_A`, `lora_B`, `scaling`, `enabled`), and to the projection groups of `fusion`.

A LoRA projection's (or a fused q/k/v, gate/up group's) output whose B product the kernel that reads it next adds
before its own rounding, as one addmm would: RoPE + KV write, SiLU·up, add + RMSNorm (`qerl.execution.fused_ops`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

# Where a block module (Attention, MLP) keeps its fused q/k/v or gate/up (`qerl.execution.fusion.ProjectionGroup`): a
# plain attribute, so the group is not a submodule (module names, state dict and adapters stay as loaded).
GROUP_ATTR = "projection_group"


@dataclass
class DeferredLoRA:
    """A projection's output in the fused decode step with LoRA's update not added yet: `out` [rows, N] is the base
    GEMM's output, the update is scale · h·bᵀ (h = x·Aᵀ [rows, R], b [N, R] with unit stride along R). The kernel
    that reads `out` next adds the update before its own rounding, as one addmm would (`qerl.execution.fused_ops`:
    RoPE + KV write, SiLU·up, add + RMSNorm), so LoRA's B product costs no launch of its own. `blocks`: per member
    of a fused output (q/k/v, gate/up; one for a single projection), its first row of b, its first column of h and
    b, and its rank."""
    out: Tensor
    h: Tensor
    b: Tensor
    scale: float
    blocks: tuple[tuple[int, int, int], ...]

    def finish(self) -> Tensor:
        """`out` with the update added in place (one addmm): for a reader that has no kernel adding it."""
        return self.out.addmm_(self.h, self.b.t(), alpha=self.scale)


def finished(out: Tensor | DeferredLoRA | None) -> Tensor | None:
    """The tensor itself, or a deferred output finished."""
    return out.finish() if isinstance(out, DeferredLoRA) else out


# Where `add_low_rank` adds LoRA's update in the GEMM's epilogue (tests add "cpu" to check its numbers there).
ONE_GEMM_DEVICES = {"cuda"}


def add_low_rank(out: Tensor, h: Tensor, b: Tensor, scaling: float) -> Tensor:
    """out + scaling * h @ bᵀ (LoRA's update added to the base output; h = x @ Aᵀ).

    On CUDA one GEMM whose epilogue adds `out` (cuBLAS' beta = 1): in training the separate product, scale, cast and
    add are four passes over [tokens, out_features] each way, more memory traffic than the rank-16 GEMM itself.
    Elsewhere (and for mixed dtypes) the separate ops, whose roundings the CPU runs have always had."""
    if out.device.type in ONE_GEMM_DEVICES and h.dtype == out.dtype == b.dtype:
        flat = torch.addmm(out.reshape(-1, out.shape[-1]), h.reshape(-1, h.shape[-1]), b.t(), alpha=scaling)
        return flat.view(out.shape)
    return out + (nn.functional.linear(h, b) * scaling).to(out.dtype)


def is_lora(module: nn.Module) -> bool:
    """Whether `module` is a LoRA layer (a frozen `base` plus `lora_A`, `lora_B`)."""
    return hasattr(module, "lora_A") and hasattr(module, "base")


def fused_forward(layer: nn.Module, x: Tensor) -> Tensor:
    """Inference only (the fused decode step, under no_grad; no dropout): a LoRA layer's base(x) + s * (x @ A^T) @ B^T
    with the second product accumulated into the base output by one addmm (one launch instead of GEMM + scale +
    add). A and B are read live, so a captured graph follows optimizer steps. Where the addmm cannot apply (adapter
    off, adapter dtype != activation dtype, not 2-D) it is the layer's forward."""
    if not layer.enabled or layer.lora_B.dtype != x.dtype or x.dim() != 2:
        return layer(x)
    h = nn.functional.linear(x, layer.lora_A)
    plus_low_rank = getattr(layer.base, "plus_low_rank", None)  # a quantized base adds it inside its GEMM
    if plus_low_rank is not None:
        return plus_low_rank(x, h, layer.lora_B, layer.scaling)
    return layer.base(x).addmm_(h, layer.lora_B.t(), alpha=layer.scaling)


def deferred(layer: nn.Module, x: Tensor) -> DeferredLoRA | None:
    """`fused_forward(layer, x)` with h = x·Aᵀ in one launch (`fused_ops.lora_shrink`) and the B product left to the
    kernel that reads the output next; None where fused_forward would not take its addmm path."""
    if not layer.enabled or layer.lora_B.dtype != x.dtype or layer.lora_A.dtype != x.dtype or x.dim() != 2 \
            or not layer.lora_A.is_contiguous() or layer.lora_B.stride(-1) != 1:
        return None
    from qerl.execution import fused_ops  # lazy: Triton's import costs ~0.3 s, and only decoding needs it

    x = x if x.stride(-1) == 1 else x.contiguous()
    return DeferredLoRA(layer.base(x), fused_ops.lora_shrink(x, layer.lora_A), layer.lora_B, layer.scaling,
                        ((0, 0, layer.rank),))
