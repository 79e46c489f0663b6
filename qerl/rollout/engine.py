"""The rollout sampler: static KV cache, CUDA-graph decode steps, sampling on the GPU, compaction of finished rows.

qerl's one sampler (a `sampling.Rollout`; log-probs = log_softmax(logits / T) of the sampled token; stop reasons
eos/stop/length, and cut for the dropped groups of a call with `groups`), built like gpt-fast.
`RolloutEngine.reference(model)` is the same engine with graphs, fused kernels and bucketed shapes off: a plain loop
over `Transformer.forward` that every optimisation is tested against, and what
CPU runs sample with (`qerl.rollout.generate.generate`). Each row draws from its own generator when the call gives
`row_seeds` (a generator per row, or on CUDA the sampling kernel keyed per row), so it samples the same tokens in any
batch (up to the float rounding of the batch's shapes).

* One static KV cache per layer, [rows, kv_heads, slots, head_dim], owned by the engine and kept across calls, so
  captured graphs stay valid. Rows are a power-of-two bucket; slots are rounded up to `window` (256).
* Prefill runs the model's own forward (eager, row-chunked). Each decode step is one CUDA graph per
  (batch bucket, KV window): attention reads only the first `window` slots that can hold tokens yet, not the
  whole cache, so early steps of a long rollout do not pay for its end.
* The decode step (`fused=True`) is the model's own `Transformer.decode_step` over the engine's caches: with the
  fused Triton kernels of `qerl.execution.fused_ops` (residual-add + RMSNorm, RoPE + KV write, SiLU*up) and LoRA as
  `base(x)` then one `addmm_` where they run. That takes a layer from ~75 kernels to ~30; in a graph each tiny
  kernel still costs a few µs, which at decode sizes is the same order as reading the (NVFP4) weights. Off CUDA
  it runs the plain PyTorch ops, so CPU runs compute what `Transformer.forward` computes. `fused=False` graphs
  `Transformer.forward` itself. The engine never reaches into the model's modules: it owns the caches (handed to the
  model's forward through `Transformer.use_kv_caches`, as gpt-fast's model takes its caches), which rows and slots
  are live, graph capture and compaction.
* Sampling (`qerl.rollout.sampling.sample_tokens`) runs eagerly on the GPU between replays: no host synchronization
  per token. With `row_seeds` the one-pass kernel keys each slot by its row's seed and the step (`step_keys`), one
  launch for the batch; PyTorch's sampler (the CPU, top-k/top-p) draws from each row's generator. Every
  `check_every` steps one sync counts live rows, scans for stop strings, and moves the live rows to the front of a
  smaller bucket when they fit one (KV rows are gathered): finished rows stop costing compute.
* Graphs read LoRA factors, RMSNorm weights (AQN writes noise into them in place) and quantized buffers by
  address: optimizer steps and `NoiseInjector` are in place, so graphs stay valid across RL steps. If any
  parameter or buffer moved (e.g. `adapters_disabled` swaps `.data`, a reload), the graphs are recaptured.

The engine owns the resources and the forwards (caches and static buffers, graphs, prefill, the decode and verify
steps, compaction's gathers); a call's rows and their scheduling live beside it: `rows` (a row as an object, its
state machine, the cache-row table), `lockstep` (the plain loop: every live row one token per graph replay, host
checks every `check_every` steps), `speculation` (rows at their own slots: the speculative tail, rows resumed after
a tool), `rollout_call` (one call: its phases, pause/resume, rows handed back, the result) and `call` (its settings,
group cut and outputs). `open` gives the caller a call to drive between host checks; `generate` runs one to its end.

`backends.EngineBackend` drives it for the trainer and evaluation (`generate_fast` keeps one per model). The KV cache
stays allocated between calls (vLLM-style): call `free()` / `release_engine(model)` to hand its memory back.
On CUDA the cache lives in one `releasable.ReleasableBuffer`: `sleep()` hands its physical memory to the driver
while the addresses stay reserved (the trainer does so for the update), and the next call maps it again, zeroed, at
the same addresses, so no graph is recaptured (vLLM's sleep mode, for the KV cache).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from qerl.execution import execution_of, fusion
from qerl.execution import kv8
from qerl.model.lora import LoraLinear
from qerl.model.transformer import Transformer
from qerl.rollout import releasable
from qerl.rollout.call import CallSettings, GroupCut, LogitsProcessor
from qerl.rollout.kv_cache import CUDA_MIN_BUCKET, EngineCache, batch_buckets, bucket_of, round_up
from qerl.rollout.drafts import DraftHistory, DraftSession
from qerl.rollout.rollout_call import RolloutCall
from qerl.rollout.rows import Row, ToolStop
from qerl.rollout.sampling import (Rollout, check_sampling_args, decode_ids, default_eos_ids, distinct_rows,
                                   encode_prompts, random_source)
from qerl.rollout.speculation import MAX_QUERIES

log = logging.getLogger(__name__)

__all__ = ["RolloutEngine", "generate_fast", "engine_for", "release_engine"]

_ENGINE_ATTR = "_qerl_rollout_engine"

# ---------------------------------------------------------------------------------------------------- engine


class RolloutEngine:
    """Batched sampling for one `Transformer`; keeps its KV cache and captured graphs across calls.

    Args:
        use_graphs: capture decode steps in CUDA graphs (default: on CUDA).
        fused: the short decode path (Triton kernels on CUDA) instead of graphing `Transformer.forward`.
        check_every: steps between host checks (live rows, stop strings, compaction). Up to this many tokens
            are generated past a stop string before it is noticed; they are discarded.
        window: granularity of cache slots and of the KV window attention reads.
        min_bucket: smallest batch bucket (buckets are powers of two; below 8 rows a decode step on a GPU
            costs the same, so CUDA defaults to 8, the CPU to 1).
        prefill_tokens: rows per prefill chunk are chosen to keep about this many tokens per forward.
        max_batch_size, max_seq_len: allocate for at least this much up front (avoids re-allocation and
            re-capture when later calls are larger).
        kv_cache_dtype: "model" (the model's dtype) or "fp8" (E4M3 with a scale per vector, qerl.execution.kv8: 0.56x
            the bytes attention reads; where the fused kernels run on a GPU with FP8 conversions, sm_89+, else the
            model's dtype, said once in the log); None: the model's execution plan's (rollout.kv_cache_dtype).
        exact: each call's own shapes: exactly its rows and slots (no buckets, windows or prefill chunks; attention
            reads every slot of the call), every row kept to the call's end (no compaction), the cache sized for
            the call. The numbers of a plain loop over `Transformer.forward`, whatever came before; no graphs.
        speculative: off, on or auto: once at most `speculative_rows` rows are live, decode them speculatively
            (`qerl.rollout.speculation`: drafts from the call's `drafts`, verified in one forward, exact for the
            policy). auto: on CUDA only, where a step at few rows streams every weight for a few tokens; on the
            CPU a step's cost grows with its tokens, so verifying drafts buys nothing there.
        max_draft: the most tokens a row drafts per step (at most `speculation.MAX_QUERIES` - 1).
    """

    def __init__(self, model: Transformer, *, use_graphs: bool | None = None, fused: bool | None = None,
                 check_every: int = 16, window: int = 256, min_bucket: int | None = None,
                 prefill_tokens: int = 16384, max_batch_size: int = 0, max_seq_len: int = 0,
                 kv_cache_dtype: str | None = None, exact: bool = False, speculative: str = "off",
                 speculative_rows: int = 8, max_draft: int = 7):
        _check_options(model, check_every, window, exact, use_graphs, kv_cache_dtype, speculative, speculative_rows,
                       max_draft)
        self.exact = exact
        self.model = model
        self.device = model.model.embed_tokens.weight.device
        cuda = self.device.type == "cuda"
        dynamic_rope = (model.config.rope_scaling or {}).get("rope_type") == "dynamic"  # syncs on max position
        self.use_graphs = cuda and not dynamic_rope and not exact if use_graphs is None else use_graphs
        self.fused = True if fused is None else fused
        # Triton kernels only where they can run: CUDA, or Triton's CPU interpreter (tests).
        self.kernels = self.fused and model.fused_decode_supported()
        self.check_every, self.window = check_every, window
        kv_cache_dtype = kv_cache_dtype or execution_of(model).plan.kv_cache_dtype  # None: rollout.kv_cache_dtype's
        self.kv8 = kv_cache_dtype == "fp8" and self._kv8_runs()
        self.min_bucket = min_bucket or (CUDA_MIN_BUCKET if cuda else 1)
        self.prefill_tokens = prefill_tokens
        self.reserve = (max_batch_size, max_seq_len)
        self.caches: list[EngineCache] | None = None
        self._kv_memory: releasable.ReleasableBuffer | None = None  # the caches' memory where it can sleep
        self.kv: list[tuple[Tensor, Tensor]] | None = None
        self.cap_rows = self.cap_slots = 0
        self.graphs: dict[tuple[int, int], Any] = {}
        self._pool = None
        self._stream = None
        self._signature_seen: tuple | None = None
        self.speculative = speculative == "on" or (speculative == "auto" and cuda)
        self.speculative_rows, self.max_draft = speculative_rows, max_draft
        # A verify step's cost per query token, as a share of a step's fixed cost (its weights): on an H200 at 7B
        # NVFP4 a step of 64 tokens took 6.2 ms against 3.5 ms for 8 (2026-12-02), (6.2/3.5 - 1) / 56 = 0.014.
        # (The CPU's steps cost their tokens; `speculative: on` there is for tests and acceptance studies.)
        self.verify_token_cost = 0.014
        self.spec_cap = 0  # query rows the verify step's buffers hold
        # (live rows, time) at each host check when set (benchmarks: the share of a rollout spent at few rows)
        self.timeline: list[tuple[int, Any]] | None = None
        # verify_steps: speculative forwards; spec_row_steps: rows they advanced (a row gains spec_tokens /
        # spec_row_steps tokens a step); drafted / accepted: draft tokens proposed and kept
        self.stats: dict[str, float] = {"captures": 0, "compactions": 0, "steps": 0, "verify_steps": 0,
                                        "spec_row_steps": 0, "spec_tokens": 0, "drafted": 0, "accepted": 0}

    @classmethod
    def reference(cls, model: Transformer, **speculation) -> "RolloutEngine":
        """The engine with graphs, fused kernels and bucketed shapes off, checking its rows after every token (a
        free host sync on the CPU; the loop ends when the last row does): `Transformer.forward` at each step.
        `speculation`: the engine's speculative, speculative_rows and max_draft."""
        return cls(model, use_graphs=False, fused=False, check_every=1, exact=True, **speculation)

    def _kv8_runs(self) -> bool:
        """Whether the FP8 KV cache can be used here: the fused decode kernels (which read and write its layout),
        and on a GPU the E4M3 conversions of sm_89+."""
        cuda = self.device.type == "cuda"
        why = ("the fused decode kernels do not run here" if not self.kernels
               else "E4M3 conversions need a GPU of compute capability 8.9 or more"
               if cuda and torch.cuda.get_device_capability(self.device) < (8, 9) else None)
        if why is not None:
            log.info("KV cache in the model's dtype, not FP8: %s", why)
        return why is None

    # ------------------------------------------------------------------------------------------------ memory

    def bucket(self, n: int) -> int:
        return n if self.exact else bucket_of(n, self.min_bucket)

    def _allocate(self, rows: int, slots: int) -> None:
        """(Re)allocate the cache and static buffers; any captured graph referred to the old ones."""
        self.free()
        c, m = self.model.config, self.model
        dtype, dev = m.model.embed_tokens.weight.dtype, self.device
        shape = (rows, c.num_key_value_heads, slots, kv8.packed_dim(c.head_dim) if self.kv8 else c.head_dim)
        tensors = self._kv_tensors(shape, torch.uint8 if self.kv8 else dtype, 2 * len(m.model.layers))
        self.caches = [EngineCache(k, v) for k, v in zip(tensors[0::2], tensors[1::2])]
        self.kv = [(c.k, c.v) for c in self.caches]  # what `Transformer.decode_step` reads and writes
        self.cap_rows, self.cap_slots = rows, slots
        self.tok_in = torch.zeros(rows, dtype=torch.long, device=dev)
        self.pos_in = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.valid = torch.zeros(rows, slots, dtype=torch.bool, device=dev)  # 0 = left padding
        self.key_slots = torch.arange(slots, device=dev)
        self.done = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.row_map = torch.zeros(rows, dtype=torch.long, device=dev)
        self.logits_buf = torch.zeros(rows, c.vocab_size, dtype=torch.float32, device=dev)

    def _kv_tensors(self, shape: tuple[int, ...], dtype: torch.dtype, count: int) -> list[Tensor]:
        """`count` zeroed cache tensors: views of one releasable buffer on CUDA (so `sleep` can hand it back), or
        ordinary allocations where the driver cannot map one (and on the CPU)."""
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self.device.type == "cuda":
            try:
                self._kv_memory = releasable.ReleasableBuffer(count * nbytes, self.device)
            except releasable.Unsupported as e:
                log.info("KV cache in ordinary memory (it cannot sleep): %s", e)
            else:
                flat = self._kv_memory.tensor.view(dtype).zero_()
                return [flat[i * numel:(i + 1) * numel].view(shape) for i in range(count)]
        return [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(count)]

    def sleep(self) -> None:
        """Hand the KV cache's physical memory back to the driver until the next call (graphs stay valid: the next
        call maps it at the same addresses). Nothing to do where the cache is ordinary memory or not allocated."""
        if self._kv_memory is not None:
            self._kv_memory.release()

    def _wake(self) -> None:
        if self._kv_memory is not None and not self._kv_memory.mapped:
            self._kv_memory.restore()
            self._kv_memory.tensor.zero_()  # fresh pages may hold NaN patterns: masked slots are multiplied by 0

    def free(self) -> None:
        """Drop the KV cache, static buffers and graphs (their memory returns to the allocator or the driver)."""
        self.graphs.clear()
        self._pool = None
        if self.caches is not None:
            self.model.use_kv_caches(None)
        self.caches = self.kv = None
        if self._kv_memory is not None:
            self._kv_memory.close()  # after the graphs and every view of it are gone
            self._kv_memory = None
        self.cap_rows = self.cap_slots = 0
        for name in ("tok_in", "pos_in", "slot", "valid", "key_slots", "done", "row_map", "logits_buf", "spec_tok",
                     "spec_pos", "spec_slot", "spec_logits"):
            self.__dict__.pop(name, None)
        self.spec_cap = 0

    def memory_bytes(self) -> int:
        """Bytes held by the KV cache and static buffers (graph pools not counted)."""
        if self.caches is None:
            return 0
        asleep = self._kv_memory is not None and not self._kv_memory.mapped
        tensors = [] if asleep else [t for c in self.caches for t in (c.k, c.v)]
        tensors += [self.tok_in, self.pos_in, self.valid, self.done, self.row_map, self.logits_buf]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _signature(self, sync: bool = True) -> tuple:
        """What a captured graph bakes in: the addresses of every parameter and buffer, those of fused projections
        (synced with their members first, unless `sync` is False), and LoRA on/off."""
        m = self.model
        ptrs = tuple(t.data_ptr() for t in (*m.parameters(), *m.buffers()))
        projections = m.sync_projections() if sync else fusion.signature(m)
        return ptrs, projections, tuple(x.enabled for x in m.modules() if isinstance(x, LoraLinear))

    def _install(self, rows: int, slots: int) -> None:
        if self.exact:
            if self.caches is None or (rows, slots) != (self.cap_rows, self.cap_slots):
                self._allocate(rows, slots)
        else:
            need_rows = self.bucket(max(rows, self.reserve[0]))
            need_slots = round_up(max(slots, self.reserve[1]), self.window)
            if self.caches is None or need_rows > self.cap_rows or need_slots > self.cap_slots:
                self._allocate(max(need_rows, self.cap_rows), max(need_slots, self.cap_slots))
        self._wake()
        self.model.use_kv_caches(None)  # ours are handed over below; the signature must not see a model cache
        signature = self._signature()
        if signature != self._signature_seen:
            if self.graphs:
                log.info("model tensors or LoRA switches changed: recapturing rollout graphs")
            self.graphs.clear()
            self._signature_seen = signature
        self.model.use_kv_caches(self.caches)

    def _uninstall(self) -> None:
        self.model.use_kv_caches(None)

    def _signature_after_run(self) -> None:
        """A prefill or rollout may change what the signature sees, consistently with the graphs it captured: a
        quantized layer's first GPU call repacks its weight for the GEMM backend (its own buffers go) and a fused
        group's GEMM comes to exist. Taken again (caches uninstalled), the next rollout keeps those graphs. Missing
        after `prepare`, the first timed rollout of a fresh model recaptured every graph prepare had captured."""
        self._signature_seen = self._signature(sync=False)

    # ------------------------------------------------------------------------------------------------ forward

    def _decode_step(self, rows: int, window: int) -> None:
        """One token for cache rows :rows (inputs in tok_in/pos_in/slot) through `Transformer.decode_step`;
        fp32 logits into logits_buf[:rows]."""
        attend = self.valid[:rows, :window] & (self.key_slots[:window] <= self.slot)  # left padding, causality
        logits = self.model.decode_step(self.tok_in[:rows], self.pos_in[:rows], self.slot, attend, self.kv,
                                        fused=self.kernels)
        self.logits_buf[:rows].copy_(logits)

    @torch.no_grad()  # also when called directly: in-place LoRA add on a custom-Function output
    def _decode_forward(self, rows: int, window: int) -> None:
        """The same step through `Transformer.forward` (reference path)."""
        for cache in self.caches:
            cache.window = window
        logits = self.model(self.tok_in[:rows, None], position_ids=self.pos_in[:rows],
                            attention_mask=self.valid[:rows, :window], cache_position=self.slot, logits_to_keep=1)
        self.logits_buf[:rows].copy_(logits[:, -1])

    def decode_eager(self, rows: int, window: int) -> None:
        (self._decode_step if self.fused else self._decode_forward)(rows, window)

    def decode(self, rows: int, window: int) -> None:
        """One decode step for cache rows :rows: the graph of (rows, window), captured on first use, or eagerly."""
        graph = self.graphs.get((rows, window))
        if graph is None and self.use_graphs:
            graph = self._capture(rows, window)
        if graph is None:
            self.decode_eager(rows, window)
        else:
            graph.replay()

    def _capture(self, rows: int, window: int):
        return self._capture_fn((rows, window), lambda: self.decode_eager(rows, window))

    def _capture_fn(self, key: tuple, run):
        """Warm up (same inputs as the coming replay, so its cache writes are idempotent), then capture `run`."""
        if self._pool is None:
            self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # first launches compile Triton kernels and create cuBLAS handles
            run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                run()
        except Exception as e:  # e.g. a layer that syncs or copies from the host: run eagerly from now on
            log.warning("CUDA graph capture failed (%s: %s); decoding without graphs", type(e).__name__, e)
            self.use_graphs = False
            return None
        self.graphs[key] = graph
        self.stats["captures"] += 1
        return graph

    def window_of(self, slots: int) -> int:
        """The KV window attention reads while `slots` can hold tokens (every slot of the call with `exact`)."""
        return self.cap_slots if self.exact else min(self.cap_slots, round_up(slots, self.window))

    # ------------------------------------------------------------------------------------------------ rollout

    def _prefill(self, ids: Tensor, rows: int, prompt_len: int) -> None:
        window = self.window_of(prompt_len)
        chunk = rows if self.exact else max(1, self.prefill_tokens // prompt_len)
        positions = torch.arange(prompt_len, device=self.device)
        try:
            for r0 in range(0, rows, chunk):
                r1 = min(rows, r0 + chunk)
                for cache in self.caches:
                    cache.window, cache.row0 = window, r0
                logits = self.model(ids[r0:r1], attention_mask=self.valid[r0:r1, :window], cache_position=positions,
                                    logits_to_keep=1)
                self.logits_buf[r0:r1].copy_(logits[:, -1])
                del logits
        finally:
            for cache in self.caches:
                cache.row0 = 0

    def _prefill_once_per_prompt(self, ids: Tensor, valid: Tensor, rows: int, prompt_len: int) -> None:
        """Prefill each distinct row of `ids` once and copy its cache rows and logits to the rows that repeat it:
        GRPO samples every prompt group_size times (1/group_size of the prefill; what vLLM's prefix cache does for a
        group). The cache and logits equal a prefill of every row, up to the float rounding of a smaller batch.
        Padding rows (filler) are one more distinct row. self.valid[:rows] is `valid` afterwards."""
        unique, inverse = distinct_rows(ids)
        if len(unique) == rows:
            self._prefill(ids.to(self.device), rows, prompt_len)
            return
        unique_t = torch.tensor(unique)
        self.valid[:len(unique)].copy_(valid[unique_t])
        self._prefill(ids[unique_t].to(self.device), len(unique), prompt_len)
        inverse_t = torch.tensor(inverse, device=self.device)
        for cache in self.caches:  # distinct rows are in cache rows 0..U-1: spread them to all rows
            for t in (cache.k, cache.v):
                t[:rows, :, :prompt_len] = t[:len(unique), :, :prompt_len][inverse_t]
        self.logits_buf[:rows] = self.logits_buf[:len(unique)][inverse_t]
        self.valid[:rows].copy_(valid)

    @torch.no_grad()
    def prepare(self, batch_size: int, prompt_len: int, max_new_tokens: int, all_buckets: bool = False,
                prefill_rows: int | None = None) -> None:
        """Allocate and capture ahead of time (benchmarks call it; rollouts allocate on demand): a prefill of the
        bucket's rows, or of `prefill_rows` (a rollout prefills each distinct prompt once), which compiles the
        prefill kernels, and the decode graphs of every window the run will reach, for the batch's bucket (and
        every smaller bucket with `all_buckets`). Leaves garbage in the cache, which every rollout overwrites or
        masks."""
        model, was_training = self.model, self.model.training
        model.eval()
        try:
            self._install(batch_size, prompt_len + max_new_tokens)
            rows = self.bucket(batch_size)
            self.valid[:rows].fill_(True)
            self.pos_in[:rows] = prompt_len - 1
            prefill = min(rows, prefill_rows or rows)
            self._prefill(torch.zeros(prefill, prompt_len, dtype=torch.long, device=self.device), prefill, prompt_len)
            buckets = batch_buckets(rows, self.min_bucket) if all_buckets else [rows]
            windows = sorted({self.window_of(prompt_len + s + 1) for s in range(max_new_tokens)})
            for b in sorted(buckets):
                for w in windows:
                    self.slot.fill_(w - 1)
                    if self.use_graphs and (b, w) not in self.graphs:
                        self._capture(b, w)
                    elif not self.use_graphs:
                        self.decode_eager(b, w)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            self._uninstall()
            model.train(was_training)
        self._signature_after_run()

    @torch.no_grad()
    def generate(self, tokenizer: Any, prompts: list[str] | list[list[int]], max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, stop_strings: Sequence[str] = (),
                 eos_token_ids: Sequence[int] | None = None, seed: int | None = None,
                 generator: torch.Generator | None = None, progress: bool = False,
                 row_seeds: Sequence[int] | None = None, drafts: Any = None,
                 logits_processor: LogitsProcessor | None = None, groups: Sequence[int] | None = None,
                 groups_needed: int | None = None) -> Rollout:
        """Sample up to `max_new_tokens` per prompt (greedy when temperature == 0).

        Text prompts are tokenized without adding special tokens (they carry their chat template). Rows stop at an
        EOS id (default: the model config's and the tokenizer's), at the first of `stop_strings` appearing in the
        decoded completion, or at the length limit. `seed` (or an explicit `generator` on the model's device) makes
        the samples reproducible; without either, the global RNG is used. `row_seeds` (one per prompt, instead of
        `seed`) gives every row its own generator (`sampling.random_source`). `progress`: a token bar.

        `drafts`: where speculative decoding drafts from: a `qerl.rollout.drafts.DraftHistory` (the run's earlier
        completions; this call's are added to it at the end), or None (the call's own prompts and rows), or any
        object with a `DraftSession`'s `propose` and `extend` for these prompts.
        `logits_processor(logits, rows, positions)`: changes fp32 logits [N, V] in place before every draw; rows [N]
        are the call's rows (>= the number of prompts: padding), positions [N] the completion index being drawn (a
        benchmark forces EOS at set lengths with it, so that the engine's own bookkeeping ends the rows).
        `groups` (the group of each prompt row) with `groups_needed`: stop at the first host check (every
        `check_every` steps; each step of the speculative tail) where at least `groups_needed` groups have all their
        rows finished, and keep `groups_needed` of them (the earliest finished, then the lowest first row); every row
        of the other groups gets stop reason "cut" with the tokens it had (over-provisioned rollouts, APRIL). The
        kept rows are what the call without `groups` samples, given `row_seeds` (a row's draws are its own)."""
        plan = self._plan(tokenizer, prompts, max_new_tokens, temperature, top_p, top_k, stop_strings, eos_token_ids,
                          seed, generator, progress, row_seeds, drafts, logits_processor, groups, groups_needed, ())
        if max_new_tokens == 0:
            return _nothing_sampled(plan)
        with self._running(plan) as call:
            call.run()
            out = call.result()
        if plan.history is not None:  # later calls draft from these (the final, cut completions)
            for prompt, completion, reason in zip(out.prompt_ids, out.completion_ids, out.stop_reasons):
                if reason != "cut":  # a dropped group's row: not one of the run's completions
                    plan.history.add(prompt, completion)
        return out

    def open(self, tokenizer: Any, prompts: list[str] | list[list[int]], max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, stop_strings: Sequence[str] = (),
             eos_token_ids: Sequence[int] | None = None, seed: int | None = None,
             generator: torch.Generator | None = None, row_seeds: Sequence[int] | None = None, drafts: Any = None,
             logits_processor: LogitsProcessor | None = None, groups: Sequence[int] | None = None,
             groups_needed: int | None = None, carried: Sequence[Row] = (), tools: ToolStop | None = None):
        """A call to drive between host checks (`generate` runs one to its end): a context manager giving a
        `rollout_call.RolloutCall` whose `advance`, `pause`, `resume`, `hand_back` and `result` the caller uses
        while the engine's caches are installed. Arguments as `generate`'s; `carried`: rows an earlier call handed
        back (`RolloutCall.hand_back`), continued after the prompts' rows (they need `row_seeds` for those);
        `tools`: rows pause themselves at a tool call's closing tag (`qerl.rollout.multi_turn` drives such a call;
        no speculation then: drafts would not know the tools' tokens)."""
        plan = self._plan(tokenizer, prompts, max_new_tokens, temperature, top_p, top_k, stop_strings, eos_token_ids,
                          seed, generator, False, row_seeds, drafts, logits_processor, groups, groups_needed, carried,
                          tools)
        if plan.settings.max_new == 0:
            raise ValueError("nothing to sample: max_new_tokens is 0 and no carried row has tokens left")
        if tools is not None and (groups is not None or carried):  # a cut or a hand-back while rows wait for tools
            raise ValueError("a call with tools takes neither groups (a group cut) nor carried rows")
        return self._running(plan)

    def _plan(self, tokenizer, prompts, max_new_tokens, temperature, top_p, top_k, stop_strings, eos_token_ids, seed,
              generator, progress, row_seeds, drafts, logits_processor, groups, groups_needed,
              carried: Sequence[Row], tools: ToolStop | None = None) -> "_Plan":
        """The checked arguments of a call as its settings, its rows (the prompts', then `carried`), its one
        generator (without `row_seeds`) and its group cut."""
        stop_strings = check_sampling_args(max_new_tokens, temperature, top_p, top_k, stop_strings, tokenizer,
                                           seed, generator)
        prompt_ids = encode_prompts(tokenizer, prompts)
        generator = random_source(self.device, len(prompt_ids), seed, generator, row_seeds)
        if carried and prompt_ids and row_seeds is None:
            raise ValueError("carried rows draw from their own generators: the prompts with them need row_seeds")
        rows = fresh_rows(prompt_ids, max_new_tokens, generator if row_seeds is not None else None, row_seeds)
        rows += [dataclasses.replace(r, index=len(prompt_ids) + i) for i, r in enumerate(carried)]
        eos = list(eos_token_ids) if eos_token_ids is not None else default_eos_ids(self.model, tokenizer)
        if (groups is None) != (groups_needed is None) or (groups is not None and len(groups) != len(rows)):
            raise ValueError("groups (one per prompt) and groups_needed go together")
        cut = GroupCut(groups, groups_needed) if groups is not None else None
        history = drafts if self.speculative and isinstance(drafts, DraftHistory) else None
        session = (DraftSession(history, [r.context for r in rows]) if history is not None or drafts is None
                   else drafts) if self.speculative and tools is None else None
        settings = CallSettings(
            tokenizer=tokenizer, max_new=max([max_new_tokens] + [r.budget for r in carried]), eos=set(eos),
            stop_strings=stop_strings, temperature=temperature, top_p=top_p, top_k=top_k, filler=eos[0] if eos else 0,
            drafts=session, logits_processor=logits_processor, max_draft=self.max_draft,
            prompt_len=max((len(r.context) for r in rows), default=0), progress=progress,
            stop_early=cut.observe if cut is not None else None, tools=tools)
        return _Plan(settings, rows, generator if row_seeds is None else None, cut, history)

    @contextlib.contextmanager
    def _running(self, plan: "_Plan"):
        """The call of `plan` with the caches installed and the model in eval mode (dropout off: graphs must not
        bake in a training-mode RNG draw) and no autograd; put back after."""
        model, was_training = self.model, self.model.training
        model.eval()
        try:
            # speculation: room for a verify step's queries past the last token
            self._install(len(plan.rows), plan.settings.prompt_len + plan.settings.max_new
                          + (MAX_QUERIES if self.speculative else 0))
            with torch.no_grad():
                yield RolloutCall(self, plan.settings, plan.rows, plan.generator, plan.cut)
        finally:
            self._uninstall()
            model.train(was_training)
        self._signature_after_run()

    def prefill_call(self, rows: list[Row | None], settings: CallSettings) -> None:
        """Load a call's rows into cache rows :len(rows) (None: padding): left-padded contexts, their positions, done
        flags and call rows; prefill each distinct context once, its next-token logits into logits_buf."""
        width, batch, prompt_len = len(rows), sum(r is not None for r in rows), settings.prompt_len
        ids = torch.full((width, prompt_len), settings.filler, dtype=torch.long)
        valid = torch.zeros((width, self.cap_slots), dtype=torch.bool)
        for i, r in enumerate(rows):
            if r is not None:
                ids[i, prompt_len - len(r.context):] = torch.tensor(r.context)
                valid[i, prompt_len - len(r.context):prompt_len] = True
        valid[:, prompt_len:] = True  # generated slots: causality hides them until written
        self.valid[:width].copy_(valid)
        self.pos_in[:width, 0].copy_(torch.tensor([len(r.context) if r is not None else 0 for r in rows]) - 1)
        self.done[:width].copy_(torch.tensor([r is None for r in rows]))
        self.row_map[:width].copy_(torch.tensor([r.index if r is not None else batch for r in rows]))
        self._prefill_once_per_prompt(ids, valid, width, prompt_len)

    @torch.no_grad()
    def extend_rows(self, rows: Sequence[tuple[int, list[int], int, int]]) -> int:
        """For each (slot, tokens, write, position): write `tokens` into cache row `slot` at slots write.. (RoPE
        positions position..), attending to what the row holds: rows resumed after a tool call, prefilled from
        their caches (the model's own forward, eager). The rows go through one forward: its cost is the host's
        launches, whatever its rows (BENCHMARKS.md, "The owed GPU chain": 90-150 ms on a 7B for 1 to 64 rows), so
        tool turns ready together cost one. Each row's shorter turn is padded at slots past its own tokens, which
        its next decode steps overwrite before they attend to them. The exact engine extends one row per forward:
        which rows meet in a batch depends on the tools' timing, and the batch's shape would reach the rounding.
        Returns the forwards it ran."""
        if self.exact:
            for one in rows:
                self._extend([one])
            return len(rows)
        if rows:
            self._extend(list(rows))
        return 1 if rows else 0

    def _extend(self, rows: list[tuple[int, list[int], int, int]]) -> None:
        width = max(len(tokens) for _, tokens, _, _ in rows)
        window = self.window_of(max(write + len(tokens) for _, tokens, write, _ in rows))
        ids = torch.tensor([tokens + [tokens[-1]] * (width - len(tokens)) for _, tokens, _, _ in rows])
        offsets = torch.arange(width)
        slots = torch.tensor([write for _, _, write, _ in rows])[:, None] + offsets
        slots = slots.clamp(max=self.cap_slots - 1)  # padding past the cache's end: its last slot, unread garbage
        positions = torch.tensor([position for _, _, _, position in rows])[:, None] + offsets
        one = len(rows) == 1  # one row: a view of its cache row (row0); several: their rows by index (copies)
        cache_rows = torch.tensor([slot for slot, _, _, _ in rows], device=self.device)
        for cache in self.caches:
            cache.window = window
            cache.row0, cache.rows = (rows[0][0], None) if one else (0, cache_rows)
        try:
            self.model(ids.to(self.device), position_ids=positions.to(self.device),
                       attention_mask=self.valid[cache_rows, :window],
                       cache_position=(slots[0] if one else slots).to(self.device), logits_to_keep=1)
        finally:
            for cache in self.caches:
                cache.row0, cache.rows = 0, None

    def verify_inputs(self, live: list[Row], drafts: list[list[int]], rows: int, queries: int,
                      prompt_len: int, waiting: Sequence[Row] = ()) -> None:
        """Load a verify step's inputs for cache rows :rows: each live row's last token and drafts at its own slots
        and positions; finished rows feed filler at slots that hold generated tokens (harmless); rows `waiting` for
        a tool feed it at their own slots from `write` on, which hold nothing of theirs yet."""
        n = rows * queries
        self._spec_buffers(n)
        host = torch.zeros(3, rows, queries, dtype=torch.long)
        host[2] = prompt_len + torch.arange(queries)
        for r in waiting:
            host[1, r.slot] = r.position + torch.arange(queries)
            host[2, r.slot] = r.write + torch.arange(queries)
        for r, d in zip(live, drafts):
            host[0, r.slot, 0] = r.last
            host[0, r.slot, 1:1 + len(d)] = torch.tensor(d, dtype=torch.long)
            host[1, r.slot] = r.position + torch.arange(queries)
            host[2, r.slot] = r.write + torch.arange(queries)
        host = host.view(3, n).to(self.device)
        self.spec_tok[:n].copy_(host[0])
        self.spec_pos[:n, 0].copy_(host[1])
        self.spec_slot[:n].copy_(host[2])

    def verify_step(self, rows: int, queries: int, slots: int) -> Tensor:
        """The verify forward (graph-captured on CUDA) for cache rows :rows, `queries` tokens each, attention over
        the window holding `slots`; fp32 logits [rows * queries, V]."""
        window = self.window_of(slots)
        key = ("verify", rows, window, queries)
        graph = self.graphs.get(key)
        run = lambda: self._verify_eager(rows, window, queries)  # noqa: E731
        if graph is None and self.use_graphs:
            graph = self._capture_fn(key, run)
        if graph is None:
            run()
        else:
            graph.replay()
        self.stats["verify_steps"] += 1
        return self.spec_logits[:rows * queries]

    def _verify_eager(self, rows: int, window: int, queries: int) -> None:
        n = rows * queries
        slots = self.spec_slot[:n]
        attend = self.valid[:rows, :window].repeat_interleave(queries, 0) & (self.key_slots[:window] <= slots[:, None])
        logits = self.model.decode_step(self.spec_tok[:n], self.spec_pos[:n], slots, attend, self.kv,
                                        fused=self.kernels, queries_per_row=queries)
        self.spec_logits[:n].copy_(logits)

    def _spec_buffers(self, n: int) -> None:
        """The verify step's static inputs and logits for n query rows (graphs that read smaller ones dropped)."""
        if n <= self.spec_cap:
            return
        n = max(n, self.bucket(self.speculative_rows) * MAX_QUERIES)
        dev, vocab = self.device, self.model.config.vocab_size
        self.spec_tok = torch.zeros(n, dtype=torch.long, device=dev)
        self.spec_pos = torch.zeros(n, 1, dtype=torch.long, device=dev)
        self.spec_slot = torch.zeros(n, dtype=torch.long, device=dev)
        self.spec_logits = torch.zeros(n, vocab, dtype=torch.float32, device=dev)
        self.graphs = {k: g for k, g in self.graphs.items() if k[0] != "verify"}
        self.spec_cap = n

    def record(self, live: int) -> None:
        """A point of the timeline (when recording): live rows from now on, and when (a CUDA event or the clock)."""
        if self.timeline is None:
            return
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        else:
            event = time.perf_counter()
        self.timeline.append((live, event))

    def move_rows(self, order: list[int], new_rows: int) -> None:
        """Cache rows `order` to the front, as rows :new_rows: their KV and static inputs gathered (compaction)."""
        idx = torch.tensor(order, dtype=torch.long, device=self.device)
        for cache in self.caches:
            cache.k[:new_rows] = cache.k.index_select(0, idx)
            cache.v[:new_rows] = cache.v.index_select(0, idx)
        for buf in (self.tok_in, self.pos_in, self.valid, self.done, self.row_map):
            buf[:new_rows] = buf.index_select(0, idx)
        self.stats["compactions"] += 1


def _check_options(model: Any, check_every: int, window: int, exact: bool, use_graphs: bool | None,
                   kv_cache_dtype: str | None, speculative: str, speculative_rows: int, max_draft: int) -> None:
    """The engine's options, refused before anything is built."""
    if not isinstance(model, Transformer):
        raise TypeError(f"RolloutEngine needs a qerl.model.transformer.Transformer, got {type(model).__name__}")
    if check_every < 1 or window < 1:
        raise ValueError("check_every and window must be >= 1")
    if exact and use_graphs:
        raise ValueError("exact shapes change from call to call: a CUDA graph cannot replay them (use_graphs)")
    if kv_cache_dtype not in (None, "model", "fp8"):  # None: the model's execution plan's
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}: expected model or fp8")
    if speculative not in ("off", "on", "auto"):
        raise ValueError(f"unknown speculative {speculative!r}: expected off, on or auto")
    if not 1 <= max_draft < MAX_QUERIES or speculative_rows < 1:
        raise ValueError(f"max_draft must be in [1, {MAX_QUERIES - 1}] and speculative_rows >= 1")


