"""qerl: quantization-enhanced RL of LLMs (NVFP4 base + LoRA + adaptive quantization noise).

The parts, bottom up; each imports only parts listed before it (a package's docstring names which ones), never the
other way, lazily or for types included (tests/test_architecture.py checks both):

    errors       how an error ends a command: one line, exit codes (imports nothing of qerl)
    run/         the run on disk: the run folder (lock, start/resume rules, checkpoints, metrics), atomic writes
    quant/       the 4-bit formats, the quantized linear layer, quantized checkpoints
    grading/     is an answer right: extraction, qerl's equality, math-verify in a worker
    data/        problems (generated, hub, local tables), prompts, rewards
    config       the settings of params/*.yaml (it asks quant/ and data/ whether a scheme or reward exists)
    debug        the environment variables qerl reads, for debugging and measurement only
    execution/   how the model runs: its execution plan (GEMM context, precision phases) and the blocks' kernels
    model/       the policy: the decoder, its families, LoRA, AQN noise, loading, export
    rollout/     sampling completions: the engine and the reference sampler behind one seam
    evaluation/  accuracy of a policy, comparisons of runs
    rl/          the RL loop: GRPO/DAPO, the trainer and its phases, data parallelism
    cli          the `qerl` command
"""

import os as _os

# OpenMP threads that spin while waiting turn every small CPU op 15-150x slower as soon as another process shares
# the cores (measured on 2-core machines: a 0.9 ms matmul took 16 ms). Passive waiting costs nothing when alone.
# It only takes effect if set before torch loads its OpenMP runtime, hence here, at the package's first import.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
