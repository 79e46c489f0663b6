"""The update's forward with each distinct prompt of a micro-batch run once (`model.share_prompts`), and only its
real tokens through the GEMMs (`model.pack_completions`): applied to the model's own blocks, written beside none.

A GRPO micro-batch of G-sample groups repeats each prompt G times; `forward_shared_prompts` packs the tokens as each
distinct prompt's, then every row's completion's, runs every token-wise op (norms, projections, MLP) on the packed
tokens, and attention per row on the padded layout: each completion attends to its own prompt's keys and values
(gathered per row) and causally to its own tokens. Same hidden states and gradients as the decoder's forward, to
float rounding (the GEMMs' shapes differ).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from qerl.execution import attention


@dataclass
class SharedPrompts:
    """A training micro-batch whose rows repeat a few prompts (a GRPO group's completions share theirs), packed so
    that each distinct prompt runs through the blocks once (`forward_shared_prompts`): the tokens are each
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


def per_row(per_prompt: Tensor, owner: Tensor) -> Tensor:
    """`per_prompt[owner]`: each row's copy of its prompt's tensor, with a backward that sums the rows' gradients
    into their prompt in one order, so that a step computes the same bits every time (README, Determinism). The
    backward of indexing (index_put_ with accumulate) does that on CUDA (it sorts the indices) but not on the CPU,
    where several threads add at once in whatever order they run; index_select's (index_add_) is the reverse:
    serial on the CPU, atomic adds on CUDA."""
    return per_prompt.index_select(0, owner) if per_prompt.device.type == "cpu" else per_prompt[owner]


def forward_shared_prompts(decoder: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int,
                           share: bool = True, pack: bool = False) -> Tensor:
    """`decoder(input_ids, attention_mask=attention_mask)` (a `qerl.model.transformer.Decoder`) for rows that are
    a prompt in the first `prompt_len` columns (left-padded) and a completion after it (right-padded), computing each
    distinct prompt once however many rows repeat it: a GRPO micro-batch of G-sample groups runs its prompt tokens
    1/G as often. Each row's prompt positions hold its prompt's hidden states. Same hidden states and gradients as
    the forward (the GEMMs' shapes differ, so to float rounding). Rows that all differ, without `pack`: the forward.

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
        return decoder(input_ids, attention_mask=attention_mask)
    p = prompt_len
    position_ids, masks = decoder.masks(batch, seq, attention_mask, device=input_ids.device)
    # Contiguous once here, not in each of the blocks' RoPE calls (4 per block per forward).
    tables = {kind: ((cos[first, :p][:, None].contiguous(), sin[first, :p][:, None].contiguous(),
                      masks[kind][first][:, :, :p, :p]),
                     (cos[:, p:][:, None].contiguous(), sin[:, p:][:, None].contiguous(), masks[kind][:, :, p:]))
              for kind, (cos, sin) in decoder.rope_tables(position_ids).items() if kind in masks}
    tokens = torch.cat([input_ids[first, :p].reshape(-1), input_ids[:, p:].reshape(-1)])
    index = None
    if pack:
        real = torch.cat([attention_mask[first, :p].reshape(-1), attention_mask[:, p:].reshape(-1)]).bool()
        index = real.nonzero().squeeze(1)
        tokens = tokens[index]
    shared = SharedPrompts(len(first), batch, p, seq - p, owner, tables, index)
    x = decoder.embed(tokens)
    recompute = decoder.recomputed_blocks()
    for i, layer in enumerate(decoder.layers):
        if i < recompute:
            x = checkpoint(_block, layer, x, shared, use_reentrant=False)
        else:
            x = _block(layer, x, shared)
    x = shared.unpack(decoder.norm(x))
    n = shared.prompts * p
    return torch.cat([per_row(x[:n].view(shared.prompts, p, -1), owner), x[n:].view(batch, seq - p, -1)], dim=1)


def _block(layer: nn.Module, x: Tensor, shared: SharedPrompts) -> Tensor:
    """`DecoderLayer.forward` over a micro-batch packed by `SharedPrompts` (x [tokens, hidden]): every op but
    attention works token by token, so it runs on the packed tokens as they are."""
    return layer.around(x, lambda h: shared_attention(layer.self_attn, h, shared, layer.sliding))


def shared_attention(attn: nn.Module, x: Tensor, shared: SharedPrompts, sliding: bool = False) -> Tensor:
    """`Attention.forward` of `attn` over a micro-batch packed by `SharedPrompts`: x [tokens, hidden] holds each
    distinct prompt's tokens once, then every row's completion tokens (with `shared.index`, only the real ones). The
    prompts attend within themselves; each completion attends to its own prompt's keys and values (gathered per row) and
    causally to its own tokens: what every row computes in `forward`, without repeating a prompt for each
    completion that shares it. Attention runs on the padded layout (packed tokens scattered into it)."""
    q, k, v = attn.project_qkv(x)
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, k, v = q.view(-1, heads, dim), k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
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
    q_p, k_p = attn.ops.rope(q_p, cos_p, sin_p), attn.ops.rope(k_p, cos_p, sin_p)
    q_c, k_c = attn.ops.rope(q_c, cos_c, sin_c), attn.ops.rope(k_c, cos_c, sin_c)
    # Each row's keys and values: its prompt's, then its completion's.
    k_c = torch.cat([per_row(k_p, shared.owner), k_c], dim=2)
    v_c = torch.cat([per_row(v_p, shared.owner), v_c], dim=2)
    # SDPA's own GQA on the CPU (`attention.attend`): a third of the tensors saved for backward, half the time.
    out_p = attention.attend(q_p, k_p, v_p, mask_p, attn.scale, cpu_gqa=True)
    out_c = attention.attend(q_c, k_c, v_c, mask_c, attn.scale, cpu_gqa=True)
    out = torch.cat([out_p.reshape(n, -1), out_c.reshape(q.shape[0] - n, -1)])
    return attn.o_proj(shared.pack(out))
