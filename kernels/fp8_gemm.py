"""A frozen FP8 weight on the GPU (quant.scheme: fp8): E4M3 W [N, K] with one FP32 scale per output row.

The weight is already what FP8 tensor cores read, so the forward is `torch._scaled_mm` on it as stored, with the
activations scaled per row (per token) and rounded to E4M3 on the fly (kernels/fp8_rows.py, rows padded to a multiple
of 16 as `_scaled_mm` needs): W8A8 with per-token dynamic activations, the GEMM vLLM runs the same checkpoint with.
It streams 1 byte per weight (half bf16's) at decode and runs at FP8's tensor-core rate at prefill. The alternatives
the dispatch measures beside it keep the activations in 16 bits: at decode sizes "triton" (kernels/fp8_w8a16.py: the
codes widened in registers, no activation rounding, no padded rows), and "dequant_cublas" (W dequantized to bf16
into the context's scratch, then cuBLAS).

dx = dy W contracts over the rows n, along which `_scaled_mm` cannot scale its weight operand (its scales run only along
the dimensions it does not contract). Rather than quantize Wᵀ a second time per column (qerl/quant/fp8.py's way for
bf16 bases, a second rounding of the weights), the row scales are folded into dy: dx = (dy · diag(s)) W8, so the
E4M3 codes are reused exactly (transposed once, a byte per weight, kept through the update inside `held_weights`) and
only dy · diag(s) is rounded, per row, as any FP8 gradient.

Which precision runs is the phase's (`GemmContext.update_precision`): inside the FP8 update both GEMMs are FP8; inside
the bf16 update both are dequantize + cuBLAS; outside the update (rollouts, prefill, evaluation) the dispatch times
both forwards per (shape, M bucket) and keeps the faster.
"""

from __future__ import annotations

import torch

from . import fp8_rows as fp8_kernels
from . import fp8_w8a16
from .context import GemmContext

__all__ = ["FP8Gemm", "FP8_MAX", "fp8_rows", "fp8_rows_reference", "fp8_supported"]

FP8_MAX = 448.0


def fp8_supported(device: torch.device) -> bool:
    """FP8 tensor cores (`torch._scaled_mm`): a CUDA GPU of compute capability 8.9 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_rows_reference(x: torch.Tensor, column_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: (x / s in E4M3, s [M, 1] fp32) with s = max|row| / 448; x · diag(column_scale) in x's place
    if given (fp32 [K])."""
    x = x.float() if column_scale is None else x.float() * column_scale.float()[None, :]
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / FP8_MAX
    return (x / s).to(torch.float8_e4m3fn), s


