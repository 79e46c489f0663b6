"""Problems and rewards: what the policy is asked, and how its answers are scored.

Owns `example` (one problem, the record every part shares), `problems` (the generated arithmetic task, the GSM8K /
MATH-500 loaders, prompts, the resumable sampler), `tables` (hub datasets and local files through `datasets`),
`prompt_length` (prompts checked against the model's context) and `rewards` (the reward registry).

May import: qerl.grading, qerl.plugins.
"""
