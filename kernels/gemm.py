"""A frozen NVFP4 weight on the GPU: one resident copy, and the fastest GEMM for each call's M.

`NVFP4Gemm` takes a layer's compressed-tensors tensors and keeps exactly one copy of them. On a Hopper GPU
(sm_90) with Gluon, and a shape it holds, the copy is shuffled for our Gluon decode GEMM ("gluon" layout,
kernels/gluon_nvfp4.py: faster than bf16 at every batch measured, and compiled in seconds where humming's JIT took a
minute: BENCHMARKS.md, "Rollouts: the Gluon default"). Elsewhere, repacked for humming-kernels when it is
installed and the shape fits ("humming" layout), else as given ("qerl" layout, read by our Triton kernels);
`prefer=` or quant.gpu_layout choose another. Forward and backward dx then pick a backend per
(shape, M bucket) through `qerl.kernels.dispatch`: the 4-bit GEMM where weight bandwidth bounds the call (decode),
dequantize-into-scratch + cuBLAS where tensor-core time does (training), whatever measured fastest in between.

With `fp8_weights` (quant.fp8_weights) the layer also keeps a resident FP8 copy of W (E4M3, one scale per output
row, made once from the 4-bit codes): outside the update (rollouts, prefill, evaluation) the dispatch may then run a
forward as `_scaled_mm` on FP8 tensor cores with the activations scaled per row ("fp8_weight"), where at many rows
W4A16 is compute-bound and dequantizing to bf16 costs more than the bytes it saves; the FP8 update's forward reads
the same copy instead of dequantizing. The copy costs 1 byte per weight beside the 0.56 of the 4-bit codes.

Each layer runs under its model's `qerl.kernels.context.GemmContext` (its settings and phase, never a module global):
dequantized weights go to the context's scratch buffer, shared by the model's layers on a device and dtype. Inside
its `held_weights(budget)` (the trainer's update, when memory allows) a layer's dequantized copy is instead kept
until the block ends: a 7B update dequantizes each weight once, not twice per micro-batch (3,584 kernels of ~75 µs).
"""

from __future__ import annotations

import logging
import warnings

import torch

from . import gluon_nvfp4, humming_nvfp4
from .context import GemmContext
from . import fp8_rows as fp8_kernels
from . import nvfp4 as triton_nvfp4
from .fp8_gemm import FP8Gemm, fp8_rows, fp8_rows_reference, fp8_supported  # noqa: F401 (also gemm's names)

log = logging.getLogger(__name__)

FP8_MAX = 448.0  # the largest finite E4M3 value


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=3)


