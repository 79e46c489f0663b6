"""Sampling completions from the policy: the rollout backends the trainer and the evaluation share.

Owns `engine` (the one sampler: static KV cache, CUDA graphs per batch bucket, GPU sampling, compaction; and its
reference configuration, a plain loop over the model's forward) with the parts of a call it runs (`kv_cache`,
`rows`, `lockstep`, `speculation`, `rollout_call`, `call`), `sampling` (what a call is made of: `Rollout`,
drawing tokens, the argument checks), `generate` (the reference as a function), `backends` (the seam: a backend's
`sync` applies AQN noise and the current LoRA), `vllm_backend` (a colocated vLLM engine, optional) and `factory`
(`make_backend` picks one by `rollout.backend`), `tool_calls` (a tool call in the model's words, the tool turn's
glue) and `multi_turn` (rows that call tools while the others decode).

May import: qerl.config, qerl.errors, qerl.execution, qerl.model, qerl.plugins, qerl.tools.
"""
