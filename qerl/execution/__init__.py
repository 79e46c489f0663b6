"""How the model runs: one explicit plan per model, built from the params and applied to it, never a module global.

Owns `plan` (`ExecutionPlan`, the home of the speed switches: the training kernels, the GEMM dispatch, LoRA in the
GEMM epilogue, autotuning, PDL, projection fusion, the base's GPU layout and FP8 copies, the update's precision,
recompute, held weights, shared prompts, packing and idle rows, from the `model`, `quant` and `execution` settings; `attach` makes it live on a model: the GEMM context its frozen layers
share (precision phase, held weights, scratch: `qerl.kernels.context`) and the ops its blocks call; the update's
`update_precision` and `held_weights` on that model alone), `training_ops` (the blocks' RMSNorm / RoPE / SiLU·up
and the LM head's kernel in training and prefill), `attention` (attention itself: the one place scores are
computed, SDPA or the split-KV kernel, for every path), `decode` (the fused decode step: the model's own blocks on
a residual stream of its own), `fusion` (q/k/v and gate/up as one GEMM each), `low_rank` (LoRA's update in one GEMM
epilogue, one addmm, or left to the next kernel), `shared_prompts` (the update's forward with each distinct prompt
once), `fused_ops` (the decode step's Triton kernels) and `kv8` (the FP8 KV cache layout those kernels read). It sits
between the model, which says what it computes, and `kernels/`; it reads the model's modules, never imports them.

May import: qerl.config, qerl.debug, qerl.errors, qerl.quant, qerl.kernels.
"""

from qerl.execution.plan import Execution, ExecutionPlan, attach, execution_of, held_weights, update_precision

__all__ = ["Execution", "ExecutionPlan", "attach", "execution_of", "held_weights", "update_precision"]
