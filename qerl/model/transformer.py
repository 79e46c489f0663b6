"""One decoder for the Llama, Qwen2/3, Mistral, Phi-3 and Gemma 3 families, with Hugging Face's module names.

Parameter names match transformers' `*ForCausalLM` of each family exactly, so checkpoints load as a plain state
dict and PEFT adapter keys line up; what each family changes is described once, in `qerl.model.families`. Each module
has one forward, for training (no cache), prefill (a static KV cache) and the plain decode step (the caller's caches):
all compute the same numbers, which the policy-gradient ratio relies on. Each block calls its input projections
through one method (`Attention.project_qkv`, `MLP.gate_up`): after `Transformer.fuse_projections()` (done on CUDA)
those run q/k/v and gate/up as one GEMM each, LoRA included (`qerl.execution.fusion`); Phi-3 stores them stacked.

The block is written once (`DecoderLayer.block`, over a residual stream) and attention itself is
`qerl.execution.attention`'s, so what makes the model fast is applied to them rather than beside them: the blocks'
training ops (`ops`, set by the model's execution plan), the fused decode step (`decode_step(fused=True)`: the same
blocks on a stream that defers its adds into the norm kernels) and the shared-prompt forward of the update (the same
blocks around its attention).
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from qerl import execution
from qerl.execution import attention, decode, fusion, training_ops
from qerl.execution.low_rank import GROUP_ATTR  # a block's fused q/k/v or gate/up (fusion.ProjectionGroup), when made
from qerl.model.architecture import ModelConfig
from qerl.model.masks import positions_and_mask, sliding_mask
from qerl.model.rope import RotaryEmbedding
from qerl.quant.fp8 import frozen_linear

# ---------------------------------------------------------------------------------------------------- blocks


class RMSNorm(nn.Module):
    """RMSNorm in fp32 with a `weight` read on every forward: AQN perturbs these weights in place.

    `unit_offset` (Gemma): the weight is stored as w and scales by (1 + w), in fp32 with one rounding at the end,
    where Llama rounds the normalized x before multiplying by w: the two families round differently."""

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.ops = training_ops.EAGER  # the model's execution plan sets its own (qerl.execution.attach)

    def forward(self, x: Tensor) -> Tensor:
        if self.unit_offset:  # Gemma's rounding: the training kernels (qerl.execution.training_ops) norm as Llama does
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.ops.rms_norm(x, self.weight, self.eps)


class KVCache(nn.Module):
    """Static per-layer key/value cache [B, kv_heads, max_seq_len, head_dim]; slots are written in place."""

    def __init__(self, batch_size: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, cache_position: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k/v [B, Hkv, T, D] at slots `cache_position` ([T], or [B, T]: `write_slots`); return the whole
        cache for rows :B."""
        batch = k.shape[0]
        if batch > self.k_cache.shape[0]:
            raise ValueError(f"batch {batch} exceeds the KV cache batch {self.k_cache.shape[0]}")
        k_cache, v_cache = self.k_cache[:batch], self.v_cache[:batch]
        write_slots(k_cache, cache_position, k)
        write_slots(v_cache, cache_position, v)
        return k_cache, v_cache


def write_slots(cache: Tensor, cache_position: Tensor, x: Tensor, rows: Tensor | None = None) -> None:
    """Write x [B, Hkv, T, D] into cache [>= B, Hkv, S, D] at slots `cache_position`: [T] shared by every row, or
    [B, T] each row at its own (rows that advanced by different numbers of tokens: speculative decoding, tool turns
    prefilled together). `rows` [B]: the cache rows written (default 0..B-1)."""
    if cache_position.dim() == 1 and rows is None:
        cache[:x.shape[0]].index_copy_(2, cache_position, x.to(cache.dtype))
        return
    position = cache_position if cache_position.dim() == 2 else cache_position[None].expand(x.shape[0], -1)
    row = (torch.arange(x.shape[0], device=x.device) if rows is None else rows)[:, None].expand_as(position)
    cache[row, :, position] = x.transpose(1, 2).to(cache.dtype)  # [B, T, Hkv, D]


