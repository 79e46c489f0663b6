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
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from qerl import execution
from qerl.execution import training_ops
from qerl.model import fusion
from qerl.model.families import FULL, SLIDING, SUPPORTED_MODEL_TYPES, Family, family, layer_types, unsupported
from qerl.model.fusion import GROUP_ATTR  # a block's fused q/k/v or gate/up (fusion.ProjectionGroup), when made
from qerl.model.lora import DeferredLoRA, finished
from qerl.quant.fp8 import frozen_linear

_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass
class ModelConfig:
    """Architecture of one decoder; `from_hf` reads a Hugging Face `config.json` dict."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF rope parameters without rope_theta; None = plain RoPE
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2: always)
    attention_out_bias: bool = False  # bias on o_proj (Llama/Qwen3 `attention_bias`; never Qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str | None = None  # dtype the checkpoint was saved in
    # Families past Llama/Qwen (qerl.model.families); the defaults are Llama's.
    hidden_act: str = "silu"  # MLP activation: SwiGLU ("silu") or GeGLU ("gelu_pytorch_tanh")
    sliding_window: int | None = None  # keys a sliding layer attends to (itself included); None = no sliding layer
    layer_types: list[str] | None = None  # per layer FULL or SLIDING attention; None = all full
    rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma 3); None = rope_theta
    query_pre_attn_scalar: float | None = None  # softmax scale = this ** -0.5 (Gemma); None = head_dim ** -0.5
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) where set

    @classmethod
    def from_hf(cls, config: dict[str, Any] | Any) -> "ModelConfig":
        """Read a Hugging Face config (`config.json` as a dict, or a `PretrainedConfig`)."""
        if not isinstance(config, dict):
            config = config.to_dict()
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise unsupported(model_type, config.get("architectures"))
        fam = family(model_type)
        config = {**fam.config_defaults, **config}

        def need(key: str) -> Any:
            if config.get(key) is None:
                raise ValueError(f"{model_type} config lacks required key {key!r}")
            return config[key]

        if config.get("use_sliding_window"):
            raise ValueError("Qwen2 sliding-window attention (use_sliding_window=true) is not supported")
        if config.get("use_bidirectional_attention"):
            raise ValueError(f"{model_type}: use_bidirectional_attention=true is not supported (causal LMs only)")
        if config.get("attn_logit_softcapping") is not None:  # transformers' Gemma 3 never applies it
            raise ValueError(f"{model_type}: attn_logit_softcapping={config['attn_logit_softcapping']} is not "
                             "supported (transformers' Gemma 3 ignores it; its checkpoints set null)")
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        # transformers >= 5 folds rope_theta and the scaling into `rope_parameters` (keyed by layer kind where
        # they differ, as Gemma 3's local and global layers); older files use rope_theta and rope_scaling.
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        local_rope = None
        if FULL in rope or SLIDING in rope:
            local_rope = dict(rope.get(SLIDING) or {})
            rope = dict(rope.get(FULL) or {})
        rope_theta = float(rope.pop("rope_theta", None) or config.get("rope_theta") or 10000.0)
        partial = rope.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor") or 1.0
        if partial != 1.0:
            raise ValueError(f"{model_type}: partial_rotary_factor={partial} (partial RoPE) is not supported")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(_ROPE_TYPES)}")
        intermediate, layers = need("intermediate_size"), need("num_hidden_layers")
        types = layer_types(fam, config, layers)
        rope_local_theta = None
        if fam.sliding == "layer_types" and types is not None:
            if (local_rope or {}).get("rope_type", "default") != "default":
                raise ValueError(f"{model_type}: only plain RoPE on sliding layers is supported, got {local_rope}")
            rope_local_theta = float((local_rope or {}).get("rope_theta") or need("rope_local_base_freq"))
        act = config.get(fam.activation_key) or config.get("hidden_act") or "silu"
        if act not in _ACTIVATIONS:
            raise ValueError(f"{model_type}: unsupported activation {act!r}; supported: {', '.join(_ACTIVATIONS)}")
        attn_bias = bool(config.get("attention_bias", False))
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            vocab_size=need("vocab_size"),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling={**rope, "rope_type": rope_type} if rope_type != "default" else None,
            max_position_embeddings=config.get("max_position_embeddings") or 4096,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=True if fam.qkv_bias_only else attn_bias,
            attention_out_bias=False if fam.qkv_bias_only else attn_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=fam.qk_norm,
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=config.get("eos_token_id"),
            torch_dtype=config.get("torch_dtype") or config.get("dtype"),
            hidden_act=act,
            sliding_window=int(config["sliding_window"]) if types is not None else None,
            layer_types=types,
            rope_local_theta=rope_local_theta,
            query_pre_attn_scalar=config.get("query_pre_attn_scalar"),
            final_logit_softcapping=config.get("final_logit_softcapping"),
        )

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face `config.json` dict that transformers (and `from_hf`) read back as this architecture."""
        fam = self.family
        d = asdict(self)
        for key in ("attention_out_bias", "qk_norm", "torch_dtype", "hidden_act", "layer_types", "rope_local_theta",
                    "sliding_window", "query_pre_attn_scalar", "final_logit_softcapping"):
            d.pop(key)
        d["architectures"] = [fam.architecture]
        d[fam.activation_key] = self.hidden_act
        d["attention_bias"] = True if fam.qkv_bias_only else self.attention_out_bias
        if fam.qkv_bias_only:
            d.pop("mlp_bias")
        if fam.sliding != "never":  # written even when None: transformers' default for an absent key is a window
            d["sliding_window"] = self.sliding_window
        if fam.sliding == "layer_types":
            d["layer_types"] = self.layer_types or [FULL] * self.num_hidden_layers
            d["rope_parameters"] = {
                FULL: {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta},
                SLIDING: {"rope_type": "default", "rope_theta": self.rope_local_theta or self.rope_theta}}
            d.pop("rope_theta"), d.pop("rope_scaling")
        for key in ("query_pre_attn_scalar", "final_logit_softcapping"):
            if getattr(self, key) is not None or key in fam.config_defaults:
                d[key] = getattr(self, key)
        if self.torch_dtype:
            d["torch_dtype"] = self.torch_dtype
        return d

    @property
    def family(self) -> Family:
        """What this architecture changes in the shared decoder (`qerl.model.families`)."""
        return family(self.model_type)

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends over a sliding window of `sliding_window` keys."""
        return self.layer_types is not None and self.layer_types[layer] == SLIDING

    @property
    def eos_token_ids(self) -> list[int]:
        """EOS ids as a list (configs store an int or a list)."""
        eos = self.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


# ---------------------------------------------------------------------------------------------------- RoPE


def rope_frequencies(config: ModelConfig, seq_len: int | None = None) -> tuple[Tensor, float]:
    """Inverse frequencies (fp32, [head_dim // 2]) and the cos/sin scale for the config's RoPE variant.

    `seq_len` only matters for "dynamic" NTK scaling, which stretches the base once positions pass the trained length.
    """
    dim, base = config.head_dim, config.rope_theta
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "dynamic" and seq_len is not None and seq_len > config.max_position_embeddings:
        factor = scaling["factor"]
        base = base * ((factor * seq_len / config.max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    original_len = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    if kind == "llama3":  # Llama-3.1: divide low frequencies by `factor`, keep high ones, interpolate between
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
        smooth = (original_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original_len / high) & (wavelen <= original_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":  # YaRN (Qwen long context): ramp between interpolated and extrapolated frequencies
        factor = scaling.get("factor") or config.max_position_embeddings / original_len

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, float(attention_factor)
    raise ValueError(f"unsupported rope type {kind!r}")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions, always in fp32 (bf16 positions lose precision past a few thousand)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        inv_freq, self.attention_scaling = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if config.rope_local_theta is not None:  # Gemma 3: sliding layers rotate with their own plain-RoPE base
            self.local = RotaryEmbedding(replace(config, rope_theta=config.rope_local_theta, rope_scaling=None,
                                                 rope_local_theta=None))

    def _apply(self, fn, recurse=True):  # noqa: D401
        # `.to(bf16)` or `to_empty()` would otherwise round or wipe the frequencies (they live in no checkpoint).
        super()._apply(fn, recurse)
        if self.inv_freq.device.type != "meta":
            self.inv_freq = rope_frequencies(self.config)[0].to(self.inv_freq.device)
        return self

    def forward(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """[B, T] positions -> (cos, sin), each [B, T, head_dim] fp32."""
        inv_freq = self.inv_freq
        if (self.config.rope_scaling or {}).get("rope_type") == "dynamic":
            seq_len = int(position_ids.max()) + 1
            if seq_len > self.config.max_position_embeddings:
                inv_freq = rope_frequencies(self.config, seq_len)[0].to(inv_freq.device)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


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

    def add_forward(self, x: Tensor, residual: Tensor | DeferredLoRA | None,
                    fused: bool = False) -> tuple[Tensor, Tensor]:
        """(x + residual, norm(x + residual)) for [rows, dim]; fused: one kernel that adds into x in place (Llama's
        rounding only: a unit-offset norm takes the plain path), and finishes a deferred residual's LoRA update."""
        x, y, _ = self.add_forward_shrink(x, residual, fused, None)
        return x, y

    def add_forward_shrink(self, x: Tensor, residual: Tensor | DeferredLoRA | None, fused: bool,
                           shrink: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        """`add_forward`, and h = norm(x + residual)·Aᵀ for the next projection's LoRA A `shrink` [R, dim] (None:
        h is None); fused: in the same kernel (`fused_ops.fused_add_rmsnorm`)."""
        if fused and not self.unit_offset:
            from qerl.execution import fused_ops  # lazy: Triton costs ~0.3 s to import, and only decoding needs it

            low_rank = residual if isinstance(residual, DeferredLoRA) else None  # the kernel finishes its update
            out = fused_ops.fused_add_rmsnorm(x, low_rank.out if low_rank is not None else residual, self.weight,
                                              self.eps, low_rank, shrink)
            return out if shrink is not None else (*out, None)
        residual = finished(residual)
        x = x if residual is None else x + residual
        y = self(x)
        return x, y, None if shrink is None else F.linear(y, shrink)


def project(linear: nn.Module, x: Tensor, fused: bool = False) -> Tensor:
    """linear(x); in a fused decode step, a layer's `fused_forward` where it has one (LoRA: base(x) then one addmm
    of the low-rank update into it, instead of GEMM + scale + add)."""
    fast = getattr(linear, "fused_forward", None) if fused else None
    return frozen_linear(linear, x) if fast is None else fast(x)  # a frozen bf16 linear: FP8 in the FP8 update


def project_deferred(linear: nn.Module, x: Tensor) -> Tensor | DeferredLoRA:
    """`project(linear, x, fused=True)`, leaving LoRA's B product to the kernel that reads the output next where the
    layer can (`LoraLinear.decode_deferred`); the caller hands a `DeferredLoRA` to such a kernel or finishes it."""
    defer = getattr(linear, "decode_deferred", None)
    deferred = defer(x) if defer is not None else None
    return project(linear, x, True) if deferred is None else deferred


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

    def project_qkv(self, x: Tensor, fused: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """q [..., heads * head_dim], k and v [..., kv_heads * head_dim] of the normed input x [..., hidden]."""
        if (group := self.__dict__.get(GROUP_ATTR)) is not None:
            q, k, v = group(x, fused)
            return q, k, v
        if hasattr(self, "qkv_proj"):  # column slices of one output, as a fused group's
            q, k, v = project(self.qkv_proj, x, fused).split(self.qkv_sizes, dim=-1)
            return q, k, v
        return project(self.q_proj, x, fused), project(self.k_proj, x, fused), project(self.v_proj, x, fused)

    def decode_lora_a(self, dtype: torch.dtype) -> Tensor | None:
        """The q/k/v group's stacked LoRA A, where the decode step defers its update (see `project_qkv_deferred`)."""
        group = self.__dict__.get(GROUP_ATTR)
        return group.decode_lora_a(dtype) if group is not None else None

    def project_qkv_deferred(self, x: Tensor, h_lora: Tensor | None = None
                             ) -> tuple[Tensor, Tensor, Tensor, DeferredLoRA | None]:
        """`project_qkv(x, fused=True)` for the decode step, with the fused group's LoRA update left to the RoPE
        kernel (q, k, v are then the projection's base part); the update is None where there is none to leave.
        h_lora: x·Aᵀ for the group's stacked A, if the norm's kernel computed it."""
        group = self.__dict__.get(GROUP_ATTR)
        parts = group.decode_deferred(x, h_lora) if group is not None else None
        if parts is None:
            return (*self.project_qkv(x, True), None)
        (q, k, v), low_rank = parts
        return q, k, v, low_rank

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                cache_position: Tensor | None) -> Tensor:
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
        if cache_position is not None:
            k, v = self.kv_cache.update(cache_position, k, v)
            # Fold each kv head's query group into the query axis instead of copying the cache `groups` times.
            q = q.reshape(batch, self.num_kv_heads, groups * seq, self.head_dim)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat(1, 1, groups, 1), **self._scale)
            out = out.reshape(batch, self.num_heads, seq, self.head_dim)  # GPU kernels return strided layouts
        else:
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, **self._scale)
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
        groups, options = heads // kv_heads, dict(self._scale)
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
    def _scale(self) -> dict[str, float]:
        """SDPA's `scale` argument where the family sets one (Gemma's query_pre_attn_scalar)."""
        return {} if self.scale is None else {"scale": self.scale}

    def decode_step(self, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, k_cache: Tensor, v_cache: Tensor,
                    slot: Tensor, fused: bool = False, h_lora: Tensor | None = None) -> Tensor | DeferredLoRA:
        """One token per row: h [rows, hidden] (normed), cos/sin [rows, head_dim]; writes k, v at cache slot `slot`
        [1] of rows :rows and attends over the first mask.shape[-1] slots (mask [rows, 1, 1, window]: boolean,
        or additive when fused). Returns the o_proj output [rows, hidden] (fused: its LoRA update may be left to
        the next norm's kernel, a `DeferredLoRA`). h_lora: h·Aᵀ for `decode_lora_a`, if already computed."""
        rows, heads, kv_heads, dim = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        window = mask.shape[-1]
        if fused:
            from qerl.execution import fused_ops

            q, k, v, low_rank = self.project_qkv_deferred(h, h_lora)
            norms = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
            if self.qk_norm and self.q_norm.unit_offset:  # the kernel norms as Llama rounds: Gemma's q/k norm here
                if low_rank is not None:  # q, k, v are views of its output: finished in place
                    low_rank.finish()
                low_rank = None
                q = self.q_norm(q.view(rows, heads, dim)).view(rows, heads * dim)
                k = self.k_norm(k.view(rows, kv_heads, dim)).view(rows, kv_heads * dim)
                norms = (None, None)
            q = fused_ops.fused_rope_cache(q, k, v, cos, sin, slot, k_cache, v_cache, heads, kv_heads, dim, *norms,
                                           low_rank=low_rank)
        else:
            q, k, v = self.project_qkv(h, fused)
            q, k, v = q.view(rows, heads, dim), k.view(rows, kv_heads, dim), v.view(rows, kv_heads, dim)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.ops.rope(q, cos[:, None], sin[:, None]), self.ops.rope(k, cos[:, None], sin[:, None])
            k_cache[:rows].index_copy_(2, slot, k[:, :, None].to(k_cache.dtype))
            v_cache[:rows].index_copy_(2, slot, v[:, :, None].to(v_cache.dtype))
        if fused:  # split-KV decode attention: SDPA's kernels leave most of the GPU idle at one query per row
            out = fused_ops.decode_attention(q, k_cache, v_cache, mask[:, 0, 0], heads, kv_heads, dim,
                                             **self._scale)
            return project_deferred(self.o_proj, out)
        # Query heads of one kv head side by side (as forward folds GQA): no repeat of the cache.
        out = F.scaled_dot_product_attention(q.view(rows, kv_heads, heads // kv_heads, dim),
                                             k_cache[:rows, :, :window], v_cache[:rows, :, :window], attn_mask=mask,
                                             **self._scale)
        return project(self.o_proj, out.reshape(rows, heads * dim), fused)


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
        """gate and up projections [..., intermediate] of the normed input x [..., hidden]."""
        if (group := self.__dict__.get(GROUP_ATTR)) is not None:
            gate, up = group(x, fused)
            return gate, up
        if hasattr(self, "gate_up_proj"):
            gate, up = project(self.gate_up_proj, x, fused).chunk(2, dim=-1)
            return gate, up
        return project(self.gate_proj, x, fused), project(self.up_proj, x, fused)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x)
        if self.act is F.silu:
            return self.down_proj(self.ops.silu_mul(gate, up))  # one kernel on CUDA (qerl.execution.training_ops)
        return self.down_proj(self.act(gate) * up)

    def decode_lora_a(self, dtype: torch.dtype) -> Tensor | None:
        """The gate/up group's stacked LoRA A, where the decode step defers its update (SwiGLU's kernel adds it)."""
        group = self.__dict__.get(GROUP_ATTR)
        return group.decode_lora_a(dtype) if group is not None and self.act is F.silu else None

    def decode_step(self, h: Tensor, fused: bool = False, h_lora: Tensor | None = None) -> Tensor | DeferredLoRA:
        """forward for [rows, hidden]; fused: SiLU(gate) * up in one kernel that also adds the gate/up group's LoRA
        update (GeGLU: the plain ops, no kernel), and down's LoRA update left to the next norm's kernel (a
        `DeferredLoRA`). h_lora: h·Aᵀ for `decode_lora_a`, if already computed."""
        if fused and self.act is F.silu:
            from qerl.execution import fused_ops

            group = self.__dict__.get(GROUP_ATTR)
            parts = group.decode_deferred(h, h_lora) if group is not None else None
            (gate, up), low_rank = parts if parts is not None else (self.gate_up(h, fused), None)
            return project_deferred(self.down_proj, fused_ops.fused_silu_mul(gate, up, low_rank))
        gate, up = self.gate_up(h, fused)
        return project(self.down_proj, self.act(gate) * up, fused)


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

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                cache_position: Tensor | None) -> Tensor:
        return self._block(x, lambda h: self.self_attn(h, cos, sin, mask, cache_position))

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

    def decode_step(self, x: Tensor, residual: Tensor | DeferredLoRA | None, cos: Tensor, sin: Tensor, mask: Tensor,
                    k_cache: Tensor, v_cache: Tensor, slot: Tensor,
                    fused: bool = False) -> tuple[Tensor, Tensor | DeferredLoRA]:
        """forward for one token per row, with the residual add deferred into the next norm (where the fused
        kernel does it, and adds the residual's LoRA update if it was left to it): takes and returns
        (x, residual), the block's output being x + residual."""
        if self.sandwich:
            x, h = self.input_layernorm.add_forward(x, residual, fused)
            residual = self.self_attn.decode_step(h, cos, sin, mask, k_cache, v_cache, slot, fused)
            residual = self.post_attention_layernorm(finished(residual))
            x, h = self.pre_feedforward_layernorm.add_forward(x, residual, fused)
            return x, self.post_feedforward_layernorm(finished(self.mlp.decode_step(h, fused)))
        # fused: each norm's kernel also computes the next group's x·Aᵀ (LoRA's first product) where it is deferred
        shrink = self.self_attn.decode_lora_a(x.dtype) if fused else None
        x, h, h_lora = self.input_layernorm.add_forward_shrink(x, residual, fused, shrink)
        residual = self.self_attn.decode_step(h, cos, sin, mask, k_cache, v_cache, slot, fused, h_lora)
        shrink = self.mlp.decode_lora_a(x.dtype) if fused else None
        x, h, h_lora = self.post_attention_layernorm.add_forward_shrink(x, residual, fused, shrink)
        return x, self.mlp.decode_step(h, fused, h_lora)


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

    def _rope(self, positions: Tensor) -> dict[bool, tuple[Tensor, Tensor]]:
        """cos/sin tables by `layer.sliding`: sliding layers' own RoPE base where the family has one (Gemma 3)."""
        tables = {False: self.rotary_emb(positions)}
        local = getattr(self.rotary_emb, "local", None)
        tables[True] = local(positions) if local is not None else tables[False]
        return tables

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                cache_position: Tensor | None = None) -> Tensor:
        """Hidden states [B, T, hidden] after the final norm (arguments as `Transformer.forward`)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got {tuple(input_ids.shape)}")
        batch, seq = input_ids.shape
        cache_len = None
        if cache_position is not None:
            cache = self.layers[0].self_attn.kv_cache
            if cache is None:
                raise RuntimeError("cache_position given but no KV cache: call model.setup_kv_cache(...) first")
            cache_len = cache.k_cache.shape[2]
            if cache_position.shape != (seq,):
                raise ValueError(f"cache_position must be [T={seq}], got {tuple(cache_position.shape)}")
        position_ids, mask = _positions_and_mask(batch, seq, attention_mask, position_ids, cache_position,
                                                 cache_len, input_ids.device)
        masks = {False: mask}
        if self.sliding_window is not None:
            masks[True] = _sliding_mask(mask, seq, cache_position, cache_len or seq, self.sliding_window,
                                        input_ids.device)
        inputs = {kind: (cos[:, None], sin[:, None], masks[kind])  # cos/sin broadcast over heads
                  for kind, (cos, sin) in self._rope(position_ids).items() if kind in masks}
        x = self.embed(input_ids)
        # gradient_checkpointing: True (every layer), False, or how many layers (the first ones) recompute their
        # forward in backward instead of keeping their activations: the trainer's memory plan picks that number.
        plan = self.gradient_checkpointing
        recompute = (len(self.layers) if plan is True else int(plan)) if self.training and torch.is_grad_enabled() \
            else 0
        for i, layer in enumerate(self.layers):
            cos, sin, mask = inputs[layer.sliding]
            if i < recompute:
                x = checkpoint(layer, x, cos, sin, mask, cache_position, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, cache_position)
        return self.norm(x)

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
        device, p = input_ids.device, prompt_len
        position_ids, mask = _positions_and_mask(batch, seq, attention_mask, None, None, None, device)
        masks = {False: mask}
        if self.sliding_window is not None:
            masks[True] = _sliding_mask(mask, seq, None, seq, self.sliding_window, device)
        # Contiguous once here, not in each of the blocks' RoPE calls (4 per block per forward).
        tables = {kind: ((cos[first, :p][:, None].contiguous(), sin[first, :p][:, None].contiguous(),
                          masks[kind][first][:, :, :p, :p]),
                         (cos[:, p:][:, None].contiguous(), sin[:, p:][:, None].contiguous(), masks[kind][:, :, p:]))
                  for kind, (cos, sin) in self._rope(position_ids).items() if kind in masks}
        tokens = torch.cat([input_ids[first, :p].reshape(-1), input_ids[:, p:].reshape(-1)])
        index = None
        if pack:
            real = torch.cat([attention_mask[first, :p].reshape(-1), attention_mask[:, p:].reshape(-1)]).bool()
            index = real.nonzero().squeeze(1)
            tokens = tokens[index]
        shared = SharedPrompts(len(first), batch, p, seq - p, owner, tables, index)
        x = self.embed(tokens)
        plan = self.gradient_checkpointing
        recompute = (len(self.layers) if plan is True else int(plan)) if self.training and torch.is_grad_enabled() \
            else 0
        for i, layer in enumerate(self.layers):
            if i < recompute:
                x = checkpoint(layer.forward_shared, x, shared, use_reentrant=False)
            else:
                x = layer.forward_shared(x, shared)
        x = shared.unpack(self.norm(x))
        n = shared.prompts * p
        return torch.cat([x[:n].view(shared.prompts, p, -1)[owner], x[n:].view(batch, seq - p, -1)], dim=1)

    def decode_step(self, tokens: Tensor, positions: Tensor, slot: Tensor, attend: Tensor,
                    kv_caches: Sequence[tuple[Tensor, Tensor]], fused: bool = False) -> Tensor:
        """Hidden states [rows, hidden] after the final norm (arguments as `Transformer.decode_step`)."""
        x = self.embed(tokens)
        attends = {False: attend}
        if self.sliding_window is not None:  # slots before the window: the engine's slots are transformers' kv_idx
            attends[True] = attend & (torch.arange(attend.shape[-1], device=attend.device) > slot - self.sliding_window)
        inputs = {}
        for kind, (cos, sin) in self._rope(positions).items():  # [rows, 1, D] fp32
            if kind in attends:
                mask = attends[kind]
                if fused:  # an additive mask, built once per step instead of once per layer inside SDPA
                    mask = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~mask, float("-inf"))
                inputs[kind] = (cos[:, 0], sin[:, 0], mask[:, None, None, :])
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            cos, sin, mask = inputs[layer.sliding]
            x, residual = layer.decode_step(x, residual, cos, sin, mask, k_cache, v_cache, slot, fused)
        return self.norm.add_forward(x, residual, fused)[1]


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
        """Whether `decode_step(fused=True)` can run here: the Triton kernels run on the model's device (CUDA, or
        the CPU interpreter) and the RoPE kernel's block, head_dim / 2, is a power of two."""
        from qerl.execution import fused_ops

        half = self.config.head_dim // 2
        return self.config.head_dim % 2 == 0 and half & (half - 1) == 0 \
            and fused_ops.kernels_run_on(self.model.embed_tokens.weight.device)

    @torch.no_grad()  # the fused LoRA path adds in place into a (possibly custom-Function) base output
    def decode_step(self, tokens: Tensor, positions: Tensor, slot: Tensor, attend: Tensor,
                    kv_caches: Sequence[tuple[Tensor, Tensor]], fused: bool = False) -> Tensor:
        """One token for each of `rows` sequences over caches the caller owns; logits [rows, vocab] (model dtype).

        tokens [rows]; positions [rows, 1] (RoPE positions); slot [1]: the cache slot each row's k, v are written
        to; attend [rows, window] bool: the slots each row may attend to (the caller's left padding and causality);
        kv_caches: one (k, v) pair per layer, each [>= rows, kv_heads, >= window slots, head_dim], read and written
        in rows :rows and slots :window. Computes what `forward` computes for these tokens; `fused=True` runs the
        Triton kernels (see `fused_decode_supported`) and LoRA's addmm path, ~1 ulp from `forward` in bf16.
        Everything it launches depends only on shapes, so a CUDA graph of it replays correctly.
        """
        logits = project(self.lm_head, self.model.decode_step(tokens, positions, slot, attend, kv_caches, fused), fused)
        return self.softcap(logits)

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
