"""Sibling projections of one input as one GEMM: q/k/v and gate/up, as vLLM's qkv_proj and gate_up_proj.

At decode sizes every kernel launch costs a few microseconds whatever it computes, and a block of separate
projections with LoRA launches 2 GEMMs per projection besides its base GEMM. `fuse_projections(model)` makes each
block compute its q/k/v (and its gate/up) as

* one base GEMM on the members' weights concatenated along the output rows, done once: each member then *is* its
  rows of the concatenation (an nn.Linear's weight becomes a row view; a QuantLinear reads its rows of the fused
  QuantLinear and drops its own tensors), so the weights are held once, and NVFP4 members share their global
  scale already (`quantize_model` makes them);
* with LoRA, one x·Aᵀ GEMM for all members (their A factors stacked) and, in the decode step, one `addmm_` of a
  block-diagonal Bᵀ into the fused output: 3 launches for q/k/v instead of 9, 3 for gate/up instead of 6.

Nothing a user sees changes: module names, `state_dict` keys, PEFT adapters and `apply_lora` targets stay Hugging
Face's; a member computed alone (e.g. a hook calls it) gives its rows of the fused output. The decode step's
stacked LoRA factors are copies of the members' (refreshed by `sync(model)`, which the rollout engine calls before
every rollout, so captured graphs read current factors); training reads the members' own parameters.

Moving or reloading a member gives it back a private copy (QuantLinear.own_rows; a moved nn.Linear weight is simply
no longer a view); its group notices and rebuilds the concatenation at its next call.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qerl.execution import low_rank
from qerl.execution.low_rank import GROUP_ATTR, DeferredLoRA, add_low_rank, is_lora
from qerl.quant.fp8 import frozen_linear
from qerl.quant.linear import QuantLinear

__all__ = ["ProjectionGroup", "fuse_projections", "unfuse_projections", "groups", "signature", "sync", "GROUP_ATTR"]


def _base(member: nn.Module) -> nn.Module:
    return member.base if is_lora(member) else member


def _concat_dense(bases: list[nn.Linear]) -> nn.Linear | None:
    """One nn.Linear whose weight rows are the members' weights; each member's weight (and bias) becomes a view."""
    first = bases[0]
    if any(b.weight.requires_grad or b.weight.dtype != first.weight.dtype or b.weight.device != first.weight.device
           or b.in_features != first.in_features or (b.bias is None) != (first.bias is None) for b in bases):
        return None
    fused = nn.Linear(first.in_features, sum(b.out_features for b in bases), bias=first.bias is not None,
                      device="meta")
    fused.gemm_context = getattr(first, "gemm_context", None)  # the FP8 update's phase: the model's context
    fused.weight = nn.Parameter(torch.cat([b.weight.detach() for b in bases]), requires_grad=False)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([b.bias.detach() for b in bases]), requires_grad=False)
    start = 0
    for b in bases:
        rows = slice(start, start + b.out_features)
        b.weight = nn.Parameter(fused.weight[rows], requires_grad=False)
        if b.bias is not None:
            b.bias = nn.Parameter(fused.bias[rows], requires_grad=False)
        start += b.out_features
    return fused


def _concat(bases: list[nn.Module]) -> nn.Module | None:
    if all(type(b) is nn.Linear for b in bases):
        return _concat_dense(bases)
    if all(isinstance(b, QuantLinear) for b in bases):
        return QuantLinear.concat(bases)
    return None  # e.g. bitsandbytes' NF4 layers: computed one by one, as QLoRA users run them


class ProjectionGroup:
    """The projections `names` of `owner` (one input x) computed together; called as `group(x, fused)`."""

    def __init__(self, owner: nn.Module, names: Sequence[str]):
        self.owner, self.names = owner, tuple(names)
        self.fused: nn.Module | None = None
        self.sizes: list[int] = []
        self._lora: tuple[Tensor, Tensor] | None = None  # stacked A [R, K] and block-diagonal B [N, R] (decode)
        self._lora_key: tuple | None = None
        self.build()

    def members(self) -> list[nn.Module]:
        return [getattr(self.owner, n) for n in self.names]

    def _current(self) -> bool:
        """Whether every member still is its rows of `self.fused` (a move or a load makes a member private)."""
        if self.fused is None:
            return False
        start = 0
        for b in map(_base, self.members()):
            if isinstance(self.fused, QuantLinear):
                if not isinstance(b, QuantLinear) or b._rows_of != (self.fused, start):
                    return False
            elif type(b) is not nn.Linear or b.weight.data_ptr() != self.fused.weight[start].data_ptr():
                return False
            start += b.out_features
        return True

    def build(self) -> bool:
        """(Re)concatenate the members' base weights if needed; False if they cannot be one GEMM."""
        if self._current():
            return True
        bases = [_base(m) for m in self.members()]
        self.fused = None  # drop the old concatenation (members that still read it keep it alive until rebuilt)
        self.fused = _concat(bases)
        self.sizes = [b.out_features for b in bases]
        self._lora_key = None
        return self.fused is not None

    # -------------------------------------------------------------------------------------------------- LoRA

    def _active_lora(self, members: list[nn.Module]) -> list[tuple[int, nn.Module]]:
        return [(i, m) for i, m in enumerate(members) if is_lora(m) and m.enabled]

    def stacked_lora(self, force: bool = False) -> tuple[Tensor, Tensor] | None:
        """(A stacked [R, K], block-diagonal B * scaling [N, R]) of the enabled adapters, copied in place into
        buffers kept across calls (a captured graph reads their addresses). Refreshed when a factor's address or
        version changed, or always with `force` (in-place writes through `.data` bump no version)."""
        loras = self._active_lora(self.members())
        if not loras:
            self._lora = self._lora_key = None
            return None
        key = tuple((i, m.lora_A.data_ptr(), m.lora_A._version, m.lora_B.data_ptr(), m.lora_B._version, m.scaling)
                    for i, m in loras)
        if not force and key == self._lora_key:
            return self._lora
        first = loras[0][1].lora_A
        rank, n = sum(m.rank for _, m in loras), sum(self.sizes)
        shape_a, shape_b = (rank, first.shape[1]), (n, rank)
        if self._lora is None or self._lora[0].shape != shape_a or self._lora[0].dtype != first.dtype \
                or self._lora[0].device != first.device:
            self._lora = (torch.empty(shape_a, dtype=first.dtype, device=first.device),
                          torch.zeros(shape_b, dtype=first.dtype, device=first.device))
        a, b = self._lora
        with torch.no_grad():
            b.zero_()
            starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
            r0 = 0
            for i, m in loras:
                a[r0:r0 + m.rank].copy_(m.lora_A)
                b[starts[i]:starts[i] + self.sizes[i], r0:r0 + m.rank].copy_(m.lora_B * m.scaling)
                r0 += m.rank
        self._lora_key = key
        return self._lora

    # -------------------------------------------------------------------------------------------------- forward

    def __call__(self, x: Tensor, fused: bool = False) -> list[Tensor]:
        """The members' outputs [..., N_i] for input x [..., K], as `[member(x) for member in members]`."""
        members = self.members()
        if not self.build():
            return [m(x) for m in members]
        if fused and x.dim() == 2 and not torch.is_grad_enabled():
            return self._decode(x, members)
        out = frozen_linear(self.fused, x)  # in FP8 inside the FP8 update (model.base_gemm) for a bf16 base
        outs = list(out.split(self.sizes, dim=-1))
        loras = self._active_lora(members)
        if not loras:
            return outs
        if any(m.training and isinstance(m.dropout, nn.Dropout) for _, m in loras):  # one dropout mask per member
            for i, m in loras:
                outs[i] = outs[i] + (F.linear(F.linear(m.dropout(x.to(m.lora_A.dtype)), m.lora_A), m.lora_B)
                                     * m.scaling).to(out.dtype)
            return outs
        stacked = torch.cat([m.lora_A for _, m in loras]) if len(loras) > 1 else loras[0][1].lora_A
        h = F.linear(x.to(stacked.dtype), stacked)
        if out.device.type in low_rank.ONE_GEMM_DEVICES and h.dtype == out.dtype:
            # All members' updates in one GEMM into the fused output: Bᵀ block-diagonal over the members (a member
            # without an adapter is a block of no columns). The extra zero blocks cost nothing next to the
            # elementwise passes they replace.
            # One scaling shared by the adapters (one r and alpha, the usual case): it goes into the GEMM's alpha,
            # not into a scaled copy of each B (a multiply forward and one backward per member per call: ~5,000
            # of the 7B update's small launches, and the update is bound by its launch rate).
            active = dict(loras)
            shared = len({m.scaling for _, m in loras}) == 1
            scaling = loras[0][1].scaling if shared else 1.0
            blocks = [(active[i].lora_B if shared else active[i].lora_B * active[i].scaling) if i in active
                      else out.new_zeros(size, 0) for i, size in enumerate(self.sizes)]
            return list(add_low_rank(out, h, torch.block_diag(*blocks), scaling).split(self.sizes, dim=-1))
        for (i, m), hi in zip(loras, h.split([m.rank for _, m in loras], dim=-1)):
            outs[i] = add_low_rank(outs[i], hi, m.lora_B, m.scaling)
        return outs

    def _decode(self, x: Tensor, members: list[nn.Module]) -> list[Tensor]:
        """Inference: LoRA as one x·Aᵀ GEMM, its block-diagonal Bᵀ product added by the base GEMM (in the
        epilogue of our NVFP4 GEMM, else one addmm)."""
        lora = self.stacked_lora()
        if lora is None:
            return list(self.fused(x).split(self.sizes, dim=-1))
        a, b = lora
        if a.dtype != x.dtype:
            return [m(x) for m in members]  # e.g. fp32 adapters on a bf16 model: the plain path's roundings
        h = F.linear(x, a)
        plus_low_rank = getattr(self.fused, "plus_low_rank", None)
        out = plus_low_rank(x, h, b, 1.0) if plus_low_rank is not None else self.fused(x).addmm_(h, b.t())
        return list(out.split(self.sizes, dim=-1))

    def decode_lora_a(self, dtype: torch.dtype) -> Tensor | None:
        """The stacked LoRA A [R, K] that `decode_deferred` multiplies its input by, where it will (adapters on, in
        the activations' dtype): the kernel that norms the input can compute x·Aᵀ too and pass it in."""
        if torch.is_grad_enabled() or not self.build():
            return None
        lora = self.stacked_lora()
        return lora[0] if lora is not None and lora[0].dtype == dtype else None

    def decode_deferred(self, x: Tensor, h: Tensor | None = None) -> tuple[list[Tensor], DeferredLoRA | None] | None:
        """`self(x, fused=True)` with LoRA's B product left to the kernel that reads the outputs next: the members'
        base outputs (column views of one [rows, N] output) and the update (None without adapters); h = x·Aᵀ as
        given (computed by the kernel that made x) or in one launch (`fused_ops.lora_shrink`). None where the group
        is computed another way (members that are not one GEMM, adapters in another dtype than x)."""
        if x.dim() != 2 or torch.is_grad_enabled() or not self.build():
            return None
        lora = self.stacked_lora()
        if lora is None:
            return list(self.fused(x).split(self.sizes, dim=-1)), None
        a, b = lora
        if a.dtype != x.dtype:
            return None
        from qerl.execution import fused_ops  # lazy: Triton's import costs ~0.3 s, and only decoding needs it

        x = x if x.stride(-1) == 1 else x.contiguous()
        active = dict(self._active_lora(self.members()))
        blocks, row, col = [], 0, 0
        for i, size in enumerate(self.sizes):
            rank = active[i].rank if i in active else 0
            blocks.append((row, col, rank))
            row, col = row + size, col + rank
        out = self.fused(x)
        h = fused_ops.lora_shrink(x, a) if h is None else h
        return list(out.split(self.sizes, dim=-1)), DeferredLoRA(out, h, b, 1.0, tuple(blocks))

    def signature(self) -> tuple[int, ...]:
        """What a captured graph of this group reads by address: the fused weight (or the GPU GEMM holding its
        repacked copy) and the stacked LoRA buffers."""
        tensors = [] if self.fused is None else [*self.fused.parameters(), *self.fused.buffers()]
        tensors += [] if self._lora is None else list(self._lora)
        gemm = getattr(self.fused, "_gemm", None)
        return (*(t.data_ptr() for t in tensors), id(gemm) if gemm is not None else 0)