class StepCache:
    """(k, v) caches a caller owns (the rollout engine's), [>= rows, kv_heads, >= window slots, head_dim], as
    `Attention.forward` takes a cache: `update` writes rows :rows at the given slots and returns their first
    `window` slots."""

    def __init__(self, k_cache: Tensor, v_cache: Tensor, window: int):
        self.k_cache, self.v_cache, self.window = k_cache, v_cache, window

    def update(self, cache_position: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v [rows, Hkv, T, D] written at slots `cache_position`: [T] shared by every row, or [rows, T] (each row
        at its own slots: rows that advanced by different numbers of tokens, as speculative decoding leaves them)."""
        rows = k.shape[0]
        k_cache, v_cache = self.k_cache[:rows], self.v_cache[:rows]
        write_slots(k_cache, cache_position, k)
        write_slots(v_cache, cache_position, v)
        return k_cache[:, :, :self.window], v_cache[:, :, :self.window]


class Attention(nn.Module):
    """Grouped-query attention: its projections, q/k norms and RoPE here, the attention itself in
    `qerl.execution.attention` (the one place every path computes it)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} not a multiple of kv heads {self.num_kv_heads}")
        hidden, q_dim, kv_dim = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if config.family.stacked_projections:  # Phi-3: one qkv_proj in the checkpoint, already one GEMM
            self.qkv_proj = nn.Linear(hidden, q_dim + 2 * kv_dim, bias=config.attention_bias)
            self.qkv_sizes = (q_dim, kv_dim, kv_dim)
        else:
            self.q_proj = nn.Linear(hidden, q_dim, bias=config.attention_bias)
            self.k_proj = nn.Linear(hidden, kv_dim, bias=config.attention_bias)
            self.v_proj = nn.Linear(hidden, kv_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=config.attention_out_bias)
        if config.qk_norm:
            unit_offset = config.family.unit_offset_norms
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset)
        self.qk_norm = config.qk_norm
        # Softmax scale; None = SDPA's own head_dim ** -0.5 (not passed, so Llama/Qwen compute exactly as before).
        self.scale = config.query_pre_attn_scalar ** -0.5 if config.query_pre_attn_scalar else None
        self.kv_cache: KVCache | None = None
        self.ops = training_ops.EAGER  # RoPE's; the model's execution plan sets its own (qerl.execution.attach)

    def project_qkv(self, x: Tensor, fused: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """q [..., heads * head_dim], k and v [..., kv_heads * head_dim] of the normed input x [..., hidden].
        `fused` (the fused decode step, no grad): LoRA layers as one addmm into the base output
        (`qerl.execution.decode.project`), a fused group through its decode path."""
        if (group := self.__dict__.get(GROUP_ATTR)) is not None:
            q, k, v = group(x, fused)
            return q, k, v
        linear = decode.project if fused else frozen_linear
        if hasattr(self, "qkv_proj"):  # column slices of one output, as a fused group's
            q, k, v = linear(self.qkv_proj, x).split(self.qkv_sizes, dim=-1)
            return q, k, v
        return linear(self.q_proj, x), linear(self.k_proj, x), linear(self.v_proj, x)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache=None,
                cache_position: Tensor | None = None) -> Tensor:
        """x [B, T, hidden] (normed), cos/sin [B, 1, T, head_dim], mask [B|1, 1, T, S] boolean (None: causal);
        `cache` (a `KVCache`, or any object with its `update`): k, v written at slots `cache_position` [T], and
        attention over what `update` returns. The one attention module of training, prefill and the plain decode
        step; the scores are `qerl.execution.attention`'s (so are the fused step's and the shared-prompt forward's)."""
        batch, seq, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = q.view(batch, seq, self.num_heads, self.head_dim)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.ops.rope(q, cos, sin), self.ops.rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(cache_position, k, v)
            out = attention.attend_cached(q, k, v, mask, self.scale)
        else:
            out = attention.attend(q, k, v, mask, self.scale)
        return self.o_proj(out)


