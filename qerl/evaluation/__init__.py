"""Judging trained policies: held-out accuracy of one policy, and comparisons of many runs.

Owns `evaluate` (`qerl eval`: accuracy, pass@k, per-example samples, perplexity) and `report` (arms x seeds: mean
± 95% CI curves, accuracy and steps-to-threshold tables, read from run folders alone).

May import: qerl.config, qerl.errors, qerl.data, qerl.grading, qerl.model, qerl.quant, qerl.rollout, qerl.run.
"""
