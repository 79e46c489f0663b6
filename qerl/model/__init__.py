"""The policy model: one decoder for every family, its 4-bit base loaded from disk, its LoRA adapters and AQN noise.

Owns `transformer` (the decoder, HF module names, static KV cache, the fused decode step), `families` (what each
model family changes), `training_ops` / `fused_ops` (the blocks' kernels for training and for decoding), `fusion`
(q/k/v and gate/up as one GEMM), `recompute` (how many blocks recompute in backward), `lora` (adapters in PEFT
format), `aqn` (the noise schedules and the noise on the norm weights), `loading` (HF folders, GGUF, our quantized
folders), `runtime` (settings into a live model: device, dtype, seeds) and `export` (`qerl export`).

May import: qerl.config, qerl.errors, qerl.quant, qerl.run, qerl.kernels.
"""
