"""The RL algorithm and its loop: rollout -> score -> GRPO/DAPO update of the LoRA weights.

Owns `grpo` (advantages and losses), `trainer` (the loop: it wires the components below, and `train_step` is the
step; the run folder keeps its state), `scoring` (a step's rewards and accuracy), `reward_calls` (the reward
functions called in either form, async ones together, each within its budget), `update` (the policy update of one
step), `logprobs` (the update's forward), `optim` (the optimizer and its schedule), `metrics` (a step's metrics,
reduced over the ranks), `memory` (a step's peak memory, the held-weights budget), `rng` (the generators' states a
checkpoint keeps), `state_check` (a checkpoint's state checked before the trainer applies it), `batch` (the batch
passed between the step's phases), `distributed` (data-parallel training over torch.distributed), `launch`
(`torchrun` as a subprocess), `tracking` (the tracker interface the loop logs through) and `plots` (training curves
as PNGs).

May import: qerl.config, qerl.debug, qerl.errors, qerl.data, qerl.execution, qerl.grading, qerl.model, qerl.quant, qerl.rollout, qerl.run.
"""
