"""Sampling completions from the policy: the rollout backends the trainer and the evaluation share.

Owns `backends` (the seam: `make_backend` picks the engine or the reference sampler, `sync` applies AQN noise),
`generate` (batched sampling with the static KV cache: the reference) and `engine` (the CUDA rollout engine: CUDA
graphs per batch bucket, GPU sampling, compaction).

May import: qerl.execution, qerl.model.
"""