class _Plan(NamedTuple):
    settings: CallSettings
    rows: list[Row]
    generator: Any  # the call's one generator (None with row_seeds, or for the global RNG)
    cut: GroupCut | None
    history: DraftHistory | None  # where the call's completions are added (speculative calls drafting from one)


def fresh_rows(prompt_ids: list[list[int]], max_new: int, generators: Sequence[torch.Generator] | None,
               row_seeds: Sequence[int] | None) -> list[Row]:
    """A call's rows for its prompts: with `row_seeds` each its own generator, kernel seed and verify key."""
    if row_seeds is None:
        return [Row(index=i, prompt=ids, key=0, budget=max_new) for i, ids in enumerate(prompt_ids)]
    return [Row(index=i, prompt=ids, key=(s % 2**63) ^ 0x5DEECE66D, budget=max_new, generator=g, seed=s % 2**63)
            for i, (ids, g, s) in enumerate(zip(prompt_ids, generators, row_seeds))]


def _nothing_sampled(plan: _Plan) -> Rollout:
    """A call of 0 new tokens: empty completions (length, or cut for the groups a group cut drops)."""
    rows, tokenizer, dropped = plan.rows, plan.settings.tokenizer, set()
    if plan.cut is not None:
        plan.cut.observe([])
        dropped = plan.cut.dropped()
    return Rollout([r.prompt for r in rows], [[] for _ in rows], [decode_ids(tokenizer, []) for _ in rows],
                   [torch.zeros(0) for _ in rows], ["cut" if r.index in dropped else "length" for r in rows])

