"""One decoder for the Llama, Qwen2/3, Mistral, Phi-3 and Gemma 3 families, with Hugging Face's module names.

Parameter names match transformers' `*ForCausalLM` of each family exactly, so checkpoints load as a plain state
dict and PEFT adapter keys line up; what each family changes is described once, in `qerl.model.families`. One forward
serves training (no cache) and rollout (static KV cache): both compute the same numbers, which the policy-gradient
ratio relies on.

`Transformer.decode_step` is the one-token step of a rollout engine over caches the engine owns: the same blocks,
with the Triton kernels of `qerl.execution.fused_ops` where they run (`fused=True`). Each block calls its input projections
through one method (`Attention.project_qkv`, `MLP.gate_up`): after `Transformer.fuse_projections()` (done on CUDA
where the model is loaded) those run q/k/v and gate/up as one GEMM each, LoRA included (`qerl.model.fusion`); Phi-3
stores them stacked (`qkv_proj`, `gate_up_proj`), so it runs one GEMM each as loaded. Where a kernel's rounding is
not the family's (Gemma's (1 + w) norms, GeGLU) the decode step runs those ops in plain PyTorch.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from qerl import execution
from qerl.execution import decode, training_ops
from qerl.execution.deferred import GROUP_ATTR  # a block's fused q/k/v or gate/up (fusion.ProjectionGroup), when made
from qerl.model import fusion
from qerl.model.architecture import ModelConfig
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
        """Write k/v [B, Hkv, T, D] at slots `cache_position` [T]; return the whole cache for rows :B."""
        batch = k.shape[0]
        if batch > self.k_cache.shape[0]:
            raise ValueError(f"batch {batch} exceeds the KV cache batch {self.k_cache.shape[0]}")
        k_cache, v_cache = self.k_cache[:batch], self.v_cache[:batch]
        k_cache.index_copy_(2, cache_position, k.to(k_cache.dtype))
        v_cache.index_copy_(2, cache_position, v.to(v_cache.dtype))
        return k_cache, v_cache


class StepCache:
    """(k, v) caches a caller owns (the rollout engine's), [>= rows, kv_heads, >= window slots, head_dim], as
    `Attention.forward` takes a cache: `update` writes rows :rows at the given slots and returns their first
    `window` slots."""

    def __init__(self, k_cache: Tensor, v_cache: Tensor, window: int):
        self.k_cache, self.v_cache, self.window = k_cache, v_cache, window

    def update(self, cache_position: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        rows = k.shape[0]
        k_cache, v_cache = self.k_cache[:rows], self.v_cache[:rows]
        k_cache.index_copy_(2, cache_position, k.to(k_cache.dtype))
        v_cache.index_copy_(2, cache_position, v.to(v_cache.dtype))
        return k_cache[:, :, :self.window], v_cache[:, :, :self.window]


class Attention(nn.Module):
    """Grouped-query attention through `F.scaled_dot_product_attention`."""

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

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [..., heads * head_dim], k and v [..., kv_heads * head_dim] of the normed input x [..., hidden]."""
        if (group := self.__dict__.get(GROUP_ATTR)) is not None:
            q, k, v = group(x)
            return q, k, v
        if hasattr(self, "qkv_proj"):  # column slices of one output, as a fused group's
            q, k, v = frozen_linear(self.qkv_proj, x).split(self.qkv_sizes, dim=-1)
            return q, k, v
        return frozen_linear(self.q_proj, x), frozen_linear(self.k_proj, x), frozen_linear(self.v_proj, x)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache=None,
                cache_position: Tensor | None = None) -> Tensor:
        """x [B, T, hidden] (normed), cos/sin [B, 1, T, head_dim], mask [B|1, 1, T, S] boolean (None: causal);
        `cache` (a `KVCache`, or any object with its `update`): k, v written at slots `cache_position` [T], and
        attention over what `update` returns. The one attention of training, prefill and the plain decode step."""
        batch, seq, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = q.view(batch, seq, self.num_heads, self.head_dim)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.ops.rope(q, cos, sin), self.ops.rope(k, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        if cache is not None:
            k, v = cache.update(cache_position, k, v)
            # Fold each kv head's query group into the query axis instead of copying the cache `groups` times.
            q = q.reshape(batch, self.num_kv_heads, groups * seq, self.head_dim)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat(1, 1, groups, 1), **self.sdpa_scale)
            out = out.reshape(batch, self.num_heads, seq, self.head_dim)  # GPU kernels return strided layouts
        else:
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, **self.sdpa_scale)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def forward_shared(self, x: Tensor, shared: "SharedPrompts", sliding: bool = False) -> Tensor:
        """`forward` over a micro-batch packed by `SharedPrompts`: x [tokens, hidden] holds each distinct prompt's
        tokens once, then every row's completion tokens (with `shared.index`, only the real ones). The prompts attend
        within themselves; each completion attends to its own prompt's keys and values (gathered per row) and
        causally to its own tokens: what every row computes in `forward`, without repeating a prompt for each
        completion that shares it. Attention runs on the padded layout (packed tokens scattered into it)."""
        q, k, v = self.project_qkv(x)
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = q.view(-1, heads, dim), k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = shared.unpack(q), shared.unpack(k), shared.unpack(v)
        (cos_p, sin_p, mask_p), (cos_c, sin_c, mask_c) = shared.tables[sliding]
        n, prompts, rows = shared.prompts * shared.prompt_len, shared.prompts, shared.rows

        def parts(t: Tensor) -> tuple[Tensor, Tensor]:  # [prompts, heads, P, dim], [rows, heads, C, dim]
            # One split, not two slices: backward then writes the gradient once (a cat), where each slice's
            # backward would zero-fill a whole-size gradient, copy into it and add the two (7 kernels, not 1).
            p, c = t.split([n, t.shape[0] - n])
            return (p.view(prompts, -1, t.shape[1], dim).transpose(1, 2),
                    c.view(rows, -1, t.shape[1], dim).transpose(1, 2))

        (q_p, q_c), (k_p, k_c), (v_p, v_c) = parts(q), parts(k), parts(v)
        q_p, k_p = self.ops.rope(q_p, cos_p, sin_p), self.ops.rope(k_p, cos_p, sin_p)
        q_c, k_c = self.ops.rope(q_c, cos_c, sin_c), self.ops.rope(k_c, cos_c, sin_c)
        # Each row's keys and values: its prompt's, then its completion's.
        k_c = torch.cat([k_p[shared.owner], k_c], dim=2)
        v_c = torch.cat([v_p[shared.owner], v_c], dim=2)
        groups, options = heads // kv_heads, dict(self.sdpa_scale)
        if groups > 1 and x.device.type == "cpu":
            # SDPA's own GQA on the CPU: the same numbers as repeated keys and values (bitwise, torch 2.13), with a
            # third of them saved for backward and half the time (SmolLM2: 9 query heads on 3 kv heads).
            options["enable_gqa"] = True
        elif groups > 1:
            k_p, v_p = k_p.repeat_interleave(groups, dim=1), v_p.repeat_interleave(groups, dim=1)
            k_c, v_c = k_c.repeat_interleave(groups, dim=1), v_c.repeat_interleave(groups, dim=1)
        out_p = F.scaled_dot_product_attention(q_p, k_p, v_p, attn_mask=mask_p, **options)
        out_c = F.scaled_dot_product_attention(q_c, k_c, v_c, attn_mask=mask_c, **options)
        out = torch.cat([out_p.transpose(1, 2).reshape(n, -1), out_c.transpose(1, 2).reshape(q.shape[0] - n, -1)])
        return self.o_proj(shared.pack(out))

    @property
    def sdpa_scale(self) -> dict[str, float]:
        """SDPA's `scale` argument where the family sets one (Gemma's query_pre_attn_scalar)."""
        return {} if self.scale is None else {"scale": self.scale}


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

    def gate_up(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """gate and up projections [..., intermediate] of the normed input x [..., hidden]."""
        if (group := self.__dict__.get(GROUP_ATTR)) is not None:
            gate, up = group(x)
            return gate, up
        if hasattr(self, "gate_up_proj"):
            gate, up = frozen_linear(self.gate_up_proj, x).chunk(2, dim=-1)
            return gate, up
        return frozen_linear(self.gate_proj, x), frozen_linear(self.up_proj, x)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x)
        if self.act is F.silu:
            return self.down_proj(self.ops.silu_mul(gate, up))  # one kernel on CUDA (qerl.execution.training_ops)
        return self.down_proj(self.act(gate) * up)


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
        return self._block(x, lambda h: self.self_attn(h, cos, sin, mask, cache, cache_position))

    def forward_shared(self, x: Tensor, shared: "SharedPrompts") -> Tensor:
        """`forward` over a micro-batch packed by `SharedPrompts` (x [tokens, hidden]; see `Attention.forward_shared`):
        every op but attention works token by token, so it runs on the packed tokens as they are."""
        return self._block(x, lambda h: self.self_attn.forward_shared(h, shared, self.sliding))

    def _block(self, x: Tensor, attend) -> Tensor:
        if self.sandwich:
            x = x + self.post_attention_layernorm(attend(self.input_layernorm(x)))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + attend(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

# ---------------------------------------------------------------------------------------------------- model


def _positions_and_mask(batch: int, seq: int, attention_mask: Tensor | None, position_ids: Tensor | None,
                        cache_position: Tensor | None, cache_len: int | None,
                        device: torch.device) -> tuple[Tensor, Tensor | None]:
    """Position ids [B, T] and a boolean attention mask [B|1, 1, T, S] (None = plain causal, no cache)."""
    query_slots = cache_position if cache_position is not None else torch.arange(seq, device=device)
    key_len = cache_len if cache_position is not None else seq
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch:
            raise ValueError(f"attention_mask must be [batch={batch}, T_total], got {tuple(attention_mask.shape)}")
        mask_len = attention_mask.shape[1]
        if (cache_position is None and mask_len != seq) or mask_len > key_len:
            raise ValueError(f"attention_mask length {mask_len} must be the input length {seq} without a cache, "
                             f"or at most the cache length {key_len} with one")
        valid = attention_mask.to(device=device, dtype=torch.bool)
    if position_ids is None:
        if attention_mask is not None:  # left padding: count real tokens so each row starts at position 0
            positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
            position_ids = positions[:, query_slots] if cache_position is not None else positions
        else:
            position_ids = query_slots[None].expand(batch, seq)
    if attention_mask is None and cache_position is None:
        return position_ids, None  # lets SDPA pick its causal (flash) kernel
    key_slots = torch.arange(key_len, device=device)
    allowed = key_slots[None, :] <= query_slots[:, None]  # [T, S] causal over written slots
    if attention_mask is not None:
        if valid.shape[1] < key_len:  # slots past the mask are not written yet; causality already hides them
            valid = F.pad(valid, (0, key_len - valid.shape[1]), value=True)
        # Each query also sees itself, so padding rows never softmax over nothing (NaN); real rows are unaffected.
        allowed = (allowed[None] & valid[:, None, :]) | (key_slots[None, :] == query_slots[:, None])[None]
    else:
        allowed = allowed[None]
    return position_ids, allowed[:, None]


def _sliding_mask(mask: Tensor | None, seq: int, cache_position: Tensor | None, key_len: int, window: int,
                  device: torch.device) -> Tensor:
    """`mask` (as `_positions_and_mask` returns it; None = plain causal) narrowed, for sliding layers, to the last
    `window` key slots of each query, itself included: transformers' `kv_idx > q_idx - sliding_window`."""
    query_slots = cache_position if cache_position is not None else torch.arange(seq, device=device)
    key_slots = torch.arange(key_len, device=device)
    if mask is None:
        mask = (key_slots[None, :] <= query_slots[:, None])[None, None]
    return mask & (key_slots[None, :] > query_slots[:, None] - window)


@dataclass
class SharedPrompts:
    """A training micro-batch whose rows repeat a few prompts (a GRPO group's completions share theirs), packed so
    that each distinct prompt runs through the blocks once (`Decoder.forward_shared_prompts`): the tokens are each
    distinct prompt's, then every row's completion's. `tables[sliding]` holds the RoPE tables and attention masks
    of the prompt part ([prompts, 1, P, ...]) and of the completion part ([rows, 1, C, ...], over all T keys), sliced
    from what `forward` builds for the whole micro-batch, so both compute the same positions and masks.
    With `index` the tokens are only the real ones (no padding): their places in that padded layout."""

    prompts: int  # distinct prompts
    rows: int
    prompt_len: int
    completion_len: int
    owner: Tensor  # [rows]: each row's distinct prompt
    tables: dict[bool, tuple[tuple[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]]
    index: Tensor | None = None  # packed: the real tokens' places in the padded [prompts * P + rows * C] layout

    def unpack(self, packed: Tensor) -> Tensor:
        """Packed tokens [tokens, ...] in the padded layout [prompts * P + rows * C, ...], zeros at padding."""
        if self.index is None:
            return packed
        slots = self.prompts * self.prompt_len + self.rows * self.completion_len
        return packed.new_zeros((slots, *packed.shape[1:])).index_copy(0, self.index, packed)

    def pack(self, padded: Tensor) -> Tensor:
        """The real tokens of the padded layout (`unpack`'s inverse)."""
        return padded if self.index is None else padded.index_select(0, self.index)


def distinct_prompts(input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> tuple[Tensor, Tensor]:
    """(owner [B]: each row's distinct prompt, first [U]: the first row holding each) of the first `prompt_len`
    columns (token ids and mask both)."""
    batch = input_ids.shape[0]
    prompt = torch.cat([input_ids[:, :prompt_len], attention_mask[:, :prompt_len].to(input_ids.dtype)], dim=1)
    distinct, owner = torch.unique(prompt, dim=0, return_inverse=True)
    rows = torch.arange(batch, device=input_ids.device)
    first = torch.full((len(distinct),), batch, dtype=torch.long, device=input_ids.device)
    return owner, first.scatter_reduce_(0, owner, rows, "amin")


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
        position_ids, mask = _positions_and_mask(batch, seq, attention_mask, position_ids, cache_position,
                                                 cache_len, device)
        masks = {False: mask}
        if self.sliding_window is not None:
            masks[True] = _sliding_mask(mask, seq, cache_position, cache_len or seq, self.sliding_window, device)
        return position_ids, masks

    def step_masks(self, attend: Tensor, slot: Tensor) -> dict[bool, Tensor]:
        """A decode step's masks by `layer.sliding` ([rows, window] boolean), from `attend` (the caller's: its left
        padding and causality) and the slot written: sliding layers see only the slots in their window (the
        engine's slots are transformers' kv_idx)."""
        masks = {False: attend}
        if self.sliding_window is not None:
            masks[True] = attend & (torch.arange(attend.shape[-1], device=attend.device) > slot - self.sliding_window)
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
            if cache_position.shape != (seq,):
                raise ValueError(f"cache_position must be [T={seq}], got {tuple(cache_position.shape)}")
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
        recompute = self._recomputed()
        for i, layer in enumerate(self.layers):
            cos, sin, mask = inputs[layer.sliding]
            cache = None if caches is None else caches[i]
            if i < recompute:
                x = checkpoint(layer, x, cos, sin, mask, cache, cache_position, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, cache, cache_position)
        return self.norm(x)

    def _recomputed(self) -> int:
        """How many blocks (the first ones) recompute their forward in backward instead of keeping their
        activations: gradient_checkpointing True (every block), False, or a number (the trainer's memory plan)."""
        plan = self.gradient_checkpointing
        return (len(self.layers) if plan is True else int(plan)) if self.training and torch.is_grad_enabled() else 0

    def forward_shared_prompts(self, input_ids: Tensor, attention_mask: Tensor, prompt_len: int, share: bool = True,
                               pack: bool = False) -> Tensor:
        """`forward(input_ids, attention_mask=attention_mask)` for rows that are a prompt in the first `prompt_len`
        columns (left-padded) and a completion after it (right-padded), computing each distinct prompt once however
        many rows repeat it: a GRPO micro-batch of G-sample groups runs its prompt tokens 1/G as often. Each row's
        prompt positions hold its prompt's hidden states. Same hidden states and gradients as `forward` (the GEMMs'
        shapes differ, so to float rounding). Rows that all differ, without `pack`: `forward` itself.

        `share=False`: every row keeps its own prompt (LoRA dropout, whose masks shared rows would share). `pack`:
        only the real tokens (attention mask 1) go through the blocks' projections and MLPs, without padding;
        attention scatters them into the padded layout per row. Rows of different lengths then cost their own
        tokens, not the longest's; the padding positions' hidden states are 0."""
        batch, seq = input_ids.shape
        if share:
            owner, first = distinct_prompts(input_ids, attention_mask, prompt_len)
        else:
            owner = first = torch.arange(batch, device=input_ids.device)
        if (len(first) == batch and not pack) or prompt_len == 0 or prompt_len >= seq:
            return self(input_ids, attention_mask=attention_mask)
        p = prompt_len
        position_ids, masks = self.masks(batch, seq, attention_mask, device=input_ids.device)
        # Contiguous once here, not in each of the blocks' RoPE calls (4 per block per forward).
        tables = {kind: ((cos[first, :p][:, None].contiguous(), sin[first, :p][:, None].contiguous(),
                          masks[kind][first][:, :, :p, :p]),
                         (cos[:, p:][:, None].contiguous(), sin[:, p:][:, None].contiguous(), masks[kind][:, :, p:]))
                  for kind, (cos, sin) in self.rope_tables(position_ids).items() if kind in masks}
        tokens = torch.cat([input_ids[first, :p].reshape(-1), input_ids[:, p:].reshape(-1)])
        index = None
        if pack:
            real = torch.cat([attention_mask[first, :p].reshape(-1), attention_mask[:, p:].reshape(-1)]).bool()
            index = real.nonzero().squeeze(1)
            tokens = tokens[index]
        shared = SharedPrompts(len(first), batch, p, seq - p, owner, tables, index)
        x = self.embed(tokens)
        recompute = self._recomputed()
        for i, layer in enumerate(self.layers):
            if i < recompute:
                x = checkpoint(layer.forward_shared, x, shared, use_reentrant=False)
            else:
                x = layer.forward_shared(x, shared)
        x = shared.unpack(self.norm(x))
        n = shared.prompts * p
        return torch.cat([x[:n].view(shared.prompts, p, -1)[owner], x[n:].view(batch, seq - p, -1)], dim=1)


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
        """Compute each block's q/k/v and gate/up as one GEMM each (weights concatenated once; `qerl.model.fusion`);
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
        for layer in self.model.layers:
            layer.self_attn.kv_cache = None

    def fused_decode_supported(self) -> bool:
        """Whether `decode_step(fused=True)` can run here (`qerl.execution.decode.supported`)."""
        return decode.supported(self)

    @torch.no_grad()
    def decode_step(self, tokens: Tensor, positions: Tensor, slot: Tensor, attend: Tensor,
                    kv_caches: Sequence[tuple[Tensor, Tensor]], fused: bool = False) -> Tensor:
        """One token for each of `rows` sequences over caches the caller owns; logits [rows, vocab] (model dtype).

        tokens [rows]; positions [rows, 1] (RoPE positions); slot [1]: the cache slot each row's k, v are written
        to; attend [rows, window] bool: the slots each row may attend to (the caller's left padding and causality);
        kv_caches: one (k, v) pair per layer, each [>= rows, kv_heads, >= window slots, head_dim], read and written
        in rows :rows and slots :window. The blocks' own forward over those caches; `fused=True`: the same blocks as
        the Triton kernels run them (`qerl.execution.decode`, see `fused_decode_supported`), ~1 ulp from it in
        bf16. Everything it launches depends only on shapes, so a CUDA graph of it replays correctly.
        """
        if fused:
            return decode.decode_step(self, tokens, positions, slot, attend, kv_caches)
        decoder, window = self.model, attend.shape[-1]
        masks = {kind: m[:, None, None, :] for kind, m in decoder.step_masks(attend, slot).items()}
        caches = [StepCache(k, v, window) for k, v in kv_caches]
        hidden = decoder.blocks(decoder.embed(tokens[:, None]), positions, masks, caches, slot)
        return self.softcap(self.lm_head(hidden[:, 0]))

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
