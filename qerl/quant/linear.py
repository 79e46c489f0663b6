"""QuantLinear: a frozen linear layer stored in a quantized format, and model-wide replacement.

The weight lives only as the codec's tensors (buffers named as in the checkpoint, so a quantized
state dict loads with ``load_state_dict``). There is no full-precision copy anywhere: the forward
dequantizes on the fly (or, on CUDA, runs the NVFP4 kernels or FP8 tensor cores: qerl.kernels.gemm) and the
backward dequantizes again instead of saving W, so activation memory holds only x, as for a frozen nn.Linear
under LoRA.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import re
import warnings
from collections.abc import Iterable, Mapping
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from qerl.quant.formats import SCHEMES, Codec, get_codec

__all__ = ["QuantLinear", "quantize_model", "replace_with_empty_quant_linears", "schemes_by_layer",
           "decoder_linear_names", "DECODER_LINEAR_PATTERN", "FUSED_GROUPS", "fused_group_key", "KEEP_DENSE"]

log = logging.getLogger(__name__)

# Linear layers inside decoder blocks ("model.layers.3.mlp.up_proj"); never embeddings or lm_head.
DECODER_LINEAR_PATTERN = r"(^|\.)layers\.\d+\."
# Projections an inference engine fuses into one GEMM (vLLM: qkv_proj, gate_up_proj). Fused NVFP4
# layers must share one global scale: vLLM keeps a single weight_global_scale for the fused layer.
FUSED_GROUPS = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"})
# A per-layer override (quantize_model's `layer_schemes`) to this scheme keeps the layer a dense nn.Linear.
KEEP_DENSE = "bf16"
# The frozen error correction (QuantLinear.set_error_correction) is stored in this dtype.
CORRECTION_DTYPE = torch.bfloat16


def fused_group_key(name: str) -> str | None:
    """'model.layers.0.self_attn.k_proj[.weight]' -> 'model.layers.0.self_attn.q_proj|k_proj|v_proj'."""
    parts = name.removesuffix(".weight").rsplit(".", 1)
    if len(parts) != 2:
        return None
    parent, leaf = parts
    for group in FUSED_GROUPS:
        if leaf in group:
            return parent + "." + "|".join(sorted(group))
    return None


@functools.cache
def _gpu_gemm() -> ModuleType | None:
    """qerl.kernels.gemm (NVFP4 GEMM backends, optional: needs Triton) if it imports, else None."""
    try:
        from qerl.kernels import gemm
    except ImportError:
        return None
    except Exception as e:  # a broken Triton install must not take the reference path down with it
        log.warning("qerl.kernels.gemm failed to import (%s); using the PyTorch reference path", e)
        return None
    return gemm


def fp8_available(device: torch.device | None = None) -> bool:
    """FP8 tensor cores and E4M3 conversions: a CUDA GPU (`device`, default the current one) of compute capability
    8.9 (Ada) or newer. What model.base_gemm: fp8, the FP8 weight copies and the FP8 KV cache need."""
    if device is None:
        if not torch.cuda.is_available():
            return False
        device = torch.device("cuda")
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


# quant.fp8_weights = auto keeps the FP8 copies where they take at most this share of the GPU's memory: a 7B's 7.1 GiB
# and a 14B's 13.7 GiB on an 80 GB GPU, never a 32B's 30.5 GiB (not even on 141 GB: its KV cache and update, which
# keep dequantized weights in the memory left, measured a 119 GiB peak there without the copies).
FP8_WEIGHTS_AUTO_SHARE = 0.2


def plan_fp8_weights(model: nn.Module, setting: bool | str, device: torch.device) -> bool:
    """Whether the model's NVFP4 layers keep a resident FP8 copy of their weights on the GPU (quant.fp8_weights:
    auto, true or false), marked on every such layer (the copies are made at each layer's first GPU forward; fused
    projections take the mark of their members when they are built: plan before `fuse_projections`).
    Only where FP8 tensor cores and our GPU kernels are; auto also only where the copies fit
    FP8_WEIGHTS_AUTO_SHARE of the GPU's memory. Returns the decision."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m.codec.fp8_copy]
    copy_bytes = sum(m.in_features * m.out_features for m in layers)  # one E4M3 byte per weight
    on = bool(layers) and setting is not False and _gpu_gemm() is not None and fp8_available(device)
    if on and setting == "auto":
        total = torch.cuda.get_device_properties(device).total_memory
        on = copy_bytes <= FP8_WEIGHTS_AUTO_SHARE * total
        log.info("quant.fp8_weights auto: %s (FP8 copies %.1f GiB, %.0f%% of the GPU's %.0f GiB; the limit is %.0f%%)",
                 "on" if on else "off", copy_bytes / 2**30, 100 * copy_bytes / total, total / 2**30,
                 100 * FP8_WEIGHTS_AUTO_SHARE)
    elif setting is True and not on and layers:
        warnings.warn("quant.fp8_weights = true needs a CUDA GPU with FP8 tensor cores (Ada, Hopper or newer) and "
                      "qerl's GPU kernels; the base keeps its 4-bit weights only", stacklevel=2)
    for m in layers:
        if m.fp8_weights != on and m._gemm is not None:
            m.release_gemm()  # made without (or with) the copy: the next GPU forward makes it as planned
        m.fp8_weights = on
    return on


