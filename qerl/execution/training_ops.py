"""The decoder block's elementwise ops (RMSNorm, RoPE, SiLU·up), and the LM head's log-probs in the update, as one
kernel each on the GPU.

In eager PyTorch each of these is 5–8 kernels over [tokens, width] tensors, most in fp32 (RMSNorm and RoPE round
like Hugging Face's reference code, which our rollouts must match), and autograd saves their fp32 intermediates.
Over a GRPO update of a 7B model that is ~2 s of pure memory traffic (the profile in BENCHMARKS.md, "aten::mul").

Backends (`model.training_kernels`; a model's blocks call the `TrainingOps` of its execution plan, `qerl.execution`):
* `eager`   the plain PyTorch ops of `transformer.py` (what the CPU always runs: its numbers stay exactly as they were);
* `liger`   Liger-kernel's fused Triton forward/backward kernels (`pip install liger-kernel`), the field's choice,
            for RMSNorm; our Triton kernels for RoPE (kernels/rope.py) and for SiLU·up of a fused gate/up output
            (kernels/swiglu.py), which Liger's take only as separate contiguous tensors;
* `compile` `torch.compile` of the eager functions themselves (inductor fuses each into one kernel per direction);
* `auto`    on CUDA, liger where installed, else compile; eager off CUDA. Measured on the 7B update (H200,
            BENCHMARKS.md "The update"): eager 7.2 s, compile 6.3 s, liger 6.4 s (RoPE compiled); liger's first
            step costs seconds, compile's ~20 s of inductor compilation per process (cached on disk after).

Each fused backend computes the same function with the same roundings (fp32 statistics, a round to the activation
dtype before RMSNorm's weight, RoPE in fp32); only fp32 summation order may differ, i.e. well under one bf16 ulp.
They apply to CUDA tensors outside CUDA-graph capture (the rollout engine's decode graphs keep their own kernels,
`qerl.execution.fused_ops`), so prefill and the update run the same kernels and the CPU runs the reference ops.
"""
from __future__ import annotations

import functools
import logging
import types

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

BACKENDS = ("auto", "eager", "liger", "compile")


