"""The fused decode step: one token per row through the model's own blocks, as the Triton kernels of `fused_ops` run it.
(Or several per row: speculative decoding's verify step, `queries_per_row`.)

`Transformer.decode_step(fused=True)` is `decode_step(model, ...)` here; the plain step is the model's forward over
the same caches (`Transformer.decode_step(fused=False)`), which every test of this one compares against. It reads
the model's modules (their weights, norms, projection groups) and writes nothing in them:
* the residual add is deferred into the next norm's kernel (`fused_add_rmsnorm`), which also computes the next
  projection group's LoRA x·Aᵀ where that group defers its update;
* LoRA's B product is left to the kernel that reads a projection's output next (`DeferredLoRA`: RoPE + KV write,
  SiLU·up, add + RMSNorm), so it costs no launch of its own;
* q/k/v and gate/up run as one GEMM each where the model fused them (`qerl.execution.fusion`: `GROUP_ATTR`);
* attention is `qerl.execution.attention.attend_cached`'s split-KV kernel over the caller's caches.
Where a kernel's rounding is not the family's (Gemma's (1 + w) norms, GeGLU) the step runs those ops in plain
PyTorch. Everything it launches depends only on shapes, so a CUDA graph of it replays correctly.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qerl.execution import attention
from qerl.execution.low_rank import GROUP_ATTR, DeferredLoRA, deferred, finished, fused_forward, is_lora
from qerl.quant.fp8 import frozen_linear


def supported(model: nn.Module) -> bool:
    """Whether `decode_step` can run on `model` here: the Triton kernels run on its device (CUDA, or the CPU
    interpreter) and the RoPE kernel's block, head_dim / 2, is a power of two."""
    from qerl.execution import fused_ops  # lazy: Triton costs ~0.3 s to import, and only decoding needs it

    half = model.config.head_dim // 2
    return model.config.head_dim % 2 == 0 and half & (half - 1) == 0 \
        and fused_ops.kernels_run_on(model.model.embed_tokens.weight.device)


@torch.no_grad()  # the fused LoRA path adds in place into a (possibly custom-Function) base output
def decode_step(model: nn.Module, tokens: Tensor, positions: Tensor, slot: Tensor, attend: Tensor,
                kv_caches: Sequence[tuple[Tensor, Tensor]], queries_per_row: int = 1) -> Tensor:
    """Logits [rows, vocab] of `model` (a `qerl.model.transformer.Transformer`) for one token per row; arguments as
    `Transformer.decode_step`. ~1 ulp from its forward in bf16.

    `queries_per_row` Q > 1: N = rows * Q query rows, query row r * Q + t being token t of cache row r (speculative
    decoding verifies a row's drafted tokens in one forward): tokens [N], positions [N, 1], slot [N] (each query
    row's own slot; [1] or [N] at Q = 1), attend [N, window] (the caller's per-query mask, causality within the row
    included: query t of a row at slot p sees slots <= p + t); logits [N, vocab]. Norms, GEMMs and LoRA are
    row-wise and run on the N rows as they are; only the two kernels that touch the caches map a query row to its
    cache row. The same numbers as Q one-token steps, each at its own slot, up to the GEMMs' rounding."""
    if queries_per_row < 1 or tokens.shape[0] % queries_per_row or attend.shape[0] != tokens.shape[0]:
        raise ValueError(f"decode_step: {tokens.shape[0]} tokens and attend {tuple(attend.shape)} need one row per "
                         f"query row, a multiple of queries_per_row={queries_per_row}")
    decoder = model.model
    x = decoder.embed(tokens)
    tables = decoder.rope_tables(positions)  # [N, 1, D] fp32
    inputs = {}
    for kind, allowed in decoder.step_masks(attend, slot).items():
        mask = attention.additive_mask(allowed, x.dtype)  # the kernel's, built once per step instead of per layer
        cos, sin = tables[kind]
        inputs[kind] = (cos[:, 0], sin[:, 0], mask)
    stream = DeferredResidual(x)
    for layer, (k_cache, v_cache) in zip(decoder.layers, kv_caches):
        cos, sin, mask = inputs[layer.sliding]
        _block(layer, stream, cos, sin, mask, k_cache, v_cache, slot, queries_per_row)
    return model.softcap(project(model.lm_head, stream.normed(decoder.norm)[0]))