class _DequantizedLinear(torch.autograd.Function):
    """y = x @ deq(W)^T, with grads to x only; backward re-dequantizes instead of saving W."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: "QuantLinear") -> torch.Tensor:
        ctx.layer = layer
        ctx.input_dtype = x.dtype
        return F.linear(x, layer.compute_weight(x.dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None
        w = ctx.layer.compute_weight(grad_out.dtype)
        return (grad_out @ w).to(ctx.input_dtype), None


EXACT_SVD_MAX_DIM = 1024  # a full SVD up to this smaller side (SmolLM2's projections); above, the randomized one


def truncated_svd(matrix: torch.Tensor, rank: int, oversample: int = 8, power_iterations: int = 4,
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-`rank` singular triplets (U [m, r], S [r], Vᵀ [r, n]) of an fp32 matrix. A full SVD of a 7B's
    18,944 x 3,584 gate projection takes seconds each, minutes for a model at every load, and computes 3,584
    triplets to keep 16: above EXACT_SVD_MAX_DIM, Halko et al.'s randomized range finder (a seeded Gaussian
    sketch of rank + oversample columns, `power_iterations` of (A Aᵀ) with re-orthonormalisation, then the SVD of
    the small projection): a few thin GEMMs, deterministic from the matrix and the seed (a resumed run rebuilds
    the same correction)."""
    if min(matrix.shape) <= EXACT_SVD_MAX_DIM or rank + oversample >= min(matrix.shape):
        u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
        return u[:, :rank], s[:rank], vh[:rank]
    generator = torch.Generator(device=matrix.device).manual_seed(seed)
    sketch = torch.randn(matrix.shape[1], rank + oversample, generator=generator, device=matrix.device)
    basis = torch.linalg.qr(matrix @ sketch).Q
    for _ in range(power_iterations):  # sharpen the spectrum: a quantization residual's is nearly flat
        basis = torch.linalg.qr(matrix @ torch.linalg.qr(matrix.t() @ basis).Q).Q
    u_small, s, vh = torch.linalg.svd(basis.t() @ matrix, full_matrices=False)
    return (basis @ u_small)[:, :rank], s[:rank], vh[:rank]