def fp8_rows(x: torch.Tensor, column_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / s in E4M3, s [M', 1] fp32) with s = max|row| / 448 (each row's largest value lands on E4M3's largest),
    rows padded with zeros to M' = a multiple of 16, which `_scaled_mm` takes (a micro-batch's token count rarely is
    one; the padded rows' outputs are sliced off). `column_scale` (fp32 [K]): x · diag(column_scale) quantized
    instead, without a copy of it. On CUDA one Triton kernel (kernels/fp8_rows.py)."""
    if x.is_cuda:
        return fp8_kernels.fp8_rows(x, column_scale)
    q, s = fp8_rows_reference(x, column_scale)
    pad = -q.shape[0] % 16
    if pad:
        q = torch.cat([q, q.new_zeros(pad, q.shape[1])])
        s = torch.cat([s, s.new_ones(pad, 1)])
    return q, s


class FP8Gemm:
    """y = x @ W^T and dx = dy @ W for one frozen FP8 weight (module docstring), held once on a CUDA device."""

    layout = "fp8"
    repacked = False  # the stored tensors themselves: QuantLinear keeps its buffers (no second copy)

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                 context: GemmContext | None = None):
        if weight.dtype != torch.float8_e4m3fn or weight.ndim != 2:
            raise ValueError(f"FP8Gemm needs an E4M3 [N, K] weight, got {weight.dtype} {tuple(weight.shape)}")
        self.context = context if context is not None else GemmContext()
        self.weight, self.weight_scale = weight, weight_scale  # as stored (canonical() gives them back)
        self.n, self.k = weight.shape
        self.device, self.dtype = weight.device, dtype
        self.w8 = weight if weight.is_contiguous() else weight.contiguous()
        self.scale = weight_scale.reshape(self.n).float().contiguous()  # [N] fp32
        # _scaled_mm's rowwise kernels need both weight dimensions multiples of 16 (a 135M's 576 and 1536 are)
        self.scaled_mm = fp8_supported(self.device) and self.n % 16 == 0 and self.k % 16 == 0
        self.w8a16 = fp8_supported(self.device)  # kernels/fp8_w8a16.py: Triton converts E4M3 on sm_89+ only
        self._ones_k: torch.Tensor | None = None  # scale_b of dx's product: Wᵀ's columns are unscaled

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16,
                     context: GemmContext | None = None, **_layout) -> "FP8Gemm":
        """From a layer's codec tensors (weight, weight_scale); NVFP4's layout options do not apply."""
        return cls(tensors["weight"], tensors["weight_scale"], dtype=dtype, context=context)

    @property
    def nbytes(self) -> int:
        return self.w8.numel() + self.scale.numel() * 4

    def canonical(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "weight_scale": self.weight_scale}

    # -- the backends -------------------------------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in `dtype`, into the context's scratch (or a kept copy inside its `held_weights`)."""
        def write(flat: torch.Tensor) -> torch.Tensor:
            out = flat.view(self.n, self.k)
            if self.w8a16 and dtype in (torch.bfloat16, torch.float16):  # one Triton pass (fp8_w8a16.dequantize)
                return fp8_w8a16.dequantize(self.w8, self.scale, out)
            step = max(1, (1 << 24) // max(self.k, 1))  # bound the fp32 temporary (64 MiB)
            for r in range(0, self.n, step):
                out[r:r + step] = self.w8[r:r + step].float() * self.scale[r:r + step, None]
            return out

        return self.context.weight_copy(self, ("dequantized", dtype), self.n * self.k, dtype, self.device, write)

    def _transposed_fp8(self) -> torch.Tensor:
        """The E4M3 codes as Wᵀ [K, N], contiguous: dx's operand (module docstring)."""
        def write(flat: torch.Tensor) -> torch.Tensor:  # bytes moved as uint8: a strided copy every build has
            flat.view(torch.uint8).view(self.k, self.n).copy_(self.w8.view(torch.uint8).t())
            return flat.view(self.k, self.n)

        return self.context.weight_copy(self, ("fp8", True), self.n * self.k, torch.float8_e4m3fn, self.device, write)

    def _forward(self, backend: str, x2: torch.Tensor) -> torch.Tensor:
        if backend in fp8_w8a16.TILES:
            return fp8_w8a16.tiled_forward(backend, x2, self.w8, self.scale)
        if backend == "fp8_weight":
            aq, s_a = fp8_rows(x2)
            return torch._scaled_mm(aq, self.w8.t(), scale_a=s_a, scale_b=self.scale[None, :],
                                    out_dtype=x2.dtype)[:x2.shape[0]]
        return x2 @ self.dequantize(x2.dtype).t()

    def _grad_input(self, backend: str, dy2: torch.Tensor) -> torch.Tensor:
        if backend == "fp8_weight":
            if self._ones_k is None:
                self._ones_k = torch.ones(1, self.k, dtype=torch.float32, device=self.device)
            gq, s_g = fp8_rows(dy2, column_scale=self.scale)  # the fold in fp32, inside the rows' kernel
            return torch._scaled_mm(gq, self._transposed_fp8().t(), scale_a=s_g, scale_b=self._ones_k,
                                    out_dtype=dy2.dtype)[:dy2.shape[0]]
        return dy2 @ self.dequantize(dy2.dtype)

    def _backends(self, kind: str) -> tuple[str, ...]:
        """FP8 inside the FP8 update, bf16 inside the bf16 one; outside the update a forward may be either (the
        dispatch measures) and a backward is bf16's."""
        precision = self.context.precision
        decode = tuple(fp8_w8a16.TILES) if precision is None and kind == "fwd" and self.w8a16 else ()
        if not self.scaled_mm or precision == "bf16" \
                or (precision is None and (kind == "bwd" or not self.context.fp8_activations)):
            return decode + ("dequant_cublas",)
        return ("fp8_weight",) if precision == "fp8" else decode + ("fp8_weight", "dequant_cublas")

    def backend_for(self, kind: str, x2: torch.Tensor) -> str:
        run = self._forward if kind == "fwd" else self._grad_input
        backends = self._backends(kind)
        if x2.dtype != torch.bfloat16 and x2.is_cuda:  # rowwise-scaled _scaled_mm writes bf16 only
            backends = tuple(b for b in backends if b != "fp8_weight")
        tiles = fp8_w8a16.tiles_for(x2.shape[0]) if x2.dtype in (torch.bfloat16, torch.float16) else ()
        backends = tuple(b for b in backends if b not in fp8_w8a16.TILES or b in tiles)
        backends = backends or ("dequant_cublas",)
        cands = {b: (lambda b=b: run(b, x2)) for b in backends}
        layout = self.layout + ("-" + self.context.precision if self.context.precision else "")
        return self.context.dispatcher.choose(kind, layout, self.n, self.k, x2.shape[0], cands)

    def forward(self, x2: torch.Tensor, backend: str | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y [M, N] (+ bias [N]) for x2 [M, K] (bf16/fp16, unit stride along K)."""
        if x2.shape[0] == 0:
            return x2.new_empty(0, self.n)
        y = self._forward(backend or self.backend_for("fwd", x2), x2)
        return y if bias is None else y + bias.to(y.dtype)

    def forward_low_rank(self, x2: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
        """y = x2 @ W^T + scale * h @ b^T (LoRA's update, inference): one addmm after the GEMM."""
        return self.forward(x2).addmm_(h, b.t(), alpha=scale)

    def grad_input(self, dy2: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        """dx [M, K] for dy2 [M, N]."""
        if dy2.shape[0] == 0:
            return dy2.new_empty(0, self.k)
        return self._grad_input(backend or self.backend_for("bwd", dy2), dy2)