def rms_norm_eager(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's LlamaRMSNorm: statistics in fp32, normalized x rounded to x's dtype, then times the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_eager(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate [B, H, T, D] by [B, 1, T, D] fp32 tables (HF's rotate-half convention), computed in fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).type_as(x)


def silu_mul_eager(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def resolve_backend(name: str) -> str:
    """The backend `model.training_kernels = name` runs in this process: auto resolved, and `liger` without the
    package falling back to `compile`, with a warning naming the fix."""
    if name not in BACKENDS:
        raise ValueError(f"model.training_kernels = {name!r}: expected one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = ("liger" if _liger() is not None else "compile") if torch.cuda.is_available() else "eager"
    if name == "liger" and _liger() is None:
        log.warning("model.training_kernels = liger but liger-kernel is not installed (pip install liger-kernel): "
                    "using torch.compile instead")
        name = "compile"
    return name


class TrainingOps:
    """RMSNorm, RoPE and SiLU·up (and the update's LM-head kernel) under one backend: what a model's blocks call."""

    def __init__(self, backend: str = "eager", vocab_kernel: bool = True):
        """`backend`: one of BACKENDS (resolved by `resolve_backend`); `vocab_kernel`: False keeps the update's LM
        head in PyTorch even where the fused backends run (A/B measurements: qerl.debug)."""
        self.backend, self.vocab_kernel = resolve_backend(backend), vocab_kernel

    def __repr__(self) -> str:
        return f"TrainingOps({self.backend!r})"

    def _fast(self, x: Tensor) -> bool:
        return self.backend != "eager" and x.is_cuda and not torch.cuda.is_current_stream_capturing()

    def head_kernel(self, weight: Tensor):
        """`qerl.kernels.vocab_softmax` for the update's LM head (`qerl.rl.grpo.head_log_probs`) where the fused backends
        run and the head's dtype is one it reads; None elsewhere (PyTorch computes the head, as the CPU always has).
        Ours because neither Liger-kernel (its `fused_selective_log_softmax` takes the log-prob alone) nor inductor
        gives the log-prob, entropy and softmax in one pass (BENCHMARKS.md, "The update's LM head")."""
        if not self._fast(weight) or weight.dtype not in (torch.bfloat16, torch.float16, torch.float32) \
                or not self.vocab_kernel:
            return None
        from qerl.kernels import vocab_softmax

        return vocab_softmax

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if not self._fast(x):
            return rms_norm_eager(x, weight, eps)
        if self.backend == "liger":
            # casting_mode "llama": rstd in fp32, x * rstd rounded to x's dtype, then the weight (as rms_norm_eager)
            return _liger().LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)
        return _compiled("rms_norm")(x, weight, eps)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # Liger's RoPE rotates q and k together from [B, T, D] tables; ours rotates one tensor with broadcast tables
        # (GQA shapes differ between q and k). Both fused backends run our Triton kernel (kernels/rope.py: no Dynamo
        # guards per call, no inductor compilation per process): under `compile`, Dynamo's RoPE graphs depended on
        # the order of the step's calls (a size-1 batch specialised, grad mode), so a trainer compiled graphs its
        # precompile workers had not (BENCHMARKS.md, "The owed GPU chain"). Shapes it does not take: torch.compile's.
        if not self._fast(x):
            return rope_eager(x, cos, sin)
        from qerl.kernels import rope as rope_kernel

        if rope_kernel.supports(x, cos):
            return rope_kernel.Rope.apply(x, cos, sin)
        return _compiled("rope")(x, cos, sin)

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        if not self._fast(gate):
            if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
                return _SiluMul.apply(gate, up)
            return silu_mul_eager(gate, up)
        fused = _fused_halves(gate, up)
        if fused is not None:  # the halves of one gate/up GEMM output: our kernel reads them where they lie
            from qerl.kernels.swiglu import SiluMulFused

            return SiluMulFused.apply(fused)
        if self.backend == "liger":
            return _liger().LigerSiLUMulFunction.apply(gate, up)
        return _compiled("silu_mul")(gate, up)


EAGER = TrainingOps("eager")  # what a model runs until its execution plan says otherwise (the CPU: always)


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up, keeping only gate and up for backward: eager autograd also keeps silu(gate), a third more
    of the MLP's widest activations (the CPU update's largest saved tensors). Backward recomputes silu(gate) and
    calls the ops eager autograd calls (mul's `grad * other`, aten.silu_backward), so the gradients are bitwise
    eager's."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


def _fused_halves(gate: Tensor, up: Tensor) -> Tensor | None:
    """The [..., 2I] tensor whose first and second halves (of the last dimension) `gate` and `up` are, as a fused
    gate/up projection's split leaves them; None for separate tensors. Liger's SwiGLU copied such halves out (and
    autograd concatenated their gradients back): 0.4 s of a 7B update (BENCHMARKS.md, "The update: prompts once,
    SwiGLU and RoPE kernels")."""
    base, inter = gate._base, gate.shape[-1]
    # A `_base` outside the graph (made inside a custom Function's forward) would cut the gradient off.
    if base is None or up._base is not base or base.requires_grad != gate.requires_grad \
            or not base.is_contiguous() or base.shape[-1] != 2 * inter \
            or up.shape != gate.shape or base.numel() != 2 * gate.numel() or gate.stride(-1) != 1 \
            or (gate.dim() > 1 and gate.stride(-2) != 2 * inter) \
            or gate.data_ptr() != base.data_ptr() or up.data_ptr() != base.data_ptr() + inter * base.element_size():
        return None
    return base.view(*gate.shape[:-1], 2 * inter)


_EAGER = {"rms_norm": rms_norm_eager, "rope": rope_eager, "silu_mul": silu_mul_eager}


@functools.cache
def _compiled(name: str):
    # dynamic: every GRPO step has its own padded length; one graph with a symbolic token count serves them all.
    return torch.compile(_EAGER[name], dynamic=True, fullgraph=True)


@functools.cache
def _liger():
    """Liger-kernel's autograd functions, or None where it is not installed."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception:  # not installed, or an install that does not import with this torch/triton
        return None

    return types.SimpleNamespace(LigerRMSNormFunction=LigerRMSNormFunction, LigerSiLUMulFunction=LigerSiLUMulFunction)