# ---------------------------------------------------------------------------------------------------- functions


def engine_for(model: Transformer, **kwargs) -> RolloutEngine:
    """The engine attached to `model` (created with `kwargs` on first use), so repeated calls reuse its graphs."""
    engine = model.__dict__.get(_ENGINE_ATTR)
    if engine is None:
        engine = RolloutEngine(model, **kwargs)
        object.__setattr__(model, _ENGINE_ATTR, engine)  # a plain attribute, not a submodule
    return engine


def release_engine(model: Transformer) -> None:
    """Free the KV cache and graphs of the engine attached to `model` (e.g. before a memory-hungry phase)."""
    engine = model.__dict__.pop(_ENGINE_ATTR, None)
    if engine is not None:
        engine.free()


def generate_fast(model: Any, tokenizer: Any, prompts: list[str] | list[list[int]], max_new_tokens: int,
                  temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, stop_strings: Sequence[str] = (),
                  eos_token_ids: Sequence[int] | None = None, seed: int | None = None,
                  generator: torch.Generator | None = None, progress: bool = False,
                  row_seeds: Sequence[int] | None = None) -> Rollout:
    """`RolloutEngine.generate` on the model's engine (`engine_for`: graphs and KV cache kept between calls)."""
    return engine_for(model).generate(tokenizer, prompts, max_new_tokens, temperature=temperature, top_p=top_p,
                                      top_k=top_k, stop_strings=stop_strings, eos_token_ids=eos_token_ids, seed=seed,
                                      generator=generator, progress=progress, row_seeds=row_seeds)
