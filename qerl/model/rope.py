"""Rotary position embeddings of every RoPE variant the families use: default, linear, dynamic NTK, Llama 3, YaRN.

`rope_frequencies` follows transformers' `ROPE_INIT_FUNCTIONS`; `RotaryEmbedding` turns positions into cos/sin tables
in fp32 (Gemma 3's sliding layers get their own base through `local`).
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn as nn
from torch import Tensor

from qerl.model.architecture import ModelConfig


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
