"""Sampling completions from the policy: the rollout backends the trainer and the evaluation share.

Owns `engine` (the one sampler: static KV cache, CUDA graphs per batch bucket, GPU sampling, compaction; and its
reference configuration, a plain loop over the model's forward), `sampling` (what a call is made of: `Rollout`,
drawing tokens, the argument checks), `generate` (the reference as a function) and `backends` (the seam:
`make_backend` picks the engine or the reference, `sync` applies AQN noise).

May import: qerl.model.
"""