def gelu_tanh(x: Tensor) -> Tensor:
    """transformers' gelu_pytorch_tanh (Gemma's GeGLU)."""
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}  # config's hidden_act: SwiGLU, Gemma's GeGLU


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU (act = SiLU) or GeGLU (tanh-approximated GELU)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        if config.family.stacked_projections:  # Phi-3: one gate_up_proj in the checkpoint, gate rows first
            self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        else:
            self.gate_proj = nn.Linear(hidden, inter, bias=bias)
            self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = _ACTIVATIONS[config.hidden_act]
        self.ops = training_ops.EAGER  # the model's execution plan sets its own (qerl.execution.attach)

    def gate_up(self, x: Tensor, fused: bool = False) -> tuple[Tensor, Tensor]:
        """gate and up projections [..., intermediate] of the normed input x [..., hidden] (`fused` as
        `Attention.project_qkv`)."""
        if (group := self.__dict__.get(GROUP_ATTR)) is not None:
            gate, up = group(x, fused)
            return gate, up
        linear = decode.project if fused else frozen_linear
        if hasattr(self, "gate_up_proj"):
            gate, up = linear(self.gate_up_proj, x).chunk(2, dim=-1)
            return gate, up
        return linear(self.gate_proj, x), linear(self.up_proj, x)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x)
        if self.act is F.silu:
            return self.down_proj(self.ops.silu_mul(gate, up))  # one kernel on CUDA (qerl.execution.training_ops)
        return self.down_proj(self.act(gate) * up)


class Residual:
    """The residual stream through the blocks as the forward runs it: `normed(norm, into)` is the stream through a
    norm (the input of sub-block `into`, the attention or the MLP), `add(out, norm)` adds a sub-block's output,
    normed first where the family norms outputs. The fused decode step runs the same blocks on a stream of its own
    (`qerl.execution.decode.DeferredResidual`: each add deferred into the next norm's kernel, which also computes
    the next sub-block's LoRA x·Aᵀ: the second value `normed` returns, None here)."""

    def __init__(self, x: Tensor):
        self.x = x

    def normed(self, norm: nn.Module, into: nn.Module | None = None) -> tuple[Tensor, None]:
        return norm(self.x), None

    def add(self, out: Tensor, norm: nn.Module | None = None) -> None:
        self.x = self.x + (out if norm is None else norm(out))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). With the family's sandwich norms (Gemma) the
    outputs are normed too: x + norm(attn(norm(x))), then + norm(mlp(norm(.))); post_attention_layernorm is then
    the norm of the attention output, and pre/post_feedforward_layernorm frame the MLP (Hugging Face's names)."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0):
        super().__init__()
        unit_offset = config.family.unit_offset_norms
        self.sliding = config.is_sliding(layer_idx)  # the decoder hands sliding layers their window's mask
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset)
        self.mlp = MLP(config)
        self.sandwich = config.family.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache=None,
                cache_position: Tensor | None = None) -> Tensor:
        """x [B, T, hidden] through the block (arguments as `Attention.forward`)."""
        return self.around(x, lambda h: self.self_attn(h, cos, sin, mask, cache, cache_position))

    def around(self, x: Tensor, attend) -> Tensor:
        """x through the block around its attention, `attend(normed x)` (the forward's, the shared-prompt
        forward's), the MLP the module's own."""
        stream = Residual(x)
        self.block(stream, lambda h, _: attend(h), lambda h, _: self.mlp(h))
        return stream.x

    def block(self, stream, attend, feed_forward) -> None:
        """The block, written once for every path, on `stream` (a `Residual`, or the fused decode step's):
        `attend(h, h_lora)` and `feed_forward(h, h_lora)` run the attention and the MLP on the normed stream (h_lora:
        the stream's x·Aᵀ for the sub-block's LoRA, or None)."""
        out_norms = (self.post_attention_layernorm, self.post_feedforward_layernorm) if self.sandwich else (None, None)
        stream.add(attend(*stream.normed(self.input_layernorm, self.self_attn)), out_norms[0])
        mlp_norm = self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm
        stream.add(feed_forward(*stream.normed(mlp_norm, self.mlp)), out_norms[1])

