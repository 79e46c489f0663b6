"""QLoRA's base as its users run it: NF4 weights in bitsandbytes' own storage, through bitsandbytes' own kernels.

`quant.scheme: nf4-bnb` replaces every decoder linear by a `BnbLinear4bit`: the weight is quantized by
`bitsandbytes.functional.quantize_4bit` (NF4, blocks of 64, double-quantized absmax: QLoRA's recipe, the default
of `bnb.nn.Linear4bit`) and multiplied by `bitsandbytes.matmul_4bit`, the call `bnb.nn.Linear4bit.forward` makes,
which is what transformers (`BitsAndBytesConfig(load_in_4bit=True)`), TRL and Unsloth run. It is the baseline to
compare NVFP4 against in the same trainer, engine and benchmarks. bitsandbytes is an optional extra
(`pip install -e ".[qlora]"`).

How it relates to qerl's own `nf4` codec (qerl.quant.nf4): the same 16 NF4 levels (bitsandbytes' table, bit for
bit) and blocks of 64, but a different double quantization: bitsandbytes stores each block's absmax as an index
into its 8-bit dynamic (non-linear) map, scaled per 256 blocks; ours stores a linear int8. Neither layout can hold
the other's absmax exactly. Without double quantization they meet: our weight, written as a bitsandbytes state
with fp32 absmax (`nf4_to_bnb`), dequantizes bit for bit to what our codec gives (tests/test_quant_bnb.py).

Why a module of our own and not `bnb.nn.Linear4bit` itself: that class is an `nn.Linear` whose `weight` holds
packed bytes, so everything in qerl that treats an `nn.Linear` as dense (LoRA's merge, quantize_model, exports)
would misread it; and on the CPU its forward repacks the weight in place into another layout. `BnbLinear4bit`
has the same state-dict keys as a `Linear4bit` at the same path and the interface of `QuantLinear`
(in/out_features, dtype, dequantized_weight), so LoRA, AQN and the rollout engine need no special case.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from qerl.quant.linear import DECODER_LINEAR_PATTERN

__all__ = ["SCHEME", "BLOCK", "BnbLinear4bit", "require_bitsandbytes", "quantize_model_bnb", "nf4_to_bnb"]

SCHEME = "nf4-bnb"
BLOCK = 64  # bnb.nn.Linear4bit's default blocksize
INSTALL_HINT = 'pip install -e ".[qlora]"'


def require_bitsandbytes() -> Any:
    """The bitsandbytes module, or a `MissingExtra` (an ImportError) that says in one line how to install it."""
    from qerl.errors import MissingExtra

    try:
        import bitsandbytes
    except ImportError:
        raise MissingExtra(f"quant.scheme {SCHEME!r} needs bitsandbytes, which is not installed: "
                          f"{INSTALL_HINT}") from None
    return bitsandbytes


class BnbLinear4bit(nn.Module):
    """A frozen linear layer whose weight is a bitsandbytes NF4 `Params4bit` (QLoRA's base layer).

    `weight` holds the packed codes ([N*K/2, 1] uint8) and its `quant_state` (absmax, nested absmax, code maps);
    `state_dict()` has the keys a `bnb.nn.Linear4bit` writes (`weight`, `weight.absmax`, ...,
    `weight.quant_state.bitsandbytes__nf4`, `bias`). Gradients flow to the input only.
    """

    def __init__(self, weight: nn.Parameter, bias: Tensor | None, dtype: torch.dtype):
        super().__init__()
        state = weight.quant_state
        self.out_features, self.in_features = state.shape
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.dtype = dtype  # compute dtype: inputs are cast to it, as Linear4bit's compute_dtype

    @property
    def scheme(self) -> str:
        return SCHEME

    @classmethod
    def from_linear(cls, linear: nn.Linear, double_quant: bool = True) -> "BnbLinear4bit":
        """Quantize an nn.Linear's weight on its device as `bnb.nn.Linear4bit` does (`Params4bit._quantize`)."""
        bnb = require_bitsandbytes()
        weight = linear.weight.detach()
        if weight.is_meta:
            raise ValueError("cannot quantize a weight on the meta device to nf4-bnb (load it first)")
        packed, state = bnb.functional.quantize_4bit(weight.contiguous(), blocksize=BLOCK,
                                                     compress_statistics=double_quant, quant_type="nf4")
        param = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=BLOCK,
                                  compress_statistics=double_quant, quant_type="nf4", bnb_quantized=True)
        return cls(param, linear.bias, weight.dtype)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"BnbLinear4bit expects input [..., {self.in_features}], got {tuple(x.shape)}")
        bnb = require_bitsandbytes()
        bias = None if self.bias is None else self.bias.to(self.dtype)
        # As bnb.nn.Linear4bit.forward: compute dtype in, the input's dtype out. Older bitsandbytes expected the
        # `.t()` view that Linear4bit passed; 0.50 reads the layout from quant_state and accepts either.
        out = bnb.matmul_4bit(x.to(self.dtype), self.weight.t(), bias=bias, quant_state=self.weight.quant_state)
        return out.to(x.dtype)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> Tensor:
        """The dense [out, in] weight this layer computes with, in `dtype` (default: the compute dtype)."""
        bnb = require_bitsandbytes()
        return bnb.functional.dequantize_4bit(self.weight.data, self.weight.quant_state).to(dtype or self.dtype)

    def _apply(self, fn, recurse: bool = True):
        """model.to(dtype) / .half() leave the packed codes alone (not floating point) and move the compute dtype,
        as for QuantLinear; device moves carry the quant state along (Params4bit.to)."""
        super()._apply(fn, recurse)
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # Linear4bit's layout: the packed weight and bias, then every piece of the quant state under "weight.".
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for key, value in self.weight.quant_state.as_dict(packed=True).items():
            destination[prefix + "weight." + key] = value if keep_vars else value.detach()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"scheme={SCHEME}, double_quant={self.weight.quant_state.nested}"


