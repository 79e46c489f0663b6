"""The shared-prompt forward (`qerl.execution.shared_prompts`): what it computes against the plain forward, family by
family, is tests/test_model.py's (test_shared_prompts_*); here its parts."""
from __future__ import annotations

import torch


def test_rows_of_a_shared_prompt_sum_their_gradients_in_one_order():
    """Many rows read one prompt's keys and values (`per_row`); their gradients into it must sum in the same order
    every time, or two runs of one step differ in their last bits (README, Determinism). `per_prompt[owner]` summed
    them from two CPU threads at once: 26 different results in 200 backwards of this case."""
    from qerl.execution.shared_prompts import per_row

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(0)
        prompt = torch.randn(1, 3, 60, 64, generator=g, requires_grad=True)  # past the CPU ops' grain: 2 threads
        owner, upstream = torch.zeros(8, dtype=torch.long), torch.randn(8, 3, 60, 64, generator=g)
        grads = []
        for _ in range(100):
            prompt.grad = None
            per_row(prompt, owner).backward(upstream)
            grads.append(prompt.grad.clone())
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(grads[0], x) for x in grads)
    assert torch.equal(per_row(prompt, owner), prompt[owner])
