"""The most memory a benchmark arm held on the GPU, as nvidia-smi counts it (bench_peers.py, bench_grpo_step.py)."""
from __future__ import annotations

import os
import sys


class DevicePeak:
    """The most memory a benchmark arm held on the GPU: PyTorch's allocator, vLLM's own pool, the CUDA context, all
    of it, as nvidia-smi counts it. PyTorch's peak misses what vLLM allocates itself (its weights and KV cache live in its
    sleep-mode pool), and vLLM's `gpu_memory_utilization` is only its ceiling: this is what both sides of a colocated
    step add up to. Read through NVML (nvidia-ml-py, on the GPU image and a vLLM dependency) by a thread every `every`
    seconds: NVML is not the CUDA runtime, so the thread cannot disturb a CUDA graph being captured in the arm (a
    CUDA call from another thread during a global-mode capture invalidates it). Counted from what the device held
    when the arm began, before its CUDA context (the machine runs one arm at a time)."""

    def __init__(self, every: float = 0.02):
        import threading

        import pynvml

        pynvml.nvmlInit()
        visible = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)
        self._used = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used
        self.every, self._stop = every, threading.Event()
        self.start = self.peak = self._used()
        self._thread = threading.Thread(target=self._run, name="device-peak", daemon=True)
        self._thread.start()

    @classmethod
    def begin(cls, who: str) -> "DevicePeak | None":
        """A sampler, or None where NVML cannot be read (said on stderr in one line, as `who`): the arm runs without
        the figure."""
        try:
            return cls()
        except Exception as e:  # noqa: BLE001 -- pynvml missing, or no NVML library: the figure only
            text = str(e).strip().splitlines()
            print(f"{who}: no device memory figure ({type(e).__name__}: {text[0][:400] if text else ''})",
                  file=sys.stderr)
            return None

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, self._used())

    def stop(self) -> float:
        """Stops sampling; the peak over the start, in GiB."""
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._used())
        return (self.peak - self.start) / 2**30
