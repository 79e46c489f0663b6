"""qerl: quantization-enhanced RL of LLMs (NVFP4 base + LoRA + adaptive quantization noise)."""

__version__ = "0.1.0"
