"""The policy model: one decoder for every family, its 4-bit base loaded from disk, its LoRA adapters and AQN noise.

Owns `transformer` (the decoder: one forward per module, HF module names, static KV cache), `architecture`
(`ModelConfig`, from and to a Hugging Face config), `rope` (every RoPE variant), `masks` (positions and attention
masks), `families` (what each model family changes), `recompute` (how many
blocks recompute in backward), `lora` (adapters in PEFT format), `aqn` (the noise schedules and the noise on the norm
weights), `loading` (HF folders, GGUF, our quantized folders), `runtime` (settings into a live model: device, dtype,
seeds, its execution plan) and `export` (`qerl export`). How the model runs fast is `qerl.execution`'s.

May import: qerl.config, qerl.debug, qerl.errors, qerl.execution, qerl.quant, qerl.run, qerl.kernels.
"""
