"""The rollout engine's KV cache as the model's forward sees it, and the batch buckets its rows come in.

The engine owns one static cache per layer, [rows, kv_heads, slots, head_dim], kept across calls so captured graphs
stay valid. Rows are a power-of-two bucket (`bucket_of`), so a call's rows, and the smaller batches they are
compacted into as they finish, reuse a few graphs; slots are rounded up to the engine's `window`.
"""
from __future__ import annotations

from torch import Tensor, nn

from qerl.execution import kv8
from qerl.model.transformer import write_slots

__all__ = ["EngineCache", "CUDA_MIN_BUCKET", "bucket_of", "batch_buckets", "round_up"]


class EngineCache(nn.Module):
    """One layer's engine-owned KV cache, duck-typed as `qerl.model.transformer.KVCache` for the model's own forward.

    `window` caps the slots attention reads (the model takes the key length from `k_cache.shape[2]`); `row0`
    offsets the rows a row-chunked prefill writes.
    """

    def __init__(self, k: Tensor, v: Tensor):
        super().__init__()
        self.register_buffer("k", k, persistent=False)
        self.register_buffer("v", v, persistent=False)
        self.window, self.row0 = k.shape[2], 0
        self.rows: Tensor | None = None  # the cache rows of a forward over scattered rows (None: from row0 on)

    @property
    def k_cache(self) -> Tensor:
        return self.k[self.row0:, :, :self.window] if self.rows is None else self.k[self.rows, :, :self.window]

    @property
    def v_cache(self) -> Tensor:
        return self.v[self.row0:, :, :self.window] if self.rows is None else self.v[self.rows, :, :self.window]

    def update(self, cache_position: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, T, D] at `cache_position` ([T], or [B, T] each row its own) into cache rows
        row0..row0+B, or into `rows` (then what attention reads is a copy of those rows)."""
        packed = kv8.is_packed(self.k)  # the FP8 layout: attention (a prefill) reads what decode steps will read
        kw, vw = (kv8.pack(k), kv8.pack(v)) if packed else (k, v)
        if self.rows is None:
            cache = slice(self.row0, self.row0 + k.shape[0])
            kc, vc = self.k[cache], self.v[cache]
            write_slots(kc, cache_position, kw)
            write_slots(vc, cache_position, vw)
        else:
            write_slots(self.k, cache_position, kw, self.rows)
            write_slots(self.v, cache_position, vw, self.rows)
            kc, vc = self.k[self.rows], self.v[self.rows]
        kc, vc = kc[:, :, :self.window], vc[:, :, :self.window]
        return (kv8.unpack(kc, k.dtype), kv8.unpack(vc, v.dtype)) if packed else (kc, vc)


CUDA_MIN_BUCKET = 8  # below 8 rows a decode step on a GPU costs the same


def bucket_of(rows: int, min_bucket: int) -> int:
    """The batch bucket of `rows`: the next power of two, at least `min_bucket`."""
    return max(min_bucket, 1 << max(0, rows - 1).bit_length())


def batch_buckets(rows: int, min_bucket: int) -> list[int]:
    """The batch bucket of `rows`, then each smaller one down to `min_bucket`, largest first: every batch a rollout
    of `rows` reaches as its rows finish and are compacted."""
    out, b = [], bucket_of(rows, min_bucket)
    while b >= min_bucket:
        out.append(b)
        b //= 2
    return out


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m
