"""The NVFP4 linear and quantizer that run anywhere: qerl's Triton kernels (nvfp4.py, Hopper-tuned) where they can
run, the PyTorch references (reference.py) elsewhere.

  nvfp4_linear(x, weight_packed, weight_scale, weight_global_scale, bias=None) -> y   (autograd: dx only)
  nvfp4_quantize(w, global_scale=None) -> (weight_packed, weight_scale, weight_global_scale)
  available() -> bool: Triton imported and a CUDA device is present.
Importing never fails without CUDA or Triton: the functions then run the references. (The quantized linear layer
runs its GEMMs through gemm.py's backends instead; this module is the kernels' plain entry, for tests and benchmarks.)
"""

from __future__ import annotations

import torch

from .reference import grad_input_ref, linear_ref, quantize_ref

try:
    from . import nvfp4 as _impl
except Exception as _e:  # no triton, or a broken install: references only
    _impl = None
    IMPORT_ERROR: Exception | None = _e
else:
    IMPORT_ERROR = None

__all__ = ["available", "nvfp4_linear", "nvfp4_quantize", "linear_ref", "grad_input_ref", "quantize_ref"]


def available() -> bool:
    return _impl is not None and torch.cuda.is_available()


def _kernel_ok(t: torch.Tensor) -> bool:
    return _impl is not None and (t.is_cuda or (t.device.type == "cpu" and _impl.interpreting()))


def nvfp4_linear(x, weight_packed, weight_scale, weight_global_scale, bias=None):
    """y = x @ W^T (+ bias) for x [..., K] bf16/fp16; fused-dequant kernels forward and for dx."""
    if _kernel_ok(x) and x.dtype in (torch.bfloat16, torch.float16):
        return _impl.nvfp4_linear(x, weight_packed, weight_scale, weight_global_scale, bias)
    return linear_ref(x, weight_packed, weight_scale, weight_global_scale, bias)


def nvfp4_quantize(w, global_scale=None):
    """Bit-exact with qerl.quant.nvfp4.quantize; returns (weight_packed, weight_scale, weight_global_scale)."""
    if _kernel_ok(w):
        return _impl.quantize(w, global_scale)
    return quantize_ref(w, global_scale)
