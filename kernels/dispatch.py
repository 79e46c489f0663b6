"""Which NVFP4 GEMM backend runs each (kind, layer shape, M bucket): measured on the GPU it runs on, cached on disk.

Backends (kernels/gemm.py runs them): "triton" (our fused-dequant kernel; for an FP8 base kernels/fp8_w8a16.py),
"humming" (humming-kernels' GEMM), "gluon" (our warp-specialized decode GEMM, M <= 64), "dequant_cublas" (our
one-pass dequantize into a reused scratch buffer, then cuBLAS), in the FP8 update only "dequant_fp8" (the same into
FP8, then `_scaled_mm`) and, outside the update for a layer with a resident FP8 copy of its weight, "fp8_weight"
(`_scaled_mm` on that copy; for an FP8 base, kernels/fp8_gemm.py, on its stored weight).
Which of them a layer can use depends on the layout its one weight copy is in.
Before any measurement a shape-generic default picks one (`default_backend`); the first time a key is seen outside
CUDA-graph capture, every candidate is timed by graph replay and the winner is kept in memory and in a cache file,
keyed by GPU name and library versions, so a process pays for each measurement once per machine. A corrupt or
stale cache file is ignored with one warning. A `Dispatcher` (one per model: its `qerl.kernels.context.GemmContext`)
holds how it picks: `tuning` "measure" (the above), "defaults" (nothing timed) or "compile" (every candidate
run once, nothing measured: qerl.rl.precompile's workers, so each candidate's kernels get compiled for the process
that will measure them); `cache` moves the file.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

BACKENDS = ("triton", "humming", "gluon", "dequant_cublas", "dequant_fp8", "fp8_weight")
CACHE_VERSION = 1
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

TUNINGS = ("measure", "defaults", "compile")


def m_bucket(m: int) -> int:
    """Smallest bucket >= m (the last one for anything larger): one measurement serves a range of M."""
    return next((b for b in M_BUCKETS if b >= m), M_BUCKETS[-1])


def default_backend(kind: str, layout: str, m: int) -> str:
    """The pick before any measurement, from the measured shape of the trade-off (BENCHMARKS.md): small M is
    weight-bandwidth-bound (a 4-bit kernel wins), large M is tensor-core-bound (cuBLAS on bf16 wins)."""
    if layout.startswith("fp8"):  # an FP8 base (kernels/fp8_gemm.py): its codes are what FP8 tensor cores read
        return "fp8_weight"
    if layout.endswith("-fp8"):  # the FP8 update (qerl.kernels.gemm.update_precision)
        return "gluon" if kind == "fwd" and m <= 64 else "dequant_fp8"
    if layout.endswith("+fp8w"):  # a resident FP8 copy: it streams 1 byte per weight at FP8's tensor-core rate
        return default_backend(kind, layout.removesuffix("+fp8w"), m) if m <= 32 else "fp8_weight"
    if kind == "bwd":
        return "triton" if layout == "qerl" and m <= 64 else "dequant_cublas"
    if layout == "humming":
        return "humming" if m <= 128 else "dequant_cublas"
    if layout == "gluon":
        return "gluon" if m <= 64 else "dequant_cublas"
    return "triton" if m <= 64 else "dequant_cublas"


def default_cache_path() -> Path:
    return Path.home() / ".cache" / "qerl" / "gemm_dispatch.json"


@functools.cache
def environment_key() -> str:
    """GPU name and the versions that change kernel speed: a cache made elsewhere is never reused here."""
    import triton

    from . import humming_nvfp4

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"{gpu}|torch {torch.__version__}|triton {triton.__version__}|humming {humming_nvfp4.version()}"


def _load(path: Path) -> dict[str, str]:
    """The choices `path` holds for this environment ({} where it holds none, or cannot be read: said once)."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            raise ValueError(f"version {data.get('version') if isinstance(data, dict) else None!r}, "
                             f"expected {CACHE_VERSION}")
        entries = data.get("choices", {}).get(environment_key(), {})
        if not all(isinstance(k, str) and v in BACKENDS for k, v in entries.items()):
            raise ValueError("unknown backend names")
        return dict(entries)
    except (ValueError, OSError, AttributeError) as e:
        log.warning("ignoring GEMM dispatch cache %s (%s); it will be re-measured", path, e)
    return {}