class DeferredResidual:
    """The residual stream of the fused step (`qerl.model.transformer.Residual`'s protocol): x, and the last
    sub-block's output not yet added to it (possibly a `DeferredLoRA`). The next norm's kernel adds it
    (`add_norm`), and computes the next sub-block's LoRA x·Aᵀ where that block's group defers its update."""

    def __init__(self, x: Tensor):
        self.x, self.residual = x, None

    def normed(self, norm: nn.Module, into: nn.Module | None = None) -> tuple[Tensor, Tensor | None]:
        # only Llama's norms are the kernel's (Gemma's unit-offset norms would spend a GEMM on it: the group does)
        shrink = _lora_a(into, self.x.dtype) if into is not None and not norm.unit_offset else None
        self.x, h, h_lora = add_norm(norm, self.x, self.residual, shrink)
        self.residual = None
        return h, h_lora

    def add(self, out: Tensor | DeferredLoRA, norm: nn.Module | None = None) -> None:
        self.residual = out if norm is None else norm(finished(out))


def _block(layer: nn.Module, stream: DeferredResidual, cos: Tensor, sin: Tensor, mask: Tensor, k_cache: Tensor,
           v_cache: Tensor, slot: Tensor, queries_per_row: int) -> None:
    """The model's own block (`DecoderLayer.block`) for one token per query row (`queries_per_row` of them per
    cache row), its attention and MLP as the kernels run them."""
    layer.block(stream, lambda h, h_lora: _attention(layer.self_attn, h, cos, sin, mask, k_cache, v_cache, slot,
                                                     h_lora, queries_per_row),
                lambda h, h_lora: _mlp(layer.mlp, h, h_lora))