# ---------------------------------------------------------------------------------------------------- model


class Decoder(nn.Module):
    """Embeddings, blocks and final norm (HF's `model.` prefix); returns hidden states."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.family.unit_offset_norms)
        self.rotary_emb = RotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.embed_scale = config.hidden_size ** 0.5 if config.family.scaled_embeddings else None
        self.sliding_window = config.sliding_window

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token embeddings, times sqrt(hidden) where the family scales them (Gemma: the factor in the model's
        dtype, as transformers rounds it)."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale is None:
            return x
        return x * torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype).item()

    def rope_tables(self, positions: Tensor) -> dict[bool, tuple[Tensor, Tensor]]:
        """cos/sin tables by `layer.sliding`: sliding layers' own RoPE base where the family has one (Gemma 3)."""
        tables = {False: self.rotary_emb(positions)}
        local = getattr(self.rotary_emb, "local", None)
        tables[True] = local(positions) if local is not None else tables[False]
        return tables

    def masks(self, batch: int, seq: int, attention_mask: Tensor | None, position_ids: Tensor | None = None,
              cache_position: Tensor | None = None, cache_len: int | None = None,
              device: torch.device | None = None) -> tuple[Tensor, dict[bool, Tensor | None]]:
        """Position ids [B, T] and the attention masks by `layer.sliding` ([B|1, 1, T, S] boolean; None: plain
        causal), for T tokens written at `cache_position` (None: no cache) of a cache of `cache_len` slots: what
        every forward over a micro-batch (the plain one, the shared-prompt one, the memory plan's) starts from."""
        position_ids, mask = positions_and_mask(batch, seq, attention_mask, position_ids, cache_position,
                                                 cache_len, device)
        masks = {False: mask}
        if self.sliding_window is not None:
            masks[True] = sliding_mask(mask, seq, cache_position, cache_len or seq, self.sliding_window, device)
        return position_ids, masks

    def step_masks(self, attend: Tensor, slot: Tensor) -> dict[bool, Tensor]:
        """A decode step's masks by `layer.sliding` ([rows, window] boolean), from `attend` (the caller's: its left
        padding and causality) and the slot written: sliding layers see only the slots in their window (the
        engine's slots are transformers' kv_idx)."""
        masks = {False: attend}
        if self.sliding_window is not None:  # slot [1] (every row's) or [rows] (each row's own)
            keys = torch.arange(attend.shape[-1], device=attend.device)
            masks[True] = attend & (keys > slot.view(-1, 1) - self.sliding_window)
        return masks

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                cache_position: Tensor | None = None) -> Tensor:
        """Hidden states [B, T, hidden] after the final norm (arguments as `Transformer.forward`)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got {tuple(input_ids.shape)}")
        batch, seq = input_ids.shape
        cache_len = caches = None
        if cache_position is not None:
            caches = [layer.self_attn.kv_cache for layer in self.layers]
            if caches[0] is None:
                raise RuntimeError("cache_position given but no KV cache: call model.setup_kv_cache(...) first")
            cache_len = caches[0].k_cache.shape[2]
            if cache_position.shape not in ((seq,), (batch, seq)):
                raise ValueError(f"cache_position must be [T={seq}] or [B={batch}, T={seq}], got "
                                 f"{tuple(cache_position.shape)}")
        position_ids, masks = self.masks(batch, seq, attention_mask, position_ids, cache_position, cache_len,
                                         input_ids.device)
        return self.blocks(self.embed(input_ids), position_ids, masks, caches, cache_position)

    def blocks(self, x: Tensor, position_ids: Tensor, masks: dict[bool, Tensor | None], caches=None,
               cache_position: Tensor | None = None) -> Tensor:
        """The blocks and the final norm over embedded tokens x [B, T, hidden] at `position_ids`, with `masks` by
        `layer.sliding` and one cache per layer (`Attention.forward`; None: no cache): the one loop of training,
        prefill and the plain decode step."""
        inputs = {kind: (cos[:, None], sin[:, None], masks[kind])  # cos/sin broadcast over heads
                  for kind, (cos, sin) in self.rope_tables(position_ids).items() if kind in masks}
        recompute = self.recomputed_blocks()
        for i, layer in enumerate(self.layers):
            cos, sin, mask = inputs[layer.sliding]
            cache = None if caches is None else caches[i]
            if i < recompute:
                x = checkpoint(layer, x, cos, sin, mask, cache, cache_position, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, cache, cache_position)
        return self.norm(x)


    def recomputed_blocks(self) -> int:
        """How many blocks (the first ones) recompute their forward in backward instead of keeping their
        activations: gradient_checkpointing True (every block), False, or a number (the trainer's memory plan)."""
        plan = self.gradient_checkpointing
        return (len(self.layers) if plan is True else int(plan)) if self.training and torch.is_grad_enabled() else 0

@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None):
    """Create parameters directly in `dtype` (no fp32 copy of a 7B model on the way)."""
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class Transformer(nn.Module):
    """Causal LM: `model` (Decoder) + `lm_head`, state-dict compatible with HF's *ForCausalLM."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # The default execution plan (eager ops, one GEMM context for all its frozen layers) until the run's own is
        # attached (qerl.model.runtime.prepare_base): layers that replace these later take theirs.
        execution.attach(self)

    @classmethod
    def from_config(cls, config: ModelConfig | dict[str, Any], dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> "Transformer":
        """Build with random weights, parameters created directly in `dtype` on `device` ("meta": no memory)."""
        if not isinstance(config, ModelConfig):
            config = ModelConfig.from_hf(config)
        with _default_dtype(dtype), torch.device(device or "cpu"):
            return cls(config)

    def tie_weights(self) -> None:
        """Share the embedding matrix with lm_head when the config ties them (again after `load_state_dict(assign=True)`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def gradient_checkpointing(self) -> bool | int:
        """Recompute blocks in backward (torch.utils.checkpoint, non-reentrant) to save activation memory: True
        (all), False (none), or a number of blocks (the first ones)."""
        return self.model.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enabled: bool | int) -> None:
        self.model.gradient_checkpointing = enabled

    def fuse_projections(self) -> int:
        """Compute each block's q/k/v and gate/up as one GEMM each (weights concatenated once; `qerl.execution.fusion`);
        returns how many groups were fused. Module names, state dict and adapters are unchanged."""
        return fusion.fuse_projections(self)

    def sync_projections(self) -> tuple[int, ...]:
        """Bring fused projections up to date with their members (call before capturing or replaying graphs of
        `decode_step`: the graphs read copies of the LoRA factors); returns the addresses those graphs read."""
        if not any(GROUP_ATTR in m.__dict__ for m in self.modules()):
            return ()
        return fusion.sync(self)

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Parameter count, tied weights counted once."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def setup_kv_cache(self, batch_size: int, max_seq_len: int, dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None) -> None:
        """Allocate a static KV cache for up to `batch_size` rows of `max_seq_len` tokens (reused if it fits)."""
        ref = self.model.embed_tokens.weight
        dtype, device = dtype or ref.dtype, torch.device(device) if device is not None else ref.device
        c = self.config
        for layer in self.model.layers:
            attn = layer.self_attn
            old = attn.kv_cache
            if old is not None and old.k_cache.shape[0] == batch_size and old.k_cache.shape[2] == max_seq_len \
                    and old.k_cache.dtype == dtype and old.k_cache.device == device:
                continue
            attn.kv_cache = None  # free the old one before allocating
            attn.kv_cache = KVCache(batch_size, c.num_key_value_heads, max_seq_len, c.head_dim, dtype, device)

    def reset_kv_cache(self) -> None:
        """Zero the cache contents (keeps the allocation, e.g. for CUDA graphs)."""
        for layer in self.model.layers:
            if layer.self_attn.kv_cache is not None:
                layer.self_attn.kv_cache.k_cache.zero_()
                layer.self_attn.kv_cache.v_cache.zero_()

    def free_kv_cache(self) -> None:
        """Drop the cache, returning its memory (e.g. before a training step)."""
        self.use_kv_caches(None)

    def use_kv_caches(self, caches: Sequence | None) -> None:
        """Have attention read and write `caches` (one per layer, each with `update(k, v, positions)` and
        `k_cache`, as KVCache; the rollout engine's own) in the forwards that pass `cache_position`; None: none."""
        caches = [None] * len(self.model.layers) if caches is None else list(caches)
        if len(caches) != len(self.model.layers):
            raise ValueError(f"{len(caches)} KV caches for {len(self.model.layers)} layers")
        for layer, cache in zip(self.model.layers, caches):
            layer.self_attn.kv_cache = cache

    def fused_decode_supported(self) -> bool:
        """Whether `decode_step(fused=True)` can run here (`qerl.execution.decode.supported`)."""
        return decode.supported(self)

    @torch.no_grad()
    def decode_step(self, tokens: Tensor, positions: Tensor, slot: Tensor, attend: Tensor,
                    kv_caches: Sequence[tuple[Tensor, Tensor]], fused: bool = False,
                    queries_per_row: int = 1) -> Tensor:
        """One token for each of `rows` sequences over caches the caller owns; logits [rows, vocab] (model dtype).

        tokens [rows]; positions [rows, 1] (RoPE positions); slot [1]: the cache slot each row's k, v are written
        to; attend [rows, window] bool: the slots each row may attend to (the caller's left padding and causality);
        kv_caches: one (k, v) pair per layer, each [>= rows, kv_heads, >= window slots, head_dim], read and written
        in rows :rows and slots :window. The blocks' own forward over those caches; `fused=True`: the same blocks as
        the Triton kernels run them (`qerl.execution.decode`, see `fused_decode_supported`), ~1 ulp from it in
        bf16. Everything it launches depends only on shapes, so a CUDA graph of it replays correctly.

        `queries_per_row` Q > 1 (verifying drafted tokens): N = rows * Q query rows, row r * Q + t being token t of
        cache row r; tokens [N], positions [N, 1], slot [N] (each query's own slot), attend [N, window] (query t of
        a row written at slot p sees at most slots <= p + t). The same numbers as Q one-token steps, in one forward.
        """
        if fused:
            return decode.decode_step(self, tokens, positions, slot, attend, kv_caches,
                                      queries_per_row=queries_per_row)
        decoder, window, q = self.model, attend.shape[-1], queries_per_row
        rows = tokens.shape[0] // q
        masks = {kind: m.view(rows, 1, q, window) for kind, m in decoder.step_masks(attend, slot).items()}
        caches = [StepCache(k, v, window) for k, v in kv_caches]
        per_row = slot.numel() > 1  # each row at its own slots: the caches write [rows, Q] positions
        cache_position = slot.view(rows, q) if per_row else slot
        hidden = decoder.blocks(decoder.embed(tokens.view(rows, q)), positions.view(rows, q), masks, caches,
                                cache_position)
        return self.softcap(self.lm_head(hidden.reshape(rows * q, -1)))

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                cache_position: Tensor | None = None, logits_to_keep: int | Tensor | None = None) -> Tensor:
        """Logits [B, T', vocab] in the model dtype.

        input_ids [B, T]; position_ids [B, T] (None: derived from attention_mask, else 0..T-1 or cache_position);
        attention_mask [B, T_total], 1 = real token, 0 = left padding (T_total = T without a cache, at most the
        cache length with one); cache_position [T]: KV-cache slots to write (None = no cache, training);
        logits_to_keep: int k = only the last k positions (0 = all), or a tensor of positions.
        """
        hidden = self.model(input_ids, position_ids, attention_mask, cache_position)
        if isinstance(logits_to_keep, Tensor):
            hidden = hidden[:, logits_to_keep]
        elif logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return self.softcap(self.lm_head(hidden))

    def softcap(self, logits: Tensor) -> Tensor:
        """cap * tanh(logits / cap) where the config sets final_logit_softcapping, else the logits."""
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