class QuantLinear(nn.Module):
    """Frozen linear layer whose weight is stored by a codec ("nvfp4", "mxfp4", "nf4", "fp8", "bf16").

    Buffers: the codec's tensors (e.g. ``weight_packed``, ``weight_scale``, ``weight_global_scale``)
    and ``bias`` if any; ``correction_a`` [out, r] and ``correction_b`` [r, in] where a frozen error correction is
    kept (``set_error_correction``; else None). It has no parameters: gradients flow to the input only.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        scheme: str,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        name: str = "QuantLinear",
    ) -> None:
        """Empty layer (buffers uninitialized) ready for ``load_state_dict``; `dtype` is the bias dtype
        and the default dequantization dtype. `name` only labels errors (e.g. a ragged in_features)."""
        super().__init__()
        codec = get_codec(scheme)
        codec.check_shape(out_features, in_features, name)
        self.in_features, self.out_features = in_features, out_features
        self.codec: Codec = codec
        # which layout holds the weight on a CUDA GPU (quant.gpu_layout; qerl.kernels.gemm.NVFP4Gemm's `layout`)
        self.gpu_layout = "auto"
        self.fp8_weights = False  # also keep a resident FP8 copy on the GPU (quant.fp8_weights; plan_fp8_weights)
        # the model's qerl.kernels.context.GemmContext (settings, update precision, held weights: qerl.execution.attach);
        # None: the GPU GEMM makes one of its own, with the defaults
        self.gemm_context = None
        self.dtype = dtype
        self.use_kernel = True  # False forces the PyTorch reference path (parity tests, debugging)
        # On CUDA, NVFP4 and FP8 layers hand their tensors to their qerl.kernels.gemm.weight_gemm at the first
        # forward; if it repacks them for another backend, that repacked copy is the only one kept (the buffers
        # become None).
        self._gemm = None
        self._dense_cache: tuple | None = None  # (dtype, [(stored tensor, version)], dense weight): compute_weight
        # (fused layer, first row): this layer is rows of a concatenation of its siblings (`concat`, used by
        # qerl.execution.fusion) and holds no tensors of its own: one copy of the weight, in the fused layer.
        self._rows_of: tuple[QuantLinear, int] | None = None
        for buffer_name, (shape, buffer_dtype) in codec.tensor_shapes(out_features, in_features).items():
            self.register_buffer(buffer_name, torch.empty(shape, dtype=buffer_dtype, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)
        self.register_buffer("correction_a", None)
        self.register_buffer("correction_b", None)

    @property
    def scheme(self) -> str:
        return self.codec.scheme

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, scheme: str, name: str = "QuantLinear", global_scale: torch.Tensor | None = None
    ) -> "QuantLinear":
        """Quantize an nn.Linear's weight (on its device). `global_scale`: NVFP4 only, a shared scale."""
        out_features, in_features = linear.weight.shape
        dtype = linear.weight.dtype if linear.weight.is_floating_point() else torch.bfloat16
        layer = cls(in_features, out_features, linear.bias is not None, scheme, device="meta", dtype=dtype, name=name)
        weight = linear.weight.detach()
        if weight.is_meta:
            raise ValueError(f"{name}: cannot quantize a weight on the meta device (load it first)")
        if global_scale is not None:
            if not layer.codec.shares_global_scale:
                sharing = ", ".join(s for s in SCHEMES if get_codec(s).shares_global_scale)
                raise ValueError(f"{name}: global_scale applies to {sharing} only, not {layer.scheme}")
            tensors = layer.codec.quantize(weight, global_scale)
        else:
            tensors = layer.codec.quantize(weight)
        for buffer_name, tensor in tensors.items():
            setattr(layer, buffer_name, tensor)
        if linear.bias is not None:
            layer.bias = linear.bias.detach().clone()
        layer.gemm_context = getattr(linear, "gemm_context", None)  # the model's, where its plan gave it one
        return layer

    def _codec_names(self) -> list[str]:
        return list(self.codec.tensor_shapes(1, self.codec.block_size))

    def _row_names(self) -> list[str]:
        """The codec tensors with one slice per output row (the others, e.g. NVFP4's global scale, are per tensor)."""
        k = self.codec.block_size
        one, three = self.codec.tensor_shapes(1, k), self.codec.tensor_shapes(3, k)
        return [n for n in one if len(one[n][0]) and three[n][0][0] == 3 * one[n][0][0]]

    # -- fused siblings (q/k/v, gate/up): one layer, the members read their rows of it ---------------------------
    @classmethod
    def concat(cls, layers: list["QuantLinear"]) -> "QuantLinear | None":
        """One layer computing `layers` (same input) side by side: their tensors concatenated along the output
        rows, after which each member reads its rows of it and drops its own copy. None, and nothing changed,
        where they cannot share one layer (schemes, dtypes, devices, bias or a per-tensor scale differ, or they keep
        an error correction)."""
        first = layers[0]
        if any(m.scheme != first.scheme or m.in_features != first.in_features or m.dtype != first.dtype
               or (m.bias is None) != (first.bias is None) or m.correction_a is not None for m in layers):
            return None  # (an error correction per member is not one low-rank term of the fused layer)
        tensors = [m.quantized_tensors() for m in layers]
        rows = first._row_names()
        for name in first._codec_names():
            ref = tensors[0][name]
            if any(t[name].device != ref.device for t in tensors):
                return None
            if name not in rows and any(not torch.equal(t[name], ref) for t in tensors[1:]):
                return None  # e.g. NVFP4 global scales not shared: not one weight
        fused = cls(first.in_features, sum(m.out_features for m in layers), first.bias is not None, first.scheme,
                    device="meta", dtype=first.dtype, name="fused projection")
        for name in first._codec_names():
            fused._buffers[name] = torch.cat([t[name] for t in tensors]) if name in rows else tensors[0][name]
        if first.bias is not None:
            fused._buffers["bias"] = torch.cat([m.bias for m in layers])
        fused.use_kernel, fused.gpu_layout, fused.fp8_weights = first.use_kernel, first.gpu_layout, first.fp8_weights
        fused.gemm_context = first.gemm_context
        start = 0
        for m in layers:
            m._read_rows_of(fused, start)
            start += m.out_features
        return fused

    def _read_rows_of(self, fused: "QuantLinear", start: int) -> None:
        self._gemm = None  # its tensors are in `fused` now (a repacked GPU copy of them is dropped, not unpacked)
        self._dense_cache = None
        for name in self._codec_names():
            self._buffers[name] = None
        if self.bias is not None:
            self._buffers["bias"] = fused.bias[start:start + self.out_features]
        self._rows_of = (fused, start)

    @property
    def rows_of(self) -> "QuantLinear | None":
        """The fused layer whose rows this layer is (see `concat`), or None."""
        return None if self._rows_of is None else self._rows_of[0]

    def own_rows(self) -> None:
        """Take back a private copy of this layer's rows (before a move or a load); the fused layer stays for the
        other members until its group is rebuilt."""
        if self._rows_of is None:
            return
        tensors = {name: t.clone() for name, t in self.quantized_tensors().items()}
        bias = None if self.bias is None else self.bias.clone()
        self._rows_of = None
        for name, tensor in tensors.items():
            self._buffers[name] = tensor
        if bias is not None:
            self._buffers["bias"] = bias

    @property
    def _repacked(self) -> bool:
        """Whether the GPU backend holds the only copy of the weight (in its own layout; the buffers are None)."""
        return self._gemm is not None and self._buffers[self._codec_names()[0]] is None

    def quantized_tensors(self) -> dict[str, torch.Tensor]:
        """The codec's tensors by checkpoint name (without bias), in the checkpoint's layout."""
        if self._rows_of is not None:
            fused, start = self._rows_of
            rows = self._row_names()
            return {name: t[start:start + self.out_features] if name in rows else t
                    for name, t in fused.quantized_tensors().items()}
        if self._repacked:
            return self._gemm.canonical()  # rebuilt from the GPU backend's layout (exports, state dicts)
        return {name: getattr(self, name) for name in self._codec_names()}

    def cuda_gemm(self):
        """The GPU GEMM that runs this layer (qerl.kernels.gemm.weight_gemm: NVFP4Gemm, FP8Gemm), created on first
        use (an NVFP4 weight then repacked for the fastest backend)."""
        if self._gemm is None:
            self._gemm = _gpu_gemm().weight_gemm(self.scheme, self.quantized_tensors(), dtype=self.dtype,
                                                 layout=self.gpu_layout, fp8_weights=self.fp8_weights,
                                                 context=self.gemm_context)
            if self._gemm.repacked:  # one copy of the weight: drop ours
                for name in self._codec_names():
                    self._buffers[name] = None
        return self._gemm

    def set_gemm_context(self, context) -> None:
        """Run this layer's GPU GEMMs under `context` (its model's: qerl.execution.attach), from now on."""
        self.gemm_context = context
        if self._gemm is not None:
            self._gemm.context = context

    def release_gemm(self) -> None:
        """Back to the checkpoint layout in this layer's buffers (before a move, a load, or to free the GPU copy)."""
        if self._repacked:
            for name, tensor in self._gemm.canonical().items():
                self._buffers[name] = tensor
        self._gemm = None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._rows_of is not None:  # copies: a slice would keep the whole fused tensor alive (and shares memory)
            for name, tensor in self.quantized_tensors().items():
                destination[prefix + name] = tensor.clone()
        elif self._repacked:
            for name, tensor in self._gemm.canonical().items():
                destination[prefix + name] = tensor

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self.own_rows()  # the loaded rows are this layer's alone; its fused group rebuilds from them
        self.release_gemm()  # the loaded tensors replace the buffers; a stale GPU copy must not outlive them
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense [out, in] weight this layer computes with, in `dtype` (default: the layer's): the codec's
        weight, plus the error correction A·B where one is kept (so merged exports fold it in), summed in fp32 and
        rounded once to `dtype`."""
        if self.correction_a is None:
            return self.codec.dequantize(self.quantized_tensors(), dtype or self.dtype)
        w = self.codec.dequantize(self.quantized_tensors(), torch.float32)
        return w.addmm_(self.correction_a.float(), self.correction_b.float()).to(dtype or self.dtype)

    @torch.no_grad()
    def set_error_correction(self, weight: torch.Tensor, rank: int) -> None:
        """Keep a frozen rank-`rank` correction of this layer's quantization error: the truncated SVD of
        weight - dequant(Q(weight)) for the dense `weight` it was quantized from, as A = U√S [out, r] and
        B = √S Vᵀ [r, in] in bf16 (√S on both sides keeps both factors in bf16's comfortable range). Deterministic
        from `weight`, so a resumed run recomputes the same one. Buffers, never parameters: not trained, not in any
        optimizer, not in the LoRA adapter. rank 0 removes it."""
        self._dense_cache = None
        if rank <= 0:
            self.correction_a = self.correction_b = None
            return
        codes = self.codec.dequantize(self.quantized_tensors(), torch.float32)
        residual = weight.detach().to(codes.device, torch.float32) - codes
        u, s, vh = truncated_svd(residual, rank)
        root = s.sqrt()
        self.correction_a = (u * root).to(CORRECTION_DTYPE)
        self.correction_b = (root[:, None] * vh).to(CORRECTION_DTYPE)

    @property
    def correction_rank(self) -> int:
        return 0 if self.correction_a is None else self.correction_a.shape[1]

    def _corrections(self) -> dict[str, torch.Tensor]:
        if self.correction_a is None:
            return {}
        return {"correction_a": self.correction_a, "correction_b": self.correction_b}

    def _plus_correction(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + x Bᵀ Aᵀ: the error correction beside a GEMM that computes from the codes alone (the GPU kernels)."""
        if self.correction_a is None:
            return y
        b, a = self.correction_b.to(x.dtype), self.correction_a.to(x.dtype)
        return y + F.linear(F.linear(x, b), a).to(y.dtype)

    def compute_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight the reference path multiplies with. On CUDA it is dequantized afresh every call (the
        memory is the point of a 4-bit base there). Elsewhere (CPU) it is dequantized once and kept: re-decoding
        every weight at every forward and backward was a large share of a CPU training step, and a small model's
        dense copy costs little memory. The cache is keyed by the stored tensors themselves and their version
        counters, so an in-place write, a load_state_dict or a reassigned buffer re-dequantizes."""
        if self._gemm is not None:  # on CUDA (and maybe repacked): no need to rebuild the stored tensors to know it
            return self.dequantized_weight(dtype)
        stored = [*self.quantized_tensors().values(), *self._corrections().values()]
        if any(t.is_cuda for t in stored):
            return self.dequantized_weight(dtype)
        cache = self._dense_cache
        if cache is None or cache[0] != dtype or any(
                old is not now or version != now._version for (old, version), now in zip(cache[1], stored)):
            self._dense_cache = None  # free the stale copy before building the new one
            # holding the stored tensors in the key keeps their storage alive, so an address is never reused
            self._dense_cache = cache = (dtype, [(t, t._version) for t in stored], self.dequantized_weight(dtype))
        return cache[2]

    def weight_device(self) -> torch.device:
        """Where the weight lives (without rebuilding repacked or fused tensors)."""
        if self._rows_of is not None:
            return self._rows_of[0].weight_device()
        if self._repacked:
            return self._gemm.device
        return self._buffers[self._codec_names()[0]].device

    def weight_bits(self) -> int:
        """Bits stored for the weight (all codec tensors; bias excluded)."""
        return sum(t.numel() * t.element_size() * 8 for t in self.quantized_tensors().values())

    def _apply(self, fn, recurse: bool = True):
        """model.to(dtype) / .half() move the stored format but never recast it (an fp8 or fp32 scale cast
        to bf16 would silently change the weights); the bias and the default compute dtype follow."""
        if self._rows_of is not None:
            fused = self._rows_of[0]
            device = fused._gemm.device if fused._repacked else fused.weight_device()
            probe = torch.empty(0, dtype=torch.uint8, device=device)  # not floating: fn keeps its dtype
            if fn(probe) is probe and fn(torch.empty(0, dtype=self.dtype)).dtype == self.dtype:
                return self  # a no-op move (e.g. .to() the device it is on): stay fused
            self.own_rows()
        self.release_gemm()  # a device or dtype move starts from the checkpoint layout
        stored = {**self.quantized_tensors(), **self._corrections()}  # the correction stays bf16 too
        self._dense_cache = None
        super()._apply(fn, recurse)
        for name, original in stored.items():
            moved = self._buffers[name]
            if moved.dtype != original.dtype:
                self._buffers[name] = original.to(moved.device)
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QuantLinear expects input [..., {self.in_features}], got {tuple(x.shape)}")
        if self._rows_of is not None:  # alone (its group computes all members at once): the fused layer's rows
            fused, start = self._rows_of
            return fused(x)[..., start:start + self.out_features]
        if self._on_gpu_kernel(x):
            return self._plus_correction(x, _gpu_gemm().linear(x, self.cuda_gemm(), self.bias))
        out = _DequantizedLinear.apply(x, self)  # (its weight holds the correction: compute_weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def _on_gpu_kernel(self, x: torch.Tensor) -> bool:
        """Whether x goes through qerl.kernels.gemm (a CUDA input in bf16/fp16 to a codec with a GPU kernel, installed)."""
        return self.use_kernel and x.is_cuda and self.codec.gpu_kernel \
            and x.dtype in (torch.bfloat16, torch.float16) and _gpu_gemm() is not None

    def fp8_activations(self) -> bool:
        """Whether this layer's forwards outside the update may round their activations to E4M3 (an FP8 base on a
        GPU with FP8 tensor cores: qerl.kernels.fp8_gemm, unless its context keeps them in 16 bits:
        quant.fp8_activations false), which the bf16 update does not."""
        allowed = getattr(self.gemm_context, "fp8_activations", True)
        return allowed and self.scheme == "fp8" and self.use_kernel and _gpu_gemm() is not None \
            and fp8_available(self.weight_device())

    def plus_low_rank(self, x: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
        """self(x) + scale * h @ b^T for 2-D x (inference: LoRA's update, h = x A^T, b = B): on the GPU kernel's
        path through qerl.kernels.gemm.NVFP4Gemm.forward_low_rank (into the GEMM's epilogue where enabled), else one
        addmm."""
        if self._rows_of is None and self._on_gpu_kernel(x):
            x2 = x if x.stride(-1) == 1 else x.contiguous()
            y = self._plus_correction(x2, self.cuda_gemm().forward_low_rank(x2, h, b, scale))
            return y if self.bias is None else y + self.bias.to(y.dtype)
        return self(x).addmm_(h, b.t(), alpha=scale)

    def extra_repr(self) -> str:
        correction = f", correction_rank={self.correction_rank}" if self.correction_a is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"scheme={self.scheme}{correction}"


def decoder_linear_names(model: nn.Module) -> list[str]:
    """The names of the nn.Linears `quantize_model` would quantize by default (also of a meta-device skeleton)."""
    return [name for name, _ in _matching_linears(model, DECODER_LINEAR_PATTERN, ())]


def _matching_linears(model: nn.Module, pattern: str, skip: Iterable[str]) -> list[tuple[str, nn.Linear]]:
    regex, skip = re.compile(pattern), set(skip)
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and regex.search(name) and name not in skip]


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _fits(codec: Codec, name: str, linear: nn.Linear, strict: bool) -> bool:
    """Whether the layer's shape fits the codec; a misfit is an error if strict, else a warning."""
    out_features, in_features = linear.weight.shape
    try:
        codec.check_shape(out_features, in_features, name)
    except ValueError as e:
        if strict:
            raise
        log.warning("%s; keeping it unquantized", e)
        return False
    return True


def schemes_by_layer(names: Iterable[str], scheme: str, layer_schemes: Mapping[str, str]) -> dict[str, str]:
    """Each layer's scheme: that of the first glob of `layer_schemes` (fnmatch, case-sensitive, on the qualified
    name) that matches it, else `scheme`. A glob that matches none of `names`, or an unknown scheme, is a ValueError
    naming it: a typo must not leave the layers it meant in the default format without a word."""
    names = list(names)
    for glob, override in layer_schemes.items():
        try:
            get_codec(override)
        except ValueError as e:
            raise ValueError(f"layer_schemes[{glob!r}]: {e}") from None
        if not any(fnmatch.fnmatchcase(name, glob) for name in names):
            example = f" (they are named like {names[0]!r})" if names else ""
            raise ValueError(f"layer_schemes: {glob!r} matches no quantizable linear layer{example}")
    return {name: next((get_codec(s).scheme for g, s in layer_schemes.items() if fnmatch.fnmatchcase(name, g)), scheme)
            for name in names}


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    scheme: str,
    pattern: str = DECODER_LINEAR_PATTERN,
    strict: bool = False,
    skip: Iterable[str] = (),
    layer_schemes: Mapping[str, str] | None = None,
    correction_rank: int = 0,
) -> list[str]:
    """Replace every nn.Linear whose name matches `pattern` by a QuantLinear, in place.

    Each full-precision weight is dropped as soon as its layer is quantized, so peak memory grows by
    one layer. NVFP4 q/k/v and gate/up share one global scale (needed to fuse them at inference).
    A layer whose in_features does not fit the block size stays nn.Linear with a warning, or raises
    ValueError when `strict`. `layer_schemes`: glob -> scheme overrides (`schemes_by_layer`; KEEP_DENSE keeps a
    layer nn.Linear). `correction_rank` > 0: each quantized layer keeps a frozen error correction of that rank
    (QuantLinear.set_error_correction). Returns the names of the replaced modules.
    """
    candidates = _matching_linears(model, pattern, skip)
    schemes = schemes_by_layer([name for name, _ in candidates], get_codec(scheme).scheme, layer_schemes or {})
    targets = [(name, linear, schemes[name]) for name, linear in candidates
               if not (layer_schemes and schemes[name] == KEEP_DENSE)
               and _fits(get_codec(schemes[name]), name, linear, strict)]
    shared_scales = _shared_global_scales(targets)
    for name, linear, layer_scheme in targets:
        # (a member in another scheme than its group's NVFP4 ones takes no part in their shared scale)
        scale = shared_scales.get(fused_group_key(name) or "") if get_codec(layer_scheme).shares_global_scale else None
        layer = QuantLinear.from_linear(linear, layer_scheme, name=name, global_scale=scale)
        if correction_rank > 0:
            layer.set_error_correction(linear.weight, correction_rank)
        _set_submodule(model, name, layer)
        linear.weight = None  # free it now even if the caller still references the old module
    return [name for name, _, _ in targets]


def _shared_global_scales(targets: list[tuple[str, nn.Linear, str]]) -> dict[str, torch.Tensor]:
    """One global scale per fused group (q/k/v, gate/up) for its members in a scheme that shares one (NVFP4):
    the group's amax over those members (a member another scheme holds neither takes part nor fuses)."""
    group_amax: dict[str, torch.Tensor] = {}
    codecs: dict[str, Codec] = {}
    for name, linear, layer_scheme in targets:
        codec = get_codec(layer_scheme)
        if codec.shares_global_scale and (key := fused_group_key(name)) is not None:
            amax = codec.tensor_amax(linear.weight)
            group_amax[key] = amax if key not in group_amax else torch.maximum(group_amax[key], amax)
            codecs[key] = codec
    return {key: codecs[key].global_scale_for(amax) for key, amax in group_amax.items()}


def replace_with_empty_quant_linears(
    model: nn.Module,
    scheme: str,
    pattern: str = DECODER_LINEAR_PATTERN,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    skip: Iterable[str] = (),
    strict: bool = False,
) -> list[str]:
    """Swap matching nn.Linears for empty QuantLinears, to load a pre-quantized checkpoint into.

    Works on a model built on the meta device: buffers are created on `device` (default: where each
    linear's weight is, e.g. meta, then ``load_state_dict(..., assign=True)``). `dtype` is the bias
    dtype (default: the linear's). `skip` names modules the checkpoint kept dense (its ``ignore``);
    layers whose shape does not fit the format stay dense too (as the checkpoint writer keeps them).
    Returns the names of the replaced modules.
    """
    codec = get_codec(scheme)
    replaced = []
    for name, linear in _matching_linears(model, pattern, skip):
        if not _fits(codec, name, linear, strict):
            continue
        layer = QuantLinear(linear.in_features, linear.out_features, linear.bias is not None, scheme,
                            device=device if device is not None else linear.weight.device,
                            dtype=dtype or linear.weight.dtype, name=name)
        layer.gemm_context = getattr(linear, "gemm_context", None)  # the model's, where its plan gave it one
        _set_submodule(model, name, layer)
        replaced.append(name)
    return replaced
