"""Launchers, shape dispatch, optional autotuning and the autograd function for the NVFP4 kernels.

Needs triton (imported by nvfp4_ops.py only inside a guard). Tensors must be on CUDA, or on the CPU
with TRITON_INTERPRET=1 set before the kernel module was imported (tests).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import torch
import triton

from . import _triton_nvfp4 as _tk

log = logging.getLogger(__name__)


def interpreting() -> bool:
    """Whether the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_tk.nvfp4_fwd_kernel, triton.runtime.JITFunction)


@dataclasses.dataclass(frozen=True)
class Config:
    """One launch configuration. For "fwd": block_m = tokens, block_n = weight rows, block_k = reduction;
    for "bwd": block_m = tokens, block_n = reduction (weight rows), block_k = output columns (K)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False
    split_k: int | None = None  # None: chosen from the shape to fill the GPU
    group_m: int = 8
    x_mode: str = "tile"  # fwd, how x meets W's tile column order: "pre" (one copy per call), "gather", "tile"


    def short(self) -> str:
        s = f"x{self.x_mode} {'swap ' if self.swap_ab else ''}{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps}s{self.num_stages}"
        return s + (f" sk{self.split_k}" if self.split_k else "")


# Decode (M <= 64): swap-AB, weights on the MMA's 64-row side, block_m = next_pow2(M) >= 16 (set at launch).
DECODE_CONFIGS = [
    Config(16, 64, 256, 4, 3, swap_ab=True),
    Config(16, 128, 128, 4, 3, swap_ab=True),
    Config(16, 128, 128, 8, 4, swap_ab=True),
    Config(16, 64, 128, 4, 4, swap_ab=True),
]
# Prefill / training forward (large M): dequant cost per weight tile is amortized over block_m tokens; 4-warp
# tiles leave room for 2 CTAs per SM, so one CTA's dequant overlaps the other's tensor-core work.
PREFILL_CONFIGS = [
    Config(128, 128, 64, 4, 3, x_mode="pre"),
    Config(128, 128, 64, 4, 3, swap_ab=True, x_mode="pre"),
    Config(128, 256, 64, 8, 3, swap_ab=True, x_mode="pre"),
    Config(256, 128, 64, 8, 3, x_mode="pre"),
    Config(64, 128, 64, 4, 4, x_mode="pre"),
]
# Backward dx = dy @ W (block_n = reduction over weight rows, block_k = output columns).
BWD_CONFIGS = [
    Config(128, 64, 128, 8, 4),
    Config(128, 128, 128, 8, 3),
    Config(128, 64, 128, 4, 3),
    Config(64, 64, 128, 4, 4),
    Config(128, 64, 256, 8, 3),
]

DECODE_MAX_M = 64
_SM_COUNT: dict[int, int] = {}
_COUNTERS: dict[str, torch.Tensor] = {}
_TUNED: dict[tuple, Config] = {}
TUNE_LOG: dict[tuple, list[tuple[str, float]]] = {}  # key -> [(config, ms)], filled by the autotuner

def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Split-K tile counters: zeroed once, then reset by the kernel itself (graph-capture friendly).
    One buffer per device: concurrent split-K launches on different streams would race on it."""
    key = str(device)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def _m_bucket(m: int) -> int:
    return min(triton.next_power_of_2(max(m, 1)), 8192)


def _split_k(tiles: int, k_iters: int, sms: int, full: int) -> int:
    """Enough (tile, k-slice) programs for ~3 per SM unless `full` tiles already keep the GPU busy;
    never an empty slice."""
    if tiles >= full:
        return 1
    split = max(1, min(k_iters, 32, triton.cdiv(3 * sms, tiles)))
    return triton.cdiv(k_iters, triton.cdiv(k_iters, split))


def _resolve_fwd(cfg: Config, M: int, N: int, K: int, device) -> Config:
    if cfg.swap_ab and M <= DECODE_MAX_M:
        cfg = dataclasses.replace(cfg, block_m=max(16, triton.next_power_of_2(M)))
    if cfg.split_k is None:
        tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
        sms = _num_sms(device)
        full = 2 * sms if cfg.swap_ab else sms  # decode tiles are short: want more of them
        cfg = dataclasses.replace(cfg, split_k=_split_k(tiles, triton.cdiv(K, cfg.block_k), sms, full))
    return cfg