_GROUPS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


def fuse_projections(model: nn.Module) -> int:
    """Give every block of `model` a ProjectionGroup for q/k/v and for gate/up where the members can be one GEMM;
    returns how many groups were made. Idempotent; call before or after `apply_lora`."""
    made = 0
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        names = _GROUPS.get(leaf)
        if names is None or not all(hasattr(module, n) for n in names):
            continue
        group = module.__dict__.get(GROUP_ATTR)
        if group is None:
            group = ProjectionGroup(module, names)
            if group.fused is None:
                continue
            module.__dict__[GROUP_ATTR] = group
        made += 1
    return made


def unfuse_projections(model: nn.Module) -> None:
    """Back to separate projections, each with a private copy of its weight."""
    for module in model.modules():
        group = module.__dict__.pop(GROUP_ATTR, None)
        if group is None:
            continue
        for b in map(_base, group.members()):
            if isinstance(b, QuantLinear):
                b.own_rows()
            elif type(b) is nn.Linear:
                b.weight = nn.Parameter(b.weight.detach().clone(), requires_grad=False)
                if b.bias is not None:
                    b.bias = nn.Parameter(b.bias.detach().clone(), requires_grad=False)


def groups(model: nn.Module) -> list[ProjectionGroup]:
    return [g for m in model.modules() if (g := m.__dict__.get(GROUP_ATTR)) is not None]


def signature(model: nn.Module) -> tuple[int, ...]:
    """The addresses graphs of the decode step read through the groups, as they are (see `sync`)."""
    return tuple(a for group in groups(model) for a in group.signature())


def sync(model: nn.Module) -> tuple[int, ...]:
    """Bring every group up to date with its members (rebuild moved weights, re-copy the LoRA factors) and return
    their `signature`. The rollout engine calls it before each rollout."""
    for group in groups(model):
        if group.build():
            group.stacked_lora(force=True)
    return signature(model)
