"""PyTorch references for the NVFP4 kernels (what each kernel must reproduce), built on the project codec."""

from __future__ import annotations

import torch.nn.functional as F


def _codec():
    from qerl.quant import nvfp4  # lazy: qerl.quant may import this package

    return nvfp4


def linear_ref(x, weight_packed, weight_scale, weight_global_scale, bias=None):
    """Dequantize-then-matmul: the plain-PyTorch path the fused kernel replaces (also the CPU fallback)."""
    w = _codec().dequantize(weight_packed, weight_scale, weight_global_scale, dtype=x.dtype)
    return F.linear(x, w, bias)


def grad_input_ref(dy, weight_packed, weight_scale, weight_global_scale):
    """dx = dy @ W with W dequantized to dy's dtype."""
    return dy @ _codec().dequantize(weight_packed, weight_scale, weight_global_scale, dtype=dy.dtype)


def quantize_ref(w, global_scale=None):
    """(weight_packed, weight_scale, weight_global_scale) from the codec's quantizer."""
    d = _codec().quantize(w, global_scale)
    return d["weight_packed"], d["weight_scale"], d["weight_global_scale"]


def weight_fp64(weight_packed, weight_scale, weight_global_scale):
    """The exact weight the format encodes, in float64 (test oracle: no intermediate rounding)."""
    nv = _codec()
    vals = nv.decode_packed(weight_packed).double()
    eff = weight_scale.double() / weight_global_scale.double().reshape(())
    return (vals.unflatten(-1, (-1, 16)) * eff.unsqueeze(-1)).flatten(-2)
