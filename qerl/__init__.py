"""qerl: quantization-enhanced RL of LLMs (NVFP4 base + LoRA + adaptive quantization noise)."""

import os as _os

# OpenMP threads that spin while waiting turn every small CPU op 15-150x slower as soon as another process shares
# the cores (measured on 2-core machines: a 0.9 ms matmul took 16 ms). Passive waiting costs nothing when alone.
# It only takes effect if set before torch loads its OpenMP runtime, hence here, at the package's first import.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