def _heuristic_fwd(M: int, N: int, K: int) -> Config:
    if M <= DECODE_MAX_M:
        return DECODE_CONFIGS[0]
    if M <= 256:
        return PREFILL_CONFIGS[4]
    return PREFILL_CONFIGS[2]


def _heuristic_bwd(M: int, N: int, K: int) -> Config:
    return BWD_CONFIGS[0] if M > 64 else Config(max(16, min(64, triton.next_power_of_2(M))), 64, 128, 4, 3)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _tune(key: tuple, candidates: list[Config], run) -> Config:
    from triton.testing import do_bench, do_bench_cudagraph

    results = []
    for cfg in candidates:
        try:
            asm = _ASM_OK
            run(cfg, asm)
            try:  # graph replay: host launch overhead would otherwise swamp 10-us kernels
                ms = do_bench_cudagraph(lambda: run(cfg, asm), rep=15, return_mode="median")
            except Exception:
                ms = do_bench(lambda: run(cfg, asm), warmup=3, rep=15, return_mode="median")
        except Exception as e:  # e.g. a config that needs more shared memory than the GPU has
            ms = float("inf")
            log.debug("nvfp4 %s %s failed: %s: %s", key, cfg.short(), type(e).__name__, e)
        results.append((cfg, ms))
    best = min(results, key=lambda r: r[1])[0]
    TUNE_LOG[key] = [(c.short(), ms) for c, ms in results]
    return best