def _save(path: Path, key: str, backend: str) -> None:
    """Merge one choice into the file (other environments' entries are kept); atomic rename."""
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION \
                or not isinstance(data.get("choices", {}), dict):
            data = {}  # unreadable: rewritten whole
    except (ValueError, OSError):
        data = {}
    data["version"] = CACHE_VERSION
    data.setdefault("choices", {}).setdefault(environment_key(), {})[key] = backend
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".gemm_dispatch.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home must not stop training
        log.warning("could not write GEMM dispatch cache %s: %s", path, e)


def _key(kind: str, layout: str, n: int, k: int, m: int) -> str:
    return f"{kind}|{layout}|{n}x{k}|m{m_bucket(m)}"


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Dispatcher:
    """One model's backend choices (module docstring): `tuning` one of TUNINGS, `cache` the file (None: the default
    under ~/.cache/qerl), read on first use."""

    def __init__(self, tuning: str = "measure", cache: str | Path | None = None):
        if tuning not in TUNINGS:
            raise ValueError(f"unknown GEMM tuning {tuning!r}: expected one of {', '.join(TUNINGS)}")
        self.tuning = tuning
        self.cache = Path(cache) if cache else default_cache_path()
        self._choices: dict[str, str] | None = None  # key -> backend, loaded lazily from disk

    def choose(self, kind: str, layout: str, n: int, k: int, m: int, candidates: dict[str, Callable[[], object]],
               timer: Callable[[Callable[[], object]], float] | None = None) -> str:
        """The backend for this call. `candidates` maps each backend this layer can run to a zero-argument call
        on inputs of this call's shape (used only if a measurement is made); `timer` returns seconds per call."""
        if self._choices is None:
            self._choices = _load(self.cache)
        choices = self._choices
        key = _key(kind, layout, n, k, m)
        pick = choices.get(key)
        if pick in candidates:
            return pick
        default = default_backend(kind, layout, m)
        if default not in candidates:
            default = next(iter(candidates))
        if self.tuning == "defaults" or len(candidates) == 1 or _capturing():
            return default
        compile_only = self.tuning == "compile"  # run each once so its kernels get compiled; time nothing
        timer = (lambda fn: (fn(), 0.0)[1]) if compile_only else timer or graph_time
        times = {}
        for name, fn in candidates.items():
            # A backend that fails here is not picked (out of shared memory; humming's shape asserts). In compile
            # mode too: a precompile worker that let it escape died, and its share went uncompiled.
            try:
                times[name] = timer(fn)
            except Exception as e:
                log.warning("GEMM backend %s cannot run %s (%s%s); the other backends are measured", name, key,
                            type(e).__name__, f": {e}" if str(e) else "")  # e.g. humming's shape asserts say nothing
        if not times:
            return default
        if compile_only:  # the default if it ran, else one that did (a worker died running a default that raised)
            pick = default if default in times else next(iter(times))
            choices[key] = pick  # this process only: it was not measured, so it is not saved
            return pick
        pick = min(times, key=times.get)
        log.info("GEMM %s: %s", key, ", ".join(f"{b} {t * 1e6:.1f} us" for b, t in sorted(times.items())))
        choices[key] = pick
        _save(self.cache, key, pick)
        return pick


def graph_time(fn: Callable[[], object], replays: int = 20) -> float:
    """Median seconds per call, replaying a CUDA graph of `fn` (launch overhead out of the way)."""
    from triton.testing import do_bench_cudagraph

    fn()
    return do_bench_cudagraph(fn, rep=max(replays, 10), return_mode="median") * 1e-3