def add_norm(norm: nn.Module, x: Tensor, residual: Tensor | DeferredLoRA | None,
             shrink: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """(x + residual, norm(x + residual), h) for [rows, dim], h = norm(x + residual)·Aᵀ for the next projection's
    LoRA A `shrink` [R, dim] (None: h is None). One kernel (`fused_ops.fused_add_rmsnorm`) that adds into x in
    place and finishes a deferred residual's LoRA update, for Llama's rounding; a unit-offset norm the plain ops."""
    if not norm.unit_offset:
        from qerl.execution import fused_ops

        low_rank = residual if isinstance(residual, DeferredLoRA) else None  # the kernel finishes its update
        out = fused_ops.fused_add_rmsnorm(x, low_rank.out if low_rank is not None else residual, norm.weight,
                                          norm.eps, low_rank, shrink)
        return out if shrink is not None else (*out, None)
    residual = finished(residual)
    x = x if residual is None else x + residual
    y = norm(x)
    return x, y, None if shrink is None else F.linear(y, shrink)


def project(linear: nn.Module, x: Tensor) -> Tensor:
    """linear(x); a LoRA layer's through `low_rank.fused_forward` (base(x) then one addmm of the low-rank update
    into it, instead of GEMM + scale + add)."""
    return fused_forward(linear, x) if is_lora(linear) else frozen_linear(linear, x)


def _project_deferred(linear: nn.Module, x: Tensor) -> Tensor | DeferredLoRA:
    """`project`, leaving LoRA's B product to the kernel that reads the output next where the layer can
    (`low_rank.deferred`); the caller hands a `DeferredLoRA` to such a kernel or finishes it."""
    left = deferred(linear, x) if is_lora(linear) else None
    return project(linear, x) if left is None else left


def _lora_a(block: nn.Module, dtype: torch.dtype) -> Tensor | None:
    """The block's q/k/v or gate/up group's stacked LoRA A, where the step defers the group's update (attention; the
    MLP with SwiGLU, whose kernel adds it)."""
    group = block.__dict__.get(GROUP_ATTR)
    if group is None or getattr(block, "act", F.silu) is not F.silu:
        return None
    return group.decode_lora_a(dtype)


def _deferred(block: nn.Module, x: Tensor, h_lora: Tensor | None,
              projections) -> tuple[list[Tensor], DeferredLoRA | None]:
    """The block's group outputs with its LoRA update left to the next kernel (their base part), and that update;
    `projections(x, fused=True)` (the block's own `project_qkv` or `gate_up`) and None where there is no update to
    leave. h_lora: x·Aᵀ, if the norm's kernel computed it."""
    group = block.__dict__.get(GROUP_ATTR)
    parts = group.decode_deferred(x, h_lora) if group is not None else None
    return parts if parts is not None else (list(projections(x, fused=True)), None)


def _attention(attn: nn.Module, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, k_cache: Tensor, v_cache: Tensor,
               slot: Tensor, h_lora: Tensor | None = None, queries_per_row: int = 1) -> Tensor | DeferredLoRA:
    """`Attention` for h [N, hidden] (normed) of N query rows, cos/sin [N, head_dim]: query row i writes its k, v
    into cache row i // queries_per_row at `slot` ([1]: every row's; [N]: its own) and attends over that row's
    first mask.shape[-1] slots (mask [N, window], additive). Returns the o_proj output [N, hidden], its LoRA
    update possibly left to the next norm's kernel."""
    from qerl.execution import fused_ops

    rows, heads, kv_heads, dim = h.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
    (q, k, v), low_rank = _deferred(attn, h, h_lora, attn.project_qkv)
    norms = (attn.q_norm, attn.k_norm) if attn.qk_norm else (None, None)
    if attn.qk_norm and attn.q_norm.unit_offset:  # the kernel norms as Llama rounds: Gemma's q/k norm here
        if low_rank is not None:  # q, k, v are views of its output: finished in place
            low_rank.finish()
        low_rank = None
        q = attn.q_norm(q.view(rows, heads, dim)).view(rows, heads * dim)
        k = attn.k_norm(k.view(rows, kv_heads, dim)).view(rows, kv_heads * dim)
        norms = (None, None)
    q = fused_ops.fused_rope_cache(q, k, v, cos, sin, slot, k_cache, v_cache, heads, kv_heads, dim, *norms,
                                   low_rank=low_rank, queries_per_row=queries_per_row)
    cache_rows = rows // queries_per_row  # q and mask as views [cache rows, heads, Q, dim], [cache rows, 1, Q, window]
    out = attention.attend_cached(q.view(cache_rows, queries_per_row, heads, dim).transpose(1, 2), k_cache, v_cache,
                                  mask.view(cache_rows, 1, queries_per_row, -1), attn.scale, split_kv=True)
    return _project_deferred(attn.o_proj, out.view(rows, heads * dim))


def _mlp(mlp: nn.Module, h: Tensor, h_lora: Tensor | None = None) -> Tensor | DeferredLoRA:
    """`MLP` for [rows, hidden]: SiLU(gate) * up in one kernel that also adds the gate/up group's LoRA update, and
    down's LoRA update left to the next norm's kernel (GeGLU: the plain ops, no kernel)."""
    if mlp.act is F.silu:
        from qerl.execution import fused_ops

        (gate, up), low_rank = _deferred(mlp, h, h_lora, mlp.gate_up)
        return _project_deferred(mlp.down_proj, fused_ops.fused_silu_mul(gate, up, low_rank))
    gate, up = mlp.gate_up(h, fused=True)
    return project(mlp.down_proj, mlp.act(gate) * up)