# Autotuned winners for Qwen2.5-7B/32B layer shapes on an H200 (benchmarks/bench_kernels.py --tune writes
# them), keyed by (kind, M bucket, N, K); other M use the nearest tuned bucket above, other shapes _heuristic_*.
_TABLE: dict[tuple[str, int, int, int], Config] = {  # (us: do_bench with L2 flush, H200, 2026-11-22)
    ("fwd", 1, 4608, 3584): Config(16, 64, 128, 4, 4, swap_ab=True, split_k=8),  # 13.1 us
    ("fwd", 16, 4608, 3584): Config(16, 64, 256, 4, 3, swap_ab=True, split_k=4),  # 13.9 us
    ("fwd", 64, 4608, 3584): Config(16, 128, 128, 8, 4, swap_ab=True, split_k=8),  # 23.6 us
    ("fwd", 256, 4608, 3584): Config(128, 128, 64, 4, 3, swap_ab=True, x_mode="pre"),  # 57.6 us
    ("fwd", 2048, 4608, 3584): Config(128, 256, 64, 8, 3, swap_ab=True, x_mode="pre"),  # 222.9 us
    ("fwd", 8192, 4608, 3584): Config(128, 256, 64, 8, 3, swap_ab=True, x_mode="pre"),  # 718.2 us
    ("bwd", 2048, 4608, 3584): Config(128, 64, 128, 4, 3),  # 175.9 us
    ("fwd", 1, 3584, 3584): Config(16, 128, 128, 8, 4, swap_ab=True, split_k=12),  # 14.0 us
    ("fwd", 16, 3584, 3584): Config(16, 128, 128, 8, 4, swap_ab=True, split_k=12),  # = M=1 pick (do_bench mis-pick)
    ("fwd", 64, 3584, 3584): Config(16, 64, 128, 4, 4, swap_ab=True, split_k=1),  # 32.6 us
    ("fwd", 256, 3584, 3584): Config(64, 128, 64, 4, 4, x_mode="pre"),  # 60.8 us
    ("fwd", 2048, 3584, 3584): Config(128, 128, 64, 4, 3, swap_ab=True, x_mode="pre"),  # 167.6 us
    ("fwd", 8192, 3584, 3584): Config(128, 256, 64, 8, 3, swap_ab=True, x_mode="pre"),  # 585.1 us
    ("bwd", 2048, 3584, 3584): Config(128, 64, 128, 4, 3),  # 157.1 us
    ("fwd", 1, 37888, 3584): Config(16, 64, 256, 4, 3, swap_ab=True, split_k=1),  # 43.5 us
    ("fwd", 16, 37888, 3584): Config(16, 64, 256, 4, 3, swap_ab=True, split_k=1),  # 42.0 us
    ("fwd", 64, 37888, 3584): Config(16, 128, 128, 8, 4, swap_ab=True, split_k=2, x_mode="pre"),  # 78.3 us
    ("fwd", 256, 37888, 3584): Config(128, 256, 64, 8, 3, swap_ab=True, x_mode="pre"),  # 231.3 us
    ("fwd", 2048, 37888, 3584): Config(256, 128, 64, 8, 3, x_mode="pre"),  # 1338.1 us
    ("fwd", 8192, 37888, 3584): Config(128, 256, 64, 8, 3, swap_ab=True, x_mode="pre"),  # 5172.9 us
    ("bwd", 2048, 37888, 3584): Config(128, 64, 128, 4, 3),  # 1416.0 us
    ("fwd", 1, 3584, 18944): Config(16, 64, 256, 4, 3, swap_ab=True, split_k=12),  # 27.7 us
    ("fwd", 16, 3584, 18944): Config(16, 64, 256, 4, 3, swap_ab=True, split_k=12),  # 29.1 us
    ("fwd", 64, 3584, 18944): Config(16, 128, 128, 8, 4, swap_ab=True, split_k=4, x_mode="pre"),  # 45.7 us
    ("fwd", 256, 3584, 18944): Config(128, 128, 64, 4, 3, swap_ab=True, x_mode="pre"),  # 156.9 us
    ("fwd", 2048, 3584, 18944): Config(256, 128, 64, 8, 3, x_mode="pre"),  # 863.9 us
    ("fwd", 8192, 3584, 18944): Config(128, 256, 64, 8, 3, swap_ab=True, x_mode="pre"),  # 2944.8 us
    ("bwd", 2048, 3584, 18944): Config(128, 64, 128, 4, 3),  # 726.5 us
    ("fwd", 1, 7168, 5120): Config(16, 64, 256, 4, 3, swap_ab=True, split_k=2),  # 18.2 us
    ("fwd", 16, 7168, 5120): Config(16, 64, 256, 4, 3, swap_ab=True, split_k=2),  # 18.8 us
    ("fwd", 64, 7168, 5120): Config(16, 64, 256, 4, 3, swap_ab=True, split_k=1, x_mode="pre"),  # 31.3 us
    ("fwd", 256, 7168, 5120): Config(128, 128, 64, 4, 3, swap_ab=True, x_mode="pre"),  # 92.4 us
    ("fwd", 2048, 7168, 5120): Config(128, 256, 64, 8, 3, swap_ab=True, x_mode="pre"),  # 431.0 us
    ("fwd", 8192, 7168, 5120): Config(128, 256, 64, 8, 3, swap_ab=True, x_mode="pre"),  # 1527.1 us
    ("bwd", 2048, 7168, 5120): Config(128, 64, 128, 4, 3),  # 407.9 us
    ("fwd", 1, 5120, 5120): Config(16, 64, 256, 4, 3, swap_ab=True, split_k=4),  # 15.9 us
    ("fwd", 16, 5120, 5120): Config(16, 64, 256, 4, 3, swap_ab=True, split_k=4),  # 16.2 us
    ("fwd", 64, 5120, 5120): Config(16, 64, 256, 4, 3, swap_ab=True, split_k=1, x_mode="pre"),  # 27.4 us
    ("fwd", 256, 5120, 5120): Config(128, 128, 64, 4, 3, swap_ab=True, x_mode="pre"),  # 76.9 us
    ("fwd", 2048, 5120, 5120): Config(128, 256, 64, 8, 3, swap_ab=True, x_mode="pre"),  # 326.6 us
    ("fwd", 8192, 5120, 5120): Config(128, 256, 64, 8, 3, swap_ab=True, x_mode="pre"),  # 1121.8 us
    ("bwd", 2048, 5120, 5120): Config(128, 64, 128, 4, 3),  # 329.9 us
    ("fwd", 1, 55296, 5120): Config(16, 64, 256, 4, 3, swap_ab=True, split_k=1),  # 72.5 us
    ("fwd", 16, 55296, 5120): Config(16, 64, 256, 4, 3, swap_ab=True, split_k=1),  # 75.1 us
    ("fwd", 64, 55296, 5120): Config(16, 128, 128, 8, 4, swap_ab=True, split_k=1, x_mode="pre"),  # 128.3 us
    ("fwd", 256, 55296, 5120): Config(128, 256, 64, 8, 3, swap_ab=True, x_mode="pre"),  # 432.8 us
    ("fwd", 2048, 55296, 5120): Config(128, 256, 64, 8, 3, swap_ab=True, x_mode="pre"),  # 2655.8 us
    ("fwd", 8192, 55296, 5120): Config(128, 256, 64, 8, 3, swap_ab=True, x_mode="pre"),  # 10671.9 us
    ("bwd", 2048, 55296, 5120): Config(128, 64, 128, 4, 3),  # 3023.5 us
    ("fwd", 1, 5120, 27648): Config(16, 64, 256, 4, 3, swap_ab=True, split_k=8),  # 43.6 us
    ("fwd", 16, 5120, 27648): Config(16, 64, 256, 4, 3, swap_ab=True, split_k=8),  # 44.6 us
    ("fwd", 64, 5120, 27648): Config(16, 128, 128, 8, 4, swap_ab=True, split_k=8, x_mode="pre"),  # 86.5 us
    ("fwd", 256, 5120, 27648): Config(128, 128, 64, 4, 3, swap_ab=True, x_mode="pre"),  # 248.9 us
    ("fwd", 2048, 5120, 27648): Config(128, 256, 64, 8, 3, swap_ab=True, x_mode="pre"),  # 1758.8 us
    ("fwd", 8192, 5120, 27648): Config(128, 128, 64, 4, 3, swap_ab=True, x_mode="pre"),  # 5742.0 us
    ("bwd", 2048, 5120, 27648): Config(128, 64, 128, 4, 3),  # 1363.0 us
}
_TABLE_MS = (1, 16, 64, 256, 2048, 8192)


