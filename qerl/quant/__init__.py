"""Weight quantization: formats (NVFP4, MXFP4, NF4, FP8, bf16), the quantized linear layer, checkpoints.

``qerl.quant.nvfp4`` / ``mxfp4`` / ``nf4`` / ``fp8_channel`` own the byte layouts (``fp8`` is the FP8 *update* of
bf16 bases, not a format); ``formats.get_codec`` puts them behind one interface; ``linear.QuantLinear`` computes
with them; ``checkpoint.quantize_checkpoint`` writes folders.
This package owns the bytes of a quantized weight; ``bnb`` holds QLoRA's base through bitsandbytes.

May import: qerl.errors, qerl.run, qerl.kernels.
"""

from qerl.quant.formats import SCHEMES, Codec, get_codec
from qerl.quant.linear import QuantLinear, quantize_model, replace_with_empty_quant_linears

__all__ = ["SCHEMES", "Codec", "get_codec", "QuantLinear", "quantize_model", "replace_with_empty_quant_linears",
           "quantize_checkpoint"]


def __getattr__(name: str):
    if name == "quantize_checkpoint":  # lazy: pulls in safetensors/tqdm, not needed to compute
        from qerl.quant.checkpoint import quantize_checkpoint

        return quantize_checkpoint
    raise AttributeError(name)
