"""LoRA's update left to the next kernel of the fused decode step (`qerl.execution.decode`): `DeferredLoRA`; and
where a block keeps the projection group whose update it defers (`GROUP_ATTR`).

A LoRA projection's (or a fused q/k/v, gate/up group's) output whose B product the kernel that reads it next adds
before its own rounding, as one addmm would: RoPE + KV write, SiLU·up, add + RMSNorm (`qerl.execution.fused_ops`).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

# Where a block module (Attention, MLP) keeps its fused q/k/v or gate/up (`qerl.model.fusion.ProjectionGroup`): a
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