def _table(kind: str, M: int, N: int, K: int) -> Config | None:
    mb = next((b for b in _TABLE_MS if b >= M), _TABLE_MS[-1])
    if kind == "bwd":
        mb = 2048 if M > 64 else mb
    return _TABLE.get((kind, mb, N, K))


def _pick(kind: str, M: int, N: int, K: int, dtype: torch.dtype, run, autotune: bool) -> Config:
    """A launch config: one timed before (`autotune`), else the tuned table's, else the heuristic's. `autotune`:
    benchmark the candidate configs the first time each (kind, M bucket, N, K, dtype) is seen."""
    key = (kind, _m_bucket(M), N, K, dtype)
    cfg = _TUNED.get(key)
    if cfg is not None:
        return cfg
    if autotune and not interpreting() and not _capturing():
        cfg = _tune(key, _candidates(kind, M, N, K), run)
        _TUNED[key] = cfg
        return cfg
    cfg = _table(kind, M, N, K) if not interpreting() else None
    if cfg is not None:
        return cfg
    return _heuristic_fwd(M, N, K) if kind == "fwd" else _heuristic_bwd(M, N, K)


def permute_x_cols(x2: torch.Tensor, block_k: int) -> torch.Tensor:
    """x [M, K] -> the kernels' tile column order (column 8g + j of each block_k tile moves to
    j * block_k/8 + g, see _triton_nvfp4._dequant); one copy kernel, K % block_k == 0."""
    M, K = x2.shape
    return x2.view(M, K // block_k, block_k // 8, 8).transpose(2, 3).reshape(M, K)


def _candidates(kind: str, M: int, N: int, K: int) -> list[Config]:
    """What the autotuner times: the config lists, decode ones at every useful split-K (a runtime
    argument: no extra compiles), with each way of putting x in tile column order."""
    if kind == "bwd":
        return BWD_CONFIGS if M > 64 else [_heuristic_bwd(M, N, K)]
    if M > DECODE_MAX_M:
        return PREFILL_CONFIGS
    out = []
    for c in DECODE_CONFIGS:
        k_iters = triton.cdiv(K, c.block_k)
        splits = [s for s in (1, 2, 4, 8, 12, 16) if s == 1 or 2 * s <= k_iters]
        for sk in splits:
            for mode in ("tile", "pre", "gather") if M <= 16 else ("tile", "pre"):
                out.append(dataclasses.replace(c, split_k=sk, x_mode=mode))
    return out


def _check_weight(packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor) -> tuple[int, int]:
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise ValueError(f"weight_packed must be 2-D uint8, got {packed.dtype} {tuple(packed.shape)}")
    N, K = packed.shape[0], packed.shape[1] * 2
    if K % 16:
        raise ValueError(f"NVFP4 needs K % 16 == 0, got K={K}")
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (N, K // 16):
        raise ValueError(f"weight_scale must be float8_e4m3fn [{N}, {K // 16}], got {scale.dtype} {tuple(scale.shape)}")
    if gs.numel() != 1 or gs.dtype != torch.float32:
        raise ValueError(f"weight_global_scale must be one float32, got {gs.dtype} {tuple(gs.shape)}")
    return N, K


_ASM_OK = True


def _launch(run, cfg: Config, use_asm: bool | None) -> None:
    """Inline-PTX dequant by default on GPUs; if this Triton cannot build it, warn once and use the
    plain-Triton decode (same exact values, more instructions)."""
    global _ASM_OK
    asm = (_ASM_OK and not interpreting()) if use_asm is None else use_asm
    if not asm:
        return run(cfg, False)
    try:
        run(cfg, True)
    except Exception as e:  # CompilationError, or ptxas rejecting the PTX
        if use_asm is not None:
            raise
        warnings.warn(f"NVFP4 inline-PTX dequant failed to compile ({type(e).__name__}: {e}); "
                      "using the plain-Triton decode")
        _ASM_OK = False
        run(cfg, False)


def linear_forward(x2, packed, scale, gs, bias=None, *, out=None, config: Config | None = None,
                   use_asm: bool | None = None, autotune: bool = False) -> torch.Tensor:
    """y[M, N] = x2[M, K] @ W^T (+ bias) for a 2-D x2 with unit stride along K (`autotune`: `_pick`'s)."""
    N, K = _check_weight(packed, scale, gs)
    M = x2.shape[0]
    if x2.shape[1] != K or x2.stride(1) != 1:
        raise ValueError(f"x must be [M, {K}] with unit stride along K, got {tuple(x2.shape)} {x2.stride()}")
    if x2.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"x must be bf16 or fp16, got {x2.dtype}")
    y = torch.empty(M, N, dtype=x2.dtype, device=x2.device) if out is None else out
    if M == 0:
        return y
    words = packed.contiguous().view(torch.int32)
    sbytes = scale.contiguous().view(torch.uint8)
    gs = gs.reshape(1)
    bias = bias.contiguous() if bias is not None else None

    def run(cfg: Config, asm: bool = True) -> None:
        cfg = _resolve_fwd(cfg, M, N, K, x2.device)
        tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
        mode = cfg.x_mode if (cfg.x_mode != "pre" or K % cfg.block_k == 0) else "gather"
        xk = permute_x_cols(x2, cfg.block_k) if mode == "pre" else x2
        if cfg.split_k > 1:
            ws = torch.empty(cfg.split_k * M * N, dtype=torch.float32, device=x2.device)
            cnt = _counters(x2.device, tiles)
        else:
            ws = cnt = y  # unused
        _tk.nvfp4_fwd_kernel[(tiles, cfg.split_k)](
            xk, words, sbytes, gs, bias if bias is not None else y, y, ws, cnt,
            M, N, K, xk.stride(0), y.stride(0), words.stride(0), sbytes.stride(0), cfg.split_k,
            HAS_BIAS=bias is not None, SWAP_AB=cfg.swap_ab, SPLIT=cfg.split_k > 1,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            EVEN_K=K % cfg.block_k == 0, USE_ASM=asm, X_MODE={"pre": 0, "gather": 1, "tile": 2}[mode],
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    _launch(run, config or _pick("fwd", M, N, K, x2.dtype, run, autotune), use_asm)
    return y


def grad_input(dy2, packed, scale, gs, *, out=None, config: Config | None = None,
               use_asm: bool | None = None, autotune: bool = False) -> torch.Tensor:
    """dx[M, K] = dy2[M, N] @ W, W dequantized tile by tile in registers (never materialized; `autotune`:
    `_pick`'s)."""
    N, K = _check_weight(packed, scale, gs)
    M = dy2.shape[0]
    if dy2.shape[1] != N or dy2.stride(1) != 1:
        raise ValueError(f"dy must be [M, {N}] with unit stride along N, got {tuple(dy2.shape)} {dy2.stride()}")
    if dy2.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dy must be bf16 or fp16, got {dy2.dtype}")
    dx = torch.empty(M, K, dtype=dy2.dtype, device=dy2.device) if out is None else out
    if M == 0:
        return dx
    words = packed.contiguous().view(torch.int32)
    sbytes = scale.contiguous().view(torch.uint8)
    gs = gs.reshape(1)

    def run(cfg: Config, asm: bool = True) -> None:
        grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(K, cfg.block_k),)
        _tk.nvfp4_bwd_kernel[grid](
            dy2, words, sbytes, gs, dx, M, N, K, dy2.stride(0), dx.stride(0), words.stride(0), sbytes.stride(0),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            EVEN_K=K % cfg.block_k == 0, USE_ASM=asm,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    _launch(run, config or _pick("bwd", M, N, K, dy2.dtype, run, autotune), use_asm)
    return dx


def dequantize(packed, scale, gs, dtype=torch.bfloat16, *, use_asm: bool | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """W [N, K] in dtype from NVFP4, one Triton pass (vs ~10 PyTorch kernels in the codec's dequantize);
    into `out` ([N, K], contiguous) if given."""
    N, K = _check_weight(packed, scale, gs)
    out = torch.empty(N, K, dtype=dtype, device=packed.device) if out is None else out
    words = packed.contiguous().view(torch.int32)
    sbytes = scale.contiguous().view(torch.uint8)
    block_c = 256 if K % 256 == 0 else 128

    def run(cfg, asm: bool = True) -> None:
        _tk.nvfp4_dequant_kernel[(triton.cdiv(N, 32), triton.cdiv(K, block_c))](
            words, sbytes, gs.reshape(1), out, N, K, words.stride(0), sbytes.stride(0),
            BLOCK_R=32, BLOCK_C=block_c, USE_ASM=asm, num_warps=4)

    _launch(run, None, use_asm)
    return out


def quantize(w: torch.Tensor, global_scale: torch.Tensor | None = None):
    """(weight_packed, weight_scale, weight_global_scale), bit-exact with qerl.quant.nvfp4.quantize."""
    from qerl.quant import nvfp4 as codec  # lazy: qerl.quant may import this package

    if w.ndim != 2 or not w.is_floating_point():
        raise ValueError(f"NVFP4 quantizes 2-D float weights, got {w.dtype} {tuple(w.shape)}")
    N, K = w.shape
    codec.check_shape(N, K)
    w = w.detach()
    if w.stride(1) != 1:
        w = w.contiguous()
    obs_bf16 = w.dtype == torch.bfloat16
    if global_scale is None:
        obs = w if w.dtype in (torch.bfloat16, torch.float32) else w.float()
        amax = torch.maximum(obs.max(), -obs.min())  # == |w|.amax() without an |w|-sized temporary
        if not torch.isfinite(amax):
            raise ValueError(f"weight of shape [{N}, {K}] has a NaN/Inf")
        global_scale = codec.global_scale_for(amax)
    gs = global_scale.to(device=w.device, dtype=torch.float32).reshape(1)
    packed = torch.empty(N, K // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(N, K // 16, dtype=torch.uint8, device=w.device)
    block_r, block_c = 16, 128
    grid = (triton.cdiv(N, block_r), triton.cdiv(K, block_c))
    _tk.nvfp4_quant_kernel[grid](
        w, gs, packed, scales, N, K, w.stride(0),
        BLOCK_R=block_r, BLOCK_C=block_c, OBS_BF16=obs_bf16, num_warps=4,
    )
    return packed, scales.view(torch.float8_e4m3fn), gs


class NVFP4LinearFunction(torch.autograd.Function):
    """y = x @ W^T + b with frozen NVFP4 W: forward and dx both run fused-dequant kernels; W gets no grad."""

    @staticmethod
    def forward(ctx, x, packed, scale, gs, bias):
        K = packed.shape[1] * 2
        x2 = x.reshape(-1, K)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        y = linear_forward(x2, packed, scale, gs, bias)
        ctx.save_for_backward(packed, scale, gs)
        ctx.bias_grad = bias is not None and ctx.needs_input_grad[4]
        return y.reshape(*x.shape[:-1], packed.shape[0])

    @staticmethod
    def backward(ctx, dy):
        packed, scale, gs = ctx.saved_tensors
        dy2 = dy.reshape(-1, packed.shape[0])
        if dy2.stride(1) != 1:
            dy2 = dy2.contiguous()
        dx = db = None
        if ctx.needs_input_grad[0]:
            dx = grad_input(dy2, packed, scale, gs).reshape(*dy.shape[:-1], packed.shape[1] * 2)
        if ctx.bias_grad:
            db = dy2.float().sum(0).to(dy.dtype)
        return dx, None, None, None, db


def nvfp4_linear(x, weight_packed, weight_scale, weight_global_scale, bias=None):
    return NVFP4LinearFunction.apply(x, weight_packed, weight_scale, weight_global_scale, bias)
