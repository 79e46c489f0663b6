"""Weight formats behind one interface: ``get_codec(scheme)`` for "nvfp4", "mxfp4", "nf4", "fp8", "bf16".

A codec turns a dense [N, K] weight into named tensors (the names used in checkpoints and as
QuantLinear buffers) and back. The byte layouts live in the per-format modules; this module only
adapts them to a common protocol so the layer and the checkpoint writer never special-case a format.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from qerl.quant import fp8_channel, mxfp4, nf4, nvfp4

__all__ = ["Codec", "TensorSpec", "get_codec", "SCHEMES", "SERVABLE_SCHEMES", "scheme_for_compressed_tensors"]

TensorSpec = tuple[tuple[int, ...], torch.dtype]


@runtime_checkable
class Codec(Protocol):
    """A weight storage format."""

    scheme: str
    block_size: int  # weights along K sharing one scale (1 = no blocks)
    bits_per_weight: float  # nominal bits per weight: code + block scales (per-tensor scalars excluded)
    compressed_tensors_format: str | None  # the compressed-tensors "format" this layout equals, if any
    compressed_tensors_weights: Mapping[str, Any] | None  # its quantization_config "weights" entry, if any
    # its "input_activations" entry: None (weight-only, A16) or how the engine quantizes activations (FP8_DYNAMIC)
    compressed_tensors_input_activations: Mapping[str, Any] | None
    servable: bool  # vLLM and transformers read this layout (compressed-tensors or dense)
    # Fused projections (q/k/v, gate/up) share one per-tensor global scale, so vLLM can fuse them. A codec that
    # says so also has tensor_amax(w), global_scale_for(amax) and quantize(w, global_scale).
    shares_global_scale: bool
    gpu_kernel: bool  # QuantLinear computes it with our CUDA GEMMs (kernels/gemm.py weight_gemm), not by dequantizing
    fp8_copy: bool  # quant.fp8_weights applies: a resident FP8 copy beside the stored codes (NVFP4)

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Dense [N, K] weight -> named tensors (see tensor_shapes)."""
        ...

    def dequantize(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Named tensors -> dense [N, K] weight in dtype."""
        ...

    def tensor_shapes(self, n: int, k: int) -> dict[str, TensorSpec]:
        """Name -> (shape, dtype) of every stored tensor of an [n, k] weight."""
        ...

    def check_shape(self, n: int, k: int, name: str = "weight") -> None:
        """Raise ValueError naming `name` and its shape if [n, k] cannot use this format."""
        ...


class _Codec:
    scheme = ""
    block_size = 1
    bits_per_weight = 16.0
    compressed_tensors_format: str | None = None
    compressed_tensors_weights: Mapping[str, Any] | None = None
    compressed_tensors_input_activations: Mapping[str, Any] | None = None
    servable = False
    shares_global_scale = False
    gpu_kernel = False
    fp8_copy = False

    def check_shape(self, n: int, k: int, name: str = "weight") -> None:
        if k % self.block_size:
            raise ValueError(
                f"{name}: shape [{n}, {k}] cannot be {self.scheme}-quantized: in_features {k} is not a "
                f"multiple of the block size {self.block_size}"
            )

    def _take(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The codec's tensors from a mapping, with a clear error for missing ones."""
        missing = [name for name in self.tensor_shapes(1, self.block_size) if name not in tensors]
        if missing:
            raise KeyError(f"{self.scheme} weight needs tensor(s) {missing}, got {sorted(tensors)}")
        return {name: tensors[name] for name in self.tensor_shapes(1, self.block_size)}

    def tensor_shapes(self, n: int, k: int) -> dict[str, TensorSpec]:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<codec {self.scheme}: {self.bits_per_weight:.3f} bits/weight, block {self.block_size}>"


class NVFP4Codec(_Codec):
    scheme = "nvfp4"
    block_size = nvfp4.BLOCK
    bits_per_weight = 4 + 8 / nvfp4.BLOCK
    compressed_tensors_format = "nvfp4-pack-quantized"
    compressed_tensors_weights = {  # what llm-compressor + compressed-tensors serialize for NVFP4A16
        "num_bits": 4, "type": "float", "symmetric": True, "group_size": nvfp4.BLOCK, "strategy": "tensor_group",
        "dynamic": False, "scale_dtype": "torch.float8_e4m3fn", "actorder": None, "block_structure": None,
        "observer_kwargs": {}}
    servable = True
    shares_global_scale = True
    gpu_kernel = True
    fp8_copy = True

    def tensor_shapes(self, n: int, k: int) -> dict[str, TensorSpec]:
        return {
            "weight_packed": ((n, k // 2), torch.uint8),
            "weight_scale": ((n, k // nvfp4.BLOCK), torch.float8_e4m3fn),
            "weight_global_scale": ((1,), torch.float32),
        }

    def quantize(self, w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return nvfp4.quantize(w, global_scale)

    def tensor_amax(self, w: torch.Tensor) -> torch.Tensor:
        return nvfp4.tensor_amax(w)

    def global_scale_for(self, amax: torch.Tensor) -> torch.Tensor:
        return nvfp4.global_scale_for(amax)

    def dequantize(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        t = self._take(tensors)
        return nvfp4.dequantize(t["weight_packed"], t["weight_scale"], t["weight_global_scale"], dtype)


class MXFP4Codec(_Codec):
    scheme = "mxfp4"
    block_size = mxfp4.BLOCK
    bits_per_weight = 4 + 8 / mxfp4.BLOCK
    compressed_tensors_format = "mxfp4-pack-quantized"
    compressed_tensors_weights = {  # what llm-compressor + compressed-tensors serialize for MXFP4A16
        "num_bits": 4, "type": "float", "symmetric": True, "group_size": mxfp4.BLOCK, "strategy": "group",
        "dynamic": False, "scale_dtype": "torch.uint8", "actorder": None, "block_structure": None,
        "observer_kwargs": {}}
    servable = True

    def tensor_shapes(self, n: int, k: int) -> dict[str, TensorSpec]:
        return {
            "weight_packed": ((n, k // 2), torch.uint8),
            "weight_scale": ((n, k // mxfp4.BLOCK), torch.uint8),
        }

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return mxfp4.quantize(w)

    def dequantize(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        t = self._take(tensors)
        return mxfp4.dequantize(t["weight_packed"], t["weight_scale"], dtype)


class NF4Codec(_Codec):
    scheme = "nf4"
    block_size = nf4.BLOCK
    bits_per_weight = 4 + 8 / nf4.BLOCK + 32 / (nf4.BLOCK * nf4.ABSMAX_GROUP)

    def tensor_shapes(self, n: int, k: int) -> dict[str, TensorSpec]:
        return nf4.tensor_shapes(n, k)

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return nf4.quantize(w)

    def dequantize(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return nf4.dequantize(**self._take(tensors), dtype=dtype)


class FP8Codec(_Codec):
    """E4M3 weights, one FP32 scale per output channel (qerl.quant.fp8_channel): 8 bits a weight, half bf16's bytes,
    on FP8 tensor cores with per-token activation scales (kernels/fp8_gemm.py; vLLM's W8A8 FP8)."""

    scheme = "fp8"
    bits_per_weight = 8.0  # + 32 bits per output row (not per block: excluded, as the per-tensor scalars)
    compressed_tensors_format = "float-quantized"
    # what llm-compressor + compressed-tensors serialize for the FP8_DYNAMIC preset: weights static per channel,
    # activations dynamic per token (the engine quantizes them; nothing is stored for them)
    compressed_tensors_weights = {
        "num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "channel",
        "dynamic": False, "actorder": None, "block_structure": None, "observer_kwargs": {}}
    compressed_tensors_input_activations = {
        "num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "token",
        "dynamic": True, "actorder": None, "block_structure": None, "observer_kwargs": {}}
    servable = True
    gpu_kernel = True

    def tensor_shapes(self, n: int, k: int) -> dict[str, TensorSpec]:
        return fp8_channel.tensor_shapes(n, k)

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return fp8_channel.quantize(w)

    def dequantize(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        t = self._take(tensors)
        return fp8_channel.dequantize(t["weight"], t["weight_scale"], dtype)


class BF16Codec(_Codec):
    """Identity: the weight stays a dense bf16 ``weight`` (the baseline every scheme is compared to)."""

    scheme = "bf16"
    servable = True

    def tensor_shapes(self, n: int, k: int) -> dict[str, TensorSpec]:
        return {"weight": ((n, k), torch.bfloat16)}

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        if w.ndim != 2 or not w.is_floating_point():
            raise ValueError(f"bf16 stores 2-D float weights, got {w.dtype} {tuple(w.shape)}")
        return {"weight": w.detach().to(torch.bfloat16)}

    def dequantize(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return self._take(tensors)["weight"].to(dtype)


# The one list of schemes: config validation (quant_schemes), the CLI's choices and any per-layer override name these.
_CODECS: dict[str, Codec] = {c.scheme: c for c in (NVFP4Codec(), MXFP4Codec(), NF4Codec(), FP8Codec(), BF16Codec())}
SCHEMES = tuple(_CODECS)
SERVABLE_SCHEMES = tuple(s for s, c in _CODECS.items() if c.servable)


def get_codec(scheme: str) -> Codec:
    """The codec for a scheme name (case-insensitive): one of SCHEMES."""
    codec = _CODECS.get(str(scheme).lower())
    if codec is None:
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    return codec


def scheme_for_compressed_tensors(fmt: str | None) -> str | None:
    """The scheme whose layout is the compressed-tensors format `fmt`, or None."""
    return next((s for s, c in _CODECS.items() if fmt is not None and c.compressed_tensors_format == fmt), None)