class NVFP4Gemm:
    """y = x @ W^T and dx = dy @ W for one frozen NVFP4 weight W [N, K] held once on a CUDA device."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                 dtype: torch.dtype = torch.bfloat16, prefer: str | None = None, layout: str | None = None,
                 fp8_weights: bool = False, context: GemmContext | None = None):
        """`prefer`: "humming", "qerl" or "gluon" to force a layout (tests, benchmarks; an unusable one raises).
        `layout`: the run's wish (quant.gpu_layout; None or "auto": the default): a layer it cannot serve keeps
        the default, said once. The default: gluon on Hopper, else humming if usable, else qerl. `fp8_weights`:
        also keep the resident FP8 copy (module docstring; on a GPU with FP8 tensor cores, else ignored).
        `context`: the model's settings and phase (None: a context of this layer's own, with the defaults)."""
        self.context = context if context is not None else GemmContext()
        self._init_layout(packed, scale, global_scale, dtype, prefer, layout)
        self.fp8_weight: torch.Tensor | None = None  # W [N, K] in E4M3, row r scaled by 1 / _fp8_scales()[0][r]
        if fp8_weights and fp8_supported(self.device):
            inv = self._fp8_scales()[1]
            flat = torch.empty(self.n * self.k, dtype=torch.float8_e4m3fn, device=self.device)
            self.fp8_weight = self._dequantize_fp8(inv, False, flat).view(self.n, self.k)

    def _init_layout(self, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype, prefer: str | None, layout: str | None) -> None:
        """The one copy of the 4-bit weight, in the layout `__init__`'s arguments choose."""
        wish = layout if layout not in (None, "auto") else None
        wished = prefer is None and wish is not None  # a wish, not an order: unusable -> default, warned
        prefer = prefer or wish
        if prefer not in (None, "humming", "qerl", "gluon"):
            raise ValueError(f"unknown NVFP4 layout {prefer!r}: expected humming, qerl or gluon")
        self.n, self.k = packed.shape[0], packed.shape[1] * 2
        self.device = packed.device
        self.humming: humming_nvfp4.HummingWeight | None = None
        self.tensors: dict[str, torch.Tensor] | None = None
        self.gluon: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._fp8_cache: tuple[torch.Tensor, ...] | None = None  # _fp8_scales(), made on first use
        if prefer is None and gluon_nvfp4.available() and gluon_nvfp4.fits(self.n, self.k):
            prefer = "gluon"  # the Hopper default (module docstring)
        if prefer == "gluon":
            if gluon_nvfp4.available() and gluon_nvfp4.fits(self.n, self.k):
                self.gluon = (*gluon_nvfp4.shuffle_weight(packed, scale), global_scale.reshape(1).float())
                return
            why = (f"the Gluon layout needs Gluon on an sm_90 GPU and N % 64 == K % 128 == 0 (got {self.n}x{self.k}; "
                   f"{gluon_nvfp4.IMPORT_ERROR})")
            if not wished:
                raise RuntimeError(why)
            _warn_once(f"NVFP4 layout gluon (quant.gpu_layout): {why}; such layers keep the "
                       "default layout")
            prefer = None
        if prefer != "qerl" and self._humming_usable(prefer == "humming" and not wished):
            try:
                self.humming = humming_nvfp4.HummingWeight(packed, scale, global_scale, dtype)
            except Exception as e:  # compile failure, unexpected layout: keep our layout, say so once
                if prefer == "humming" and not wished:
                    raise
                _warn_once(f"humming-kernels unusable ({type(e).__name__}: {e}); using qerl's NVFP4 kernels")
        if self.humming is None:
            self.tensors = {"weight_packed": packed.contiguous(), "weight_scale": scale.contiguous(),
                            "weight_global_scale": global_scale.reshape(1).float()}

    def _humming_usable(self, required: bool) -> bool:
        if not humming_nvfp4.available():
            if required:
                raise RuntimeError(f"humming-kernels is not usable: {humming_nvfp4.IMPORT_ERROR}")
            if humming_nvfp4.IMPORT_ERROR is not None and not isinstance(humming_nvfp4.IMPORT_ERROR, ImportError):
                _warn_once(f"humming-kernels failed to import ({humming_nvfp4.IMPORT_ERROR}); "
                           "using qerl's NVFP4 kernels")
            return False
        if not humming_nvfp4.fits(self.n, self.k):
            if required:
                raise ValueError(f"humming layout needs N, K multiples of 64, got {self.n}x{self.k}")
            return False
        return True

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16,
                     layout: str | None = None, fp8_weights: bool = False,
                     context: GemmContext | None = None) -> "NVFP4Gemm":
        """From a layer's compressed-tensors tensors (weight_packed, weight_scale, weight_global_scale)."""
        return cls(tensors["weight_packed"], tensors["weight_scale"], tensors["weight_global_scale"], dtype=dtype,
                   layout=layout, fp8_weights=fp8_weights, context=context)

    @property
    def layout(self) -> str:
        return "humming" if self.humming is not None else "gluon" if self.gluon is not None else "qerl"

    @property
    def repacked(self) -> bool:
        """Whether the weight is held in another layout than the tensors given (then the only copy is this one)."""
        return self.layout != "qerl"

    @property
    def nbytes(self) -> int:
        """Bytes of the 4-bit weight as held, plus the resident FP8 copy if any."""
        copy = 0 if self.fp8_weight is None else self.fp8_weight.numel()
        if self.humming is not None:
            return self.humming.nbytes + copy
        if self.gluon is not None:
            return sum(t.numel() * t.element_size() for t in self.gluon) + copy
        return sum(t.numel() * t.element_size() for t in self.tensors.values()) + copy

    def canonical(self) -> dict[str, torch.Tensor]:
        """The compressed-tensors tensors (weight_packed, weight_scale, weight_global_scale), exactly as loaded."""
        if self.gluon is not None:
            packed, scale = gluon_nvfp4.unshuffle_weight(*self.gluon[:2])
            return {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": self.gluon[2].clone()}
        return self.humming.canonical() if self.humming is not None else dict(self.tensors)

    # -- the backends -------------------------------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype, transposed: bool = False, out: torch.Tensor | None = None):
        """W [N, K] (W^T [K, N] if transposed, a view for the qerl layout) in dtype; into the context's scratch (or
        a kept copy, inside its `held_weights`) unless a flat `out` of N * K elements is given."""
        if out is None:
            return self.context.weight_copy(self, ("dequantized", dtype, transposed), self.n * self.k, dtype,
                                            self.device, lambda flat: self.dequantize(dtype, transposed, out=flat))
        flat = out.view(-1)
        if self.humming is not None:
            return self.humming.dequantize(flat.view(self.k, self.n) if transposed else flat.view(self.n, self.k),
                                           transposed)
        if self.gluon is not None:
            return gluon_nvfp4.dequantize(*self.gluon, dtype, transposed, out=flat)
        w = triton_nvfp4.dequantize(*self._ours(), dtype, out=flat.view(self.n, self.k))
        return w.t() if transposed else w  # cuBLAS takes the transposed view as is

    def _ours(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed, scale, global scale) as our Triton kernels take them (qerl layout only)."""
        t = self.tensors
        return t["weight_packed"], t["weight_scale"], t["weight_global_scale"]

    def _fp8_scales(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per output row of W (n) and of W^T (k): the FP8 scale (max |W| over the row / 448) and its inverse, from
        the block scales alone (a block's largest code is 6 by construction of NVFP4: max |W| = 6 * its scale / gs).
        Computed once per layer."""
        if self._fp8_cache is None:
            t = self.canonical()
            scale = t["weight_scale"].float() * (6.0 / t["weight_global_scale"].float())  # [N, K/16]
            row = scale.amax(1).clamp_min(1e-30) / FP8_MAX
            col = scale.amax(0).clamp_min(1e-30).repeat_interleave(16) / FP8_MAX
            self._fp8_cache = (row, 1.0 / row, col, 1.0 / col)
        return self._fp8_cache

    def _fp8_product(self, a: torch.Tensor, transposed: bool) -> torch.Tensor:
        """a @ W^T (forward: a = x [M, K]) or, transposed, a @ W (dx: a = dy [M, N]) in FP8: the weight dequantized
        into the FP8 scratch with one scale per row of what is written (W's n, or W^T's k), `a` scaled per row."""
        s_n, inv_n, s_k, inv_k = self._fp8_scales()
        scale, inv = (s_k, inv_k) if transposed else (s_n, inv_n)
        w = self.fp8_weight if not transposed else None
        if w is None:
            w = self.context.weight_copy(self, ("fp8", transposed), self.n * self.k, torch.float8_e4m3fn,
                                         self.device, lambda flat: self._dequantize_fp8(inv, transposed, flat))
        aq, s_a = fp8_rows(a)
        return torch._scaled_mm(aq, w.t(), scale_a=s_a, scale_b=scale[None, :], out_dtype=a.dtype)[:a.shape[0]]

    def _dequantize_fp8(self, inv: torch.Tensor, transposed: bool, out: torch.Tensor) -> torch.Tensor:
        """W (or W^T) times `inv` per row of what is written, in E4M3, into `out`. The Gluon layout's dequantize
        writes FP8 itself (one pass); the other layouts dequantize to a bf16 temporary first and scale that (a
        second pass over 2 bytes per weight, made once per update inside `held_weights`)."""
        if self.gluon is not None:
            return gluon_nvfp4.dequantize(*self.gluon, torch.float8_e4m3fn, transposed=transposed, inv_scale=inv,
                                          out=out)
        w = self.dequantize(torch.bfloat16, out=torch.empty(self.n * self.k, dtype=torch.bfloat16,
                                                           device=self.device))
        return fp8_kernels.weight_fp8(w.contiguous(), inv, transposed, out=out)

    def _forward_fp8(self, x2: torch.Tensor) -> torch.Tensor:
        return self._fp8_product(x2, transposed=False)

    def _grad_input_fp8(self, dy2: torch.Tensor) -> torch.Tensor:
        return self._fp8_product(dy2, transposed=True)

    def _forward(self, backend: str, x2: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        in_epilogue = backend == "gluon" and bias is not None and bias.dtype == torch.bfloat16
        if backend in ("dequant_fp8", "fp8_weight"):  # the resident copy where there is one (_fp8_product)
            y = self._forward_fp8(x2)
        elif backend == "humming":
            y = self.humming.forward(x2)
        elif backend == "gluon":  # a bf16 bias in the GEMM's epilogue, before its one rounding
            y = gluon_nvfp4.linear_forward(x2, *self.gluon, bias=bias if in_epilogue else None,
                                           pdl=self.context.pdl)
        elif backend == "triton":
            y = triton_nvfp4.linear_forward(x2, *self._ours(), autotune=self.context.autotune)
        else:
            y = x2 @ self.dequantize(x2.dtype, transposed=True)
        return y if bias is None or in_epilogue else y + bias.to(y.dtype)

    def _grad_input(self, backend: str, dy2: torch.Tensor) -> torch.Tensor:
        if backend == "dequant_fp8":
            return self._grad_input_fp8(dy2)
        if backend == "triton":
            return triton_nvfp4.grad_input(dy2, *self._ours(), autotune=self.context.autotune)
        return dy2 @ self.dequantize(dy2.dtype, transposed=True).t()  # W^T is the coalesced write for humming

    def _fp8(self) -> bool:
        """Whether this call is in the FP8 update (the context's `update_precision("fp8")`), whatever the layout."""
        return self.context.precision == "fp8"

    def _fp8_resident(self, kind: str) -> bool:
        """Whether this call may run on the resident FP8 copy: a forward outside the update (in the update, its
        precision decides: the FP8 update reads the copy through "dequant_fp8", the bf16 one never does)."""
        return kind == "fwd" and self.context.precision is None and self.fp8_weight is not None \
            and self.context.fp8_activations

    def _backends(self, kind: str) -> tuple[str, ...]:
        if self._fp8():  # the Gluon GEMM (bf16) still serves small forwards: nothing to gain from FP8 there
            return ("gluon", "dequant_fp8") if kind == "fwd" and self.layout == "gluon" else ("dequant_fp8",)
        if kind == "bwd":
            return ("triton", "dequant_cublas") if self.layout == "qerl" else ("dequant_cublas",)
        native = {"humming": ("humming", "dequant_cublas"), "qerl": ("triton", "dequant_cublas"),
                  "gluon": ("gluon", "dequant_cublas")}[self.layout]
        return native + ("fp8_weight",) if self._fp8_resident(kind) else native

    def backend_for(self, kind: str, x2: torch.Tensor) -> str:
        run = self._forward if kind == "fwd" else self._grad_input
        backends = self._backends(kind)
        if "gluon" in backends and not (x2.shape[0] <= gluon_nvfp4.MAX_M_CHUNKED and x2.dtype == torch.bfloat16):
            backends = tuple(b for b in backends if b != "gluon")
        cands = {b: (lambda b=b: run(b, x2)) for b in backends}
        # their own dispatch entries: the FP8 update's, and inference with a resident FP8 copy
        layout = self.layout + ("-fp8" if "dequant_fp8" in backends else "+fp8w" if "fp8_weight" in backends else "")
        return self.context.dispatcher.choose(kind, layout, self.n, self.k, x2.shape[0], cands)

    def forward(self, x2: torch.Tensor, backend: str | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y [M, N] (+ bias [N]) for x2 [M, K] (bf16/fp16, unit stride along K)."""
        if x2.shape[0] == 0:
            return x2.new_empty(0, self.n)
        return self._forward(backend or self.backend_for("fwd", x2), x2, bias)

    def forward_low_rank(self, x2: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
        """y [M, N] = x2 @ W^T + scale * h @ b^T (LoRA's update: h = x2 A^T [M, R], b = B [N, R]), inference only.
        With the context's `lora_epilogue`, where the Gluon GEMM runs the call, the update is added in its epilogue
        (no launch of its own, one rounding to bf16); otherwise (the default: measured faster) one addmm adds it."""
        backend = self.backend_for("fwd", x2) if x2.shape[0] else None
        if backend == "gluon" and h.dtype == b.dtype == x2.dtype and self.context.lora_epilogue:
            return gluon_nvfp4.linear_forward(x2, *self.gluon, low_rank=(h, b, scale), pdl=self.context.pdl)
        return self.forward(x2, backend).addmm_(h, b.t(), alpha=scale)

    def grad_input(self, dy2: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        """dx [M, K] for dy2 [M, N]."""
        if dy2.shape[0] == 0:
            return dy2.new_empty(0, self.k)
        return self._grad_input(backend or self.backend_for("bwd", dy2), dy2)


class _NVFP4GemmFunction(torch.autograd.Function):
    """y = x @ W^T + b with W frozen: grads to x (and b) only; nothing of W is saved for backward."""

    @staticmethod
    def forward(ctx, x, gemm: NVFP4Gemm, bias):
        x2 = x.reshape(-1, gemm.k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        y = gemm.forward(x2, bias=bias)
        ctx.gemm = gemm
        ctx.bias_grad = bias is not None and ctx.needs_input_grad[2]
        return y.reshape(*x.shape[:-1], gemm.n)

    @staticmethod
    def backward(ctx, dy):
        gemm = ctx.gemm
        dy2 = dy.reshape(-1, gemm.n)
        if dy2.stride(1) != 1:
            dy2 = dy2.contiguous()
        dx = db = None
        if ctx.needs_input_grad[0]:
            dx = gemm.grad_input(dy2).reshape(*dy.shape[:-1], gemm.k)
        if ctx.bias_grad:
            db = dy2.float().sum(0).to(dy.dtype)
        return dx, None, db


def linear(x: torch.Tensor, gemm: "NVFP4Gemm | FP8Gemm", bias: torch.Tensor | None = None) -> torch.Tensor:
    return _NVFP4GemmFunction.apply(x, gemm, bias)


# The GPU GEMM of each stored format that has one (a codec's gpu_kernel), by its scheme name.
WEIGHT_GEMMS = {"nvfp4": NVFP4Gemm, "fp8": FP8Gemm}


def weight_gemm(scheme: str, tensors: dict[str, torch.Tensor], **options) -> "NVFP4Gemm | FP8Gemm":
    """The GPU GEMM holding one frozen layer's weight stored as `scheme` (its codec tensors by name); `options`:
    dtype, layout, fp8_weights, context (those that do not apply to the format are ignored)."""
    if scheme not in WEIGHT_GEMMS:
        raise ValueError(f"no GPU GEMM for scheme {scheme!r}: expected one of {', '.join(WEIGHT_GEMMS)}")
    return WEIGHT_GEMMS[scheme].from_tensors(tensors, **options)