@torch.no_grad()
def quantize_model_bnb(model: nn.Module, pattern: str = DECODER_LINEAR_PATTERN, skip: Iterable[str] = (),
                       double_quant: bool = True) -> list[str]:
    """Replace every nn.Linear whose name matches `pattern` by a `BnbLinear4bit`, in place, one layer at a time
    (each dense weight is dropped as soon as its layer is quantized). Any shape fits: bitsandbytes blocks the
    flattened weight. Returns the names of the replaced modules."""
    require_bitsandbytes()
    regex, skip = re.compile(pattern), set(skip)
    names = [name for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and regex.search(name) and name not in skip]
    for name in names:
        linear = model.get_submodule(name)
        model.set_submodule(name, BnbLinear4bit.from_linear(linear, double_quant))
        linear.weight = None
    return names


def nf4_to_bnb(tensors: dict[str, Tensor], shape: tuple[int, int], dtype: torch.dtype = torch.float32):
    """qerl's `nf4` codec tensors as a bitsandbytes (packed weight, QuantState) without double quantization: the
    same codes (bitsandbytes puts the first of two in the high nibble) and the absmax our reader reconstructs, in
    fp32. `bitsandbytes.functional.dequantize_4bit` of it equals `qerl.quant.nf4.dequantize` bit for bit."""
    from qerl.quant import nf4

    bnb = require_bitsandbytes()
    codes = nf4.nf4_codes(tensors["weight_packed"]).to(torch.uint8).reshape(-1, 2)
    packed = ((codes[:, 0] << 4) | codes[:, 1]).reshape(-1, 1)
    absmax = nf4._absmax(tensors["weight_absmax_q"], tensors["weight_absmax_scale"], tensors["weight_absmax_offset"])
    state = bnb.functional.QuantState(
        absmax=absmax.reshape(-1).float().contiguous(), shape=torch.Size(shape), blocksize=nf4.BLOCK,
        code=bnb.functional.get_4bit_type("nf4", device=packed.device), quant_type="nf4", dtype=dtype)
    return packed, state
